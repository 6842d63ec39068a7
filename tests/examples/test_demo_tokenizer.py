"""The Qwen tokenizer built from the dashscope wheel matches tiktoken and Qwen's known ids."""

import sys

import pytest

from examples import tokenizer as qt
from examples.text import pydoc_documents

pytest.importorskip("tiktoken")
if not qt.importlib.util.find_spec("dashscope"):
    pytest.skip("needs `pip install --no-deps dashscope` (it holds qwen.tiktoken)", allow_module_level=True)

TRICKY = [
    "Hello world!",
    "I'm sure they'LL say DON'T, we've 12345 apples & 3.14159 pies.",
    "  leading spaces, trailing spaces   \n\n\n  indented\tand\ttabs\r\nwindows line\r\n",
    "naïve café — “quotes” ‘single’ … ünïcödé",
    "日本語のテキスト、中文文本，한국어 텍스트.",
    "emoji 🙂🚀 and zero-width\u200bjoiner",
    "def f(x):\n    return x ** 2  # comment\n\n\n",
    "",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # One directory for the whole pytest session: the other demo tests reuse this conversion.
    return tmp_path_factory.getbasetemp() / "qwen_tokenizer"


@pytest.fixture(scope="module")
def tok(cache_dir):
    return qt.build_qwen_tokenizer(cache_dir=cache_dir)


@pytest.fixture(scope="module")
def reference():
    return qt.build_qwen_tiktoken_encoding()


def test_vocab_file_found_without_importing_dashscope():
    path = qt.qwen_tiktoken_path()
    assert path.name == "qwen.tiktoken" and path.is_file()
    assert "dashscope" not in sys.modules


def test_missing_dashscope_says_how_to_install(monkeypatch):
    monkeypatch.setattr(qt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps dashscope"):
        qt.build_qwen_tokenizer()


def test_sizes_and_special_tokens(tok):
    assert len(tok) == 151_646
    assert qt.QWEN_MODEL_VOCAB_SIZE == 151_936
    for text, idx in qt.QWEN_SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(text) == idx
        assert tok.encode(text) == [idx]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == 151643
    assert tok.bos_token is None


def test_known_qwen_ids(tok):
    # Ids of the published Qwen2/Qwen3 tokenizer; digits are split one by one.
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert tok.encode("12345") == [16, 17, 18, 19, 20]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]


def test_same_ids_as_tiktoken_and_exact_round_trip(tok, reference):
    texts = TRICKY + pydoc_documents()[:12]
    ours = tok(texts).input_ids
    for text, ids in zip(texts, ours):
        assert ids == reference.encode(text, disallowed_special=())
        assert tok.decode(ids) == text


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cache_is_reused_and_keyed(tok, cache_dir, monkeypatch):
    (entry,) = [p for p in cache_dir.iterdir()]  # written by the `tok` fixture
    assert entry.name == qt._cache_key(qt.qwen_tiktoken_path())

    def no_conversion(_):
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(qt, "_convert", no_conversion)
    again = qt.build_qwen_tokenizer(cache_dir=cache_dir)
    assert again.encode(TRICKY[1]) == tok.encode(TRICKY[1])

    # Any change to what the conversion depends on moves to a new key: no stale reuse.
    monkeypatch.setattr(qt, "_CACHE_FORMAT", qt._CACHE_FORMAT + 1)
    assert qt._cache_key(qt.qwen_tiktoken_path()) != entry.name
    with pytest.raises(AssertionError, match="cached tokenizer"):
        qt.build_qwen_tokenizer(cache_dir=cache_dir)
