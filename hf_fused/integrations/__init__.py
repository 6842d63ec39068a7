"""Integrations with training libraries that call a model in their own ways.

:mod:`hf_fused.integrations.trl`: TRL's trainers call ``model(..., fused_lm_head=True)`` (their own fused LM
head); on a model patched by :func:`hf_fused.apply_fused_loss` hf_fused's ops answer that call. It adjusts TRL's
modules when they are imported (:mod:`hf_fused.integrations.import_hooks`), so patching never imports TRL.
"""
