"""Imported at start-up by every process that tests/distributed launches on CPU ranks (``launch.worker_env`` puts
this folder on ``PYTHONPATH`` for CPU runs only): our workers, and TRL's scripts launched as users launch them.

accelerate applies its FSDP plugin only on accelerators: under an FSDP config its state switches to FSDP for
``MULTI_GPU``, ``MULTI_XPU``, ... and leaves CPU ranks at ``MULTI_CPU``, so ``Trainer`` silently wraps the model in
DDP (CI's "FSDP2" cases once were DDP on CPU ranks while the GPU runs were FSDP). FSDP1 and FSDP2
themselves run on CPU over gloo; this makes accelerate's state on CPU ranks what it is on GPUs, and the engine tests
check the wrapper every run used. Nothing changes unless accelerate is handed an FSDP plugin (an FSDP config, or
``TrainingArguments(fsdp=...)``).
"""

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel

_state_init = AcceleratorState.__init__

def _fsdp_state_init(self, *args, fsdp_plugin=None, **kwargs):
    _state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    # every later AcceleratorState() (accelerate makes many) copies PartialState's MULTI_CPU back in
    if self.distributed_type != DistributedType.MULTI_CPU:
        return
    if fsdp_plugin is not None:  # the Accelerator's own: what the device branch of AcceleratorState does
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
    if getattr(self, "fsdp_plugin", None) is not None:
        self.distributed_type = DistributedType.FSDP

AcceleratorState.__init__ = _fsdp_state_init

# FSDP1 takes the CPU without an index (accelerate passes its device, and FSDP1 then raises "Inconsistent
# compute device and `device_id` ... cpu vs cpu:0")
_fsdp1_init = FullyShardedDataParallel.__init__

def _fsdp1_cpu_init(self, *args, device_id=None, **kwargs):
    if isinstance(device_id, torch.device) and device_id.type == "cpu":
        device_id = torch.device("cpu")
    _fsdp1_init(self, *args, device_id=device_id, **kwargs)

FullyShardedDataParallel.__init__ = _fsdp1_cpu_init

# FSDP1's full state dict "offloaded to the CPU" (accelerate's save_model asks for it) clones freed storage
# when the ranks are CPU ranks: a segfault in state_dict(). Their parameters are on the CPU already.
_full_config_init = FullStateDictConfig.__init__

def _full_config_on_cpu_init(self, *args, **kwargs):
    _full_config_init(self, *args, **kwargs)
    self.offload_to_cpu = False

FullStateDictConfig.__init__ = _full_config_on_cpu_init
