"""Integrations with training libraries that call a model in their own ways.

:mod:`hf_fused.integrations.trl`: TRL's trainers call ``model(..., fused_lm_head=True)`` (their own fused LM
head); on a model patched by :func:`hf_fused.apply_fused_loss` hf_fused's ops answer that call. Imported
lazily by the model layer, only when TRL is installed.
"""
