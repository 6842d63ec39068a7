"""Fixtures of the documentation tests (helpers: doc_blocks.py)."""

from __future__ import annotations

import pytest
import torch

from doc_blocks import CHAT_TEMPLATE, tiny_dataset
from models import make_tokenizer, make_word_model


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """``save(*ids)`` writes the tiny checkpoint and tokenizer under each Hub id in ``tmp_path`` (the working
    directory while the test runs); ``datasets.load_dataset`` answers the documentation's dataset names with
    :func:`tiny_dataset`."""
    import datasets

    monkeypatch.chdir(tmp_path)
    real = datasets.load_dataset

    def load_dataset(name, *args, **kwargs):
        tiny = tiny_dataset(name, *args, **kwargs)
        return tiny if tiny is not None else real(name, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)

    def save(*ids: str) -> None:
        for name in ids:
            torch.manual_seed(0)
            make_word_model().save_pretrained(name)
            tokenizer = make_tokenizer()
            tokenizer.chat_template = CHAT_TEMPLATE
            tokenizer.save_pretrained(name)

    return save
