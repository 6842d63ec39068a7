"""``nn.DataParallel``: what ``transformers.Trainer`` does when a plain ``python train.py`` sees several GPUs (no
launcher). Each forward replicates the model onto every GPU (shallow copies of the instance) and splits the
batch; hf_fused's patch must follow each replica (``ReplicatePatched`` in hf_fused/model/patch.py), or a replica
would compute with the first GPU's parameters.

Compared with the unpatched ``Trainer`` under the same DataParallel (one plain process seeing 2 GPUs, same
batch and sample order): every logged loss and every updated parameter with test_engines.py's fp32 tolerances
(``parity.assert_matches_reference``). Also checked: both runs really were DataParallel (``args.n_gpu == 2``),
hf_fused computed the head in every replica of every micro-batch, and never in the stock run. Needs 2 GPUs."""

from __future__ import annotations

import pytest

from launch import train
from parity import assert_matches_reference

pytestmark = [pytest.mark.multigpu, pytest.mark.distributed]

BATCH = 4  # per step, split over the 2 replicas
STEPS = 3

CASES = {
    "Trainer+apply_fused_loss-tied-ga2-checkpointing": ("qwen3-tied", "Trainer", dict(fused=True, ga=2, grad_ckpt=True)),
    "FusedTrainer-lora-on-lm_head": ("llama", "FusedTrainer", dict(lora="lm_head")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dataparallel_training_matches_unpatched_dataparallel(name, saved_models):
    model, trainer, options = CASES[name]
    common = dict(model_dir=saved_models(model), batch=BATCH, steps=STEPS, cuda=True, gpus=2)
    reference_options = {k: v for k, v in options.items() if k != "fused"}
    ref = train(dict(common, trainer="Trainer", **reference_options), None)
    got = train(dict(common, trainer=trainer, **options), None)
    assert ref["n_gpu"] == got["n_gpu"] == 2, "the Trainer should have wrapped the model in nn.DataParallel"
    assert ref["head_calls"] == 0
    micro_batches = STEPS * options.get("ga", 1)
    assert got["head_calls"] >= 2 * micro_batches, f"{got['head_calls']} head computations for 2 replicas × {micro_batches}"
    assert_matches_reference(got, ref, ranks=1)
