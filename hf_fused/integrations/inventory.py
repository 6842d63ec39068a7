"""The inventory of hf_fused's process-wide patches of transformers and TRL (listed, with their columns, in
:mod:`hf_fused.integrations`): :data:`PATCHES`, :func:`install_all` and :func:`uninstall_all`."""

from __future__ import annotations

from .import_hooks import finder_installed
from .patching import Rebind, ThirdPartyPatch
from .transformers_trainer import LIGER_KERNEL, PREDICTION_STEP
from .trl.async_distillation import TRL_ASYNC_DISTILLATION
from .trl.concatenated_forward import TRL_CPO, TRL_ORPO
from .trl.distillation import TRL_DISTILLATION
from .trl.gkd import TRL_GKD
from .trl.hooks import TRL_FUSED_HEAD, TRL_HEAD_ADAPTER_CHECKS
from .trl.online_dpo import TRL_ONLINE_DPO
from .trl.server_distillation import TRL_SERVER_DISTILLATION

#: The inventory, in installation order (TRL's head first: the trainer entries skip a refused protocol).
PATCHES: tuple[ThirdPartyPatch, ...] = (
    PREDICTION_STEP, LIGER_KERNEL, TRL_FUSED_HEAD, *TRL_HEAD_ADAPTER_CHECKS, TRL_DISTILLATION, TRL_GKD,
    TRL_ASYNC_DISTILLATION, TRL_SERVER_DISTILLATION, TRL_ORPO, TRL_CPO, TRL_ONLINE_DPO,
)


def install_all() -> None:
    """Install every entry of :data:`PATCHES` (idempotent; see :meth:`ThirdPartyPatch.install`)."""
    for patch in PATCHES:
        patch.install()


def uninstall_all() -> None:
    """Uninstall every entry, last installed first: every rebound attribute holds its original again, no import
    hook is pending and the import finder has left ``sys.meta_path``. Patched models keep their patched forward."""
    for patch in reversed(PATCHES):
        patch.uninstall()


def rebinds() -> list[Rebind]:
    """Every attribute the installed entries have rebound right now."""
    return [rebind for patch in PATCHES for rebind in patch.rebinds]


__all__ = ["PATCHES", "finder_installed", "install_all", "rebinds", "uninstall_all"]
