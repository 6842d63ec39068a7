"""The package face: every public name resolves, and the documented entry points are the layers' own objects."""

import hf_fused


def test_every_public_name_resolves_to_the_layer_object():
    from hf_fused import model, ops
    from hf_fused.trainers.async_grpo import FusedAsyncGRPOTrainer
    from hf_fused.trainers.grpo import FusedGRPOTrainer
    from hf_fused.trainers.sft import FusedTrainer

    for name in hf_fused.__all__:
        assert getattr(hf_fused, name) is not None, name
    assert hf_fused.apply_fused_loss is model.apply_fused_loss
    assert hf_fused.linear_logprobs is ops.linear_logprobs
    assert hf_fused.FusedTrainer is FusedTrainer and hf_fused.FusedGRPOTrainer is FusedGRPOTrainer
    assert hf_fused.FusedAsyncGRPOTrainer is FusedAsyncGRPOTrainer
    for warning in ("FusedLossBypassedWarning", "HintMissedWarning"):
        assert issubclass(getattr(hf_fused, warning), Warning)


def test_unknown_name_raises_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hf_fused.nope
