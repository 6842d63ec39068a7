"""The SFT demo's pieces, on tiny sizes (full training runs are too slow for tests)."""

import pytest
import torch
import transformers

from examples import __main__ as cli
from examples import sft


def test_args_defaults_and_validation():
    args = sft.parse_args(["--device", "cpu"])
    assert (args.steps, args.seq_len, args.batch_size, args.rtol) == (20, 128, 4, 1e-4)
    with pytest.raises(SystemExit):
        sft.parse_args(["--steps", "0"])


def test_dispatch_rejects_unknown_demo():
    with pytest.raises(SystemExit):
        cli.main(["nope"])


def test_head_loss_memory_fused_vs_unfused():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(config)
    ids = torch.randint(0, 4096, (2, 64))
    labels = ids.clone()
    labels[:, :5] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    out = sft.head_loss_peak_memory(model, batch, torch.device("cpu"))
    logits_bytes = ids.numel() * 4096 * 4
    assert out["unfused"]["peak_bytes"] >= 2 * logits_bytes
    assert 0 < out["fused"]["peak_bytes"] < out["unfused"]["peak_bytes"]
    assert out["fused"]["loss"] == pytest.approx(out["unfused"]["loss"], rel=1e-5)
    assert out["fused"]["max_grad_diff"] < 1e-5


def test_main_end_to_end_on_a_local_checkpoint(tmp_path, tmp_path_factory, capsys):
    from examples import tokenizer as qt

    if qt.importlib.util.find_spec("dashscope") is None:
        pytest.skip("needs `pip install --no-deps dashscope`")
    tok = qt.build_qwen_tokenizer(cache_dir=tmp_path_factory.getbasetemp() / "qwen_tokenizer")
    config = transformers.Qwen3Config(
        vocab_size=qt.QWEN_MODEL_VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
    )
    ckpt = tmp_path / "ckpt"
    transformers.Qwen3ForCausalLM(config).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)

    status = sft.main(["--model", str(ckpt), "--steps", "2", "--seq-len", "32", "--batch-size", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "OK: max relative loss difference" in out and "unfused" in out and "median step time: fused" in out
