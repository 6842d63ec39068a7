"""pydoc text and the SFT token blocks built from it."""

from types import SimpleNamespace

import pytest
import torch

from examples.text import IGNORE_INDEX, TokenBlocks, build_sft_blocks, pydoc_documents, pydoc_topics


class ByteTokenizer:
    """Minimal stand-in with the tokenizer interface build_sft_blocks uses: one id per UTF-8 byte."""

    eos_token_id = 256

    def __call__(self, texts, add_special_tokens=True):
        return SimpleNamespace(input_ids=[list(t.encode()) for t in texts])

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def test_topics_are_deterministic_real_english():
    topics = pydoc_topics()
    names = [name for name, _ in topics]
    assert names == sorted(names) and len(names) > 50
    assert topics == pydoc_topics()
    assert all(text and text == text.strip() for _, text in topics)
    assert pydoc_documents() == [text for _, text in topics]
    assert sum(map(len, pydoc_documents())) > 100_000
    assert "assert" in dict(topics)["assert"].lower()


def test_blocks_shapes_dtypes_and_content():
    tok = ByteTokenizer()
    blocks = build_sft_blocks(tok, 64, num_blocks=10)
    assert isinstance(blocks, torch.utils.data.Dataset) and len(blocks) == 10
    item = blocks[3]
    assert set(item) == {"input_ids", "attention_mask", "labels"}
    for t in item.values():
        assert t.shape == (64,) and t.dtype == torch.int64
    assert bool((item["attention_mask"] == 1).all())

    # Blocks are consecutive slices of prompt + completion + eos, in topic order.
    name, text = pydoc_topics()[0]
    stream = blocks.input_ids.reshape(-1).tolist()
    prompt = f"Explain the Python help topic '{name}'.\n"
    assert tok.decode(stream).startswith(prompt + text[: 640 - len(prompt) - 10])

    # Labels equal ids except on prompt tokens, which are ignored; eos is a target.
    masked = blocks.labels == IGNORE_INDEX
    assert torch.equal(blocks.labels[~masked], blocks.input_ids[~masked])
    assert bool(masked.reshape(-1)[: len(prompt)].all()) and not bool(masked.reshape(-1)[len(prompt)])


def test_mask_prompt_off_and_all_blocks():
    tok = ByteTokenizer()
    blocks = build_sft_blocks(tok, 512, mask_prompt=False)
    assert torch.equal(blocks.labels, blocks.input_ids)
    total = sum(len(p) + len(t.encode()) + 1 for p, t in [(f"Explain the Python help topic '{n}'.\n".encode(), t) for n, t in pydoc_topics()])
    assert len(blocks) == total // 512
    assert int((blocks.input_ids == tok.eos_token_id).sum()) >= len(pydoc_topics()) - 1


def test_works_with_trainer_collator():
    from transformers import default_data_collator

    blocks = build_sft_blocks(ByteTokenizer(), 64, num_blocks=4)
    batch = default_data_collator([blocks[i] for i in range(4)])
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 64)


def test_errors():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="seq_len"):
        build_sft_blocks(tok, 1)
    with pytest.raises(ValueError, match="only .* blocks"):
        build_sft_blocks(tok, 4096, num_blocks=10_000)
    with pytest.raises(ValueError, match="only prompt tokens"):
        build_sft_blocks(tok, 8)
    with pytest.raises(ValueError, match="eos"):
        build_sft_blocks(SimpleNamespace(eos_token_id=None), 64)
    with pytest.raises(ValueError, match="num_blocks, seq_len"):
        TokenBlocks(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))


def test_real_qwen_tokenizer(tmp_path_factory):
    from examples import tokenizer as qt

    if qt.importlib.util.find_spec("dashscope") is None:
        pytest.skip("needs `pip install --no-deps dashscope`")
    tok = qt.build_qwen_tokenizer(cache_dir=tmp_path_factory.getbasetemp() / "qwen_tokenizer")
    blocks = build_sft_blocks(tok, 128, num_blocks=8)
    assert blocks.input_ids.shape == (8, 128)
    assert int(blocks.input_ids.max()) < len(tok)
    assert tok.decode(blocks.input_ids[0]).startswith("Explain the Python help topic 'assert'.\n")
