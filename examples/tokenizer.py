"""The real Qwen byte-level BPE tokenizer, built offline from the ``dashscope`` wheel.

Qwen's 151,643 mergeable ranks ship as ``dashscope/resources/qwen.tiktoken`` inside the
``dashscope`` wheel on PyPI.  We only read that data file: ``dashscope`` itself is never
imported (installed with ``--no-deps`` its imports would fail, and it would pull in an HTTP
client we have no use for).

Token ids (identical to Qwen / Qwen2 / Qwen3):

* ``0 .. 151642``   the BPE vocabulary, in rank order (id == tiktoken rank);
* ``151643``        ``<|endoftext|>``  (eos and pad, as in the Qwen3 *base* models);
* ``151644``        ``<|im_start|>``   (ChatML);
* ``151645``        ``<|im_end|>``     (ChatML).

The tokenizer therefore has 151,646 tokens, while Qwen models pad their embedding matrix to
``QWEN_MODEL_VOCAB_SIZE`` = 151,936 rows (a multiple of 128, for matmul efficiency); the
extra rows are never produced by the tokenizer.

eos choice: we follow the Qwen3 base checkpoints (``eos = pad = <|endoftext|>``) because the
demos train on raw documents, where ``<|endoftext|>`` is the document separator.  The chat
models use ``eos = <|im_end|>`` instead; the ChatML ``chat_template`` set here still emits
``<|im_end|>`` after every turn, so chat-formatted data works either way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import transformers

__all__ = [
    "QWEN_PATTERN",
    "QWEN_SPECIAL_TOKENS",
    "QWEN_MODEL_VOCAB_SIZE",
    "qwen_tiktoken_path",
    "build_qwen_tiktoken_encoding",
    "build_qwen_tokenizer",
]

# Qwen's pre-tokenisation regex (from Qwen's tokenization_qwen.py).  It differs from
# cl100k's only in splitting numbers into single digits (``\p{N}`` instead of ``\p{N}{1,3}``).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN_SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
}

#: ``vocab_size`` of Qwen model configs: the embedding / lm_head rows, padded past the
#: tokenizer's 151,646 tokens.
QWEN_MODEL_VOCAB_SIZE = 151_936

_NUM_RANKS = 151_643
_EOS = _PAD = "<|endoftext|>"

# Minimal ChatML template (the format of Qwen chat models, without tool / thinking support).
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Bump when the conversion below changes, so that caches written by older code are ignored.
_CACHE_FORMAT = 1

_INSTALL_HINT = (
    "The Qwen vocabulary file 'dashscope/resources/qwen.tiktoken' was not found. It ships "
    "inside the 'dashscope' wheel; install it without its dependencies with:\n"
    "    pip install --no-deps dashscope"
)


def qwen_tiktoken_path() -> Path:
    """Path of ``qwen.tiktoken`` inside the installed ``dashscope`` package.

    ``importlib.util.find_spec`` on a top-level package only locates it; it does not execute
    ``dashscope/__init__.py`` (which would fail without dashscope's dependencies).

    Raises:
        FileNotFoundError: dashscope is not installed or lacks the file; the message says how
            to install it.
    """
    spec = importlib.util.find_spec("dashscope")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / "resources" / "qwen.tiktoken"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(_INSTALL_HINT)


def _load_ranks(path: Path) -> dict[bytes, int]:
    """Read the base64 ``token rank`` lines into ``{token bytes: rank}``; checks the count."""
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(path))
    if len(ranks) != _NUM_RANKS or sorted(ranks.values()) != list(range(_NUM_RANKS)):
        raise ValueError(
            f"{path} does not look like Qwen's vocabulary: expected ranks 0..{_NUM_RANKS - 1}, "
            f"got {len(ranks)} entries"
        )
    return ranks


def build_qwen_tiktoken_encoding():
    """Qwen's tokenizer as a ``tiktoken.Encoding`` (the reference implementation).

    Returns:
        ``tiktoken.Encoding`` with the 151,643 ranks, ``QWEN_PATTERN`` and the three special
        tokens.  Encode text containing special tokens with ``allowed_special="all"``.
    """
    import tiktoken

    return tiktoken.Encoding(
        name="qwen",
        pat_str=QWEN_PATTERN,
        mergeable_ranks=_load_ranks(qwen_tiktoken_path()),
        special_tokens=dict(QWEN_SPECIAL_TOKENS),
    )


def _default_cache_dir() -> Path:
    base = os.environ.get("HF_FUSED_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hf_fused"
    )
    return Path(base) / "qwen_tokenizer"


def _cache_key(vocab_file: Path) -> str:
    """Hash of everything the converted tokenizer depends on.

    A different vocabulary file, regex, special-token table, template, conversion code
    version or tokenizers/transformers version gives a different directory, so a stale cache
    is never picked up.
    """
    import tokenizers

    h = hashlib.sha256()
    h.update(vocab_file.read_bytes())
    for part in (
        QWEN_PATTERN,
        repr(sorted(QWEN_SPECIAL_TOKENS.items())),
        _EOS,
        _PAD,
        _CHAT_TEMPLATE,
        str(_CACHE_FORMAT),
        tokenizers.__version__,
        transformers.__version__,
    ):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _convert(vocab_file: Path) -> transformers.PreTrainedTokenizerFast:
    """Convert the tiktoken ranks to a ``tokenizers`` BPE (takes ~10-30 s on one core)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    _load_ranks(vocab_file)  # validate before the slow conversion
    # TikTokenConverter derives BPE merges from the ranks, splits with our regex, then maps
    # bytes to GPT-2's printable byte alphabet; special tokens are appended in dict order,
    # so they land on ids 151643, 151644, 151645.
    backend = TikTokenConverter(
        vocab_file=str(vocab_file),
        pattern=QWEN_PATTERN,
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS),
    ).converted()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=_EOS,
        pad_token=_PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t not in (_EOS, _PAD)],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = _CHAT_TEMPLATE
    for text, want in QWEN_SPECIAL_TOKENS.items():
        got = tok.convert_tokens_to_ids(text)
        if got != want:
            raise RuntimeError(f"converted tokenizer maps {text} to {got}, expected {want}")
    return tok


def build_qwen_tokenizer(cache_dir: str | os.PathLike | None = None) -> transformers.PreTrainedTokenizerFast:
    """Qwen's tokenizer as a transformers fast tokenizer, converted once and cached on disk.

    Args:
        cache_dir: where converted tokenizers are kept (default ``$HF_FUSED_CACHE`` or
            ``~/.cache/hf_fused``, plus ``/qwen_tokenizer``).  Each conversion lives in a
            subdirectory named by a content hash (see ``_cache_key``).

    Returns:
        A fast tokenizer with 151,646 tokens (``len(tok)``), ``eos_token = pad_token =
        <|endoftext|>`` (id 151643), no bos token, a ChatML ``chat_template``, and
        ``add_special_tokens`` adding nothing.  Its ids equal tiktoken's for the same text.

    Raises:
        FileNotFoundError: the dashscope wheel (which holds the vocabulary) is not installed.
    """
    vocab_file = qwen_tiktoken_path()
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    target = root / _cache_key(vocab_file)
    if (target / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(target))

    tok = _convert(vocab_file)
    root.mkdir(parents=True, exist_ok=True)
    # Write to a private directory, then rename: a concurrent or interrupted build never
    # leaves a half-written cache entry where a reader could find it.
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first; its copy is equivalent.
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
