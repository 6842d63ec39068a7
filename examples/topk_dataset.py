"""An offline top-k distillation dataset: a local teacher's ``k`` most likely next tokens and their log-probs at every
position of a tokenized dataset, computed by :func:`hf_fused.ops.linear_topk_logprobs` (no ``[tokens, vocab]``
logits) and written as Arrow (``datasets.save_to_disk``) or parquet, batch by batch, with a progress bar.

``python -m examples.topk_dataset --teacher PATH --dataset PATH --output DIR [--top-k 64] [--batch-size 8]
[--temperature 1.0] [--format arrow|parquet] [--layout axolotl|trl] [--split train] [--max-examples N]
[--device cpu|cuda] [--dtype auto|float32|bfloat16|float16]``

Input: any ``transformers`` causal LM saved locally (``--teacher``) and a ``datasets`` dataset with an ``input_ids``
column (``--dataset``: a ``save_to_disk`` folder, or a ``.parquet`` / ``.json`` / ``.jsonl`` / ``.arrow`` file),
optionally ``labels`` (-100 where the token is not trained on, e.g. the prompt) and ``attention_mask``.

Output columns, one row per example (``T`` its length, ``k`` the top-k):

* ``--layout axolotl`` (default; what axolotl's KD plugin and ``docs/guides/offline_distillation.md``'s recipe
  read): ``input_ids``, ``attention_mask``, ``labels`` (copied; ``input_ids`` and ones when absent) and
  ``target_token_ids`` int32 ``[T][k]``, ``target_logprobs`` float32 ``[T][k]``, ``target_mask`` int8 ``[T][k]``. Row
  ``j`` is the teacher's distribution over ``input_ids[j + 1]`` (the prediction made at position ``j``); its mask is 1
  where ``labels[j + 1] != -100`` and ``attention_mask[j + 1] == 1``, and 0 on the last row.
* ``--layout trl`` (TRL's experimental async distillation sample): ``input_ids``, ``completion_mask`` (1 where
  ``labels != -100``), ``teacher_topk_ids`` int64 ``[T][k + 1]`` and ``teacher_topk_logprobs`` float32 ``[T][k + 1]``.
  Row ``i`` holds the candidates for ``input_ids[i]`` (vLLM's ``prompt_logprobs`` convention; row 0 is empty), the
  top-k then the realized token when it is not among them; empty slots hold -1 and ``-inf``.

Log-probs are of the teacher's logits after its own transform (soft-cap, scale: measured from its forward by
:func:`hf_fused.apply_fused_loss`) divided by ``--temperature``, over its full vocabulary (not renormalized over
the k). A ``topk_dataset.json`` beside the data records the teacher, k, temperature, layout and transform.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

__all__ = ["LAYOUTS", "SCHEMAS", "parse_args", "load_teacher", "load_tokenized", "teacher_topk", "topk_rows",
           "topk_table", "write_topk_dataset", "main"]

LAYOUTS = ("axolotl", "trl")
FORMATS = ("arrow", "parquet")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The parquet file of ``--format parquet`` inside ``--output``.
PARQUET_NAME = "data.parquet"
#: The provenance file written beside the data.
METADATA_NAME = "topk_dataset.json"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.topk_dataset",
        description="Write a teacher's top-k next-token log-probs for a tokenized dataset (offline distillation).",
    )
    p.add_argument("--teacher", required=True, metavar="PATH",
                   help="local transformers causal LM (a save_pretrained folder)")
    p.add_argument("--dataset", required=True, metavar="PATH",
                   help="tokenized dataset: a save_to_disk folder or a .parquet/.json/.jsonl/.arrow file")
    p.add_argument("--output", required=True, metavar="DIR", help="output folder (created; must be empty if it exists)")
    p.add_argument("--top-k", type=int, default=64, help="candidates per position (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per teacher forward (default 8)")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the teacher's logits by it (default 1)")
    p.add_argument("--format", choices=FORMATS, default="arrow", help="arrow (save_to_disk, default) or parquet")
    p.add_argument("--layout", choices=LAYOUTS, default="axolotl", help="column layout (default axolotl)")
    p.add_argument("--split", default="train", help="split of a DatasetDict (default train)")
    p.add_argument("--max-examples", type=int, default=None, help="only the first N examples")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="teacher weights' dtype (default: bfloat16 on cuda, float32 on cpu)")
    args = p.parse_args(argv)
    for name in ("top_k", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_examples is not None and args.max_examples < 1:
        p.error("--max-examples must be >= 1")
    if not args.temperature > 0:
        p.error("--temperature must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if os.path.exists(args.output) and os.listdir(args.output):
        p.error(f"--output {args.output} exists and is not empty")
    return args


def load_teacher(path: str, device: str = "cpu", dtype: str = "auto") -> torch.nn.Module:
    """The causal LM at ``path`` in eval mode on ``device``, patched by :func:`hf_fused.apply_fused_loss` (so its
    forward can return the hidden states lm_head receives, and its logit transform is measured)."""
    import transformers

    from hf_fused import apply_fused_loss

    torch_dtype = DTYPES.get(dtype) or (torch.bfloat16 if device == "cuda" else torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    return apply_fused_loss(model)


def load_tokenized(path: str, split: str = "train"):
    """The ``datasets.Dataset`` at ``path`` (a ``save_to_disk`` folder, or a parquet/json/arrow file).

    Raises:
        ValueError: no ``input_ids`` column, or an unknown file type.
    """
    import datasets

    if os.path.isdir(path):
        data = datasets.load_from_disk(path)
    else:
        kinds = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
        kind = kinds.get(Path(path).suffix)
        if kind is None:
            raise ValueError(f"--dataset {path}: expected a save_to_disk folder or one of {sorted(kinds)}")
        data = datasets.load_dataset(kind, data_files=path, split="train")
    if isinstance(data, datasets.DatasetDict):
        data = data[split]
    if "input_ids" not in data.column_names:
        raise ValueError(f"--dataset {path} has no input_ids column (columns: {data.column_names}); tokenize it first")
    return data


@torch.no_grad()
def teacher_topk(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int,
                 temperature: float = 1.0):
    """``TopKLogprobs`` ``[B, T, k]`` of a patched teacher for a right-padded batch, and each position's
    log-prob of the next token (``label_logprobs [B, T]``, 0 on the last position): the hidden states lm_head would
    receive (``fused_output="hidden_states"``), then :func:`hf_fused.ops.linear_topk_logprobs` with the teacher's
    measured transform and ``temperature``."""
    from hf_fused.ops import causal_shift
    from hf_fused.ops.topk_logprobs import linear_topk_logprobs

    hidden = model(input_ids=input_ids, attention_mask=attention_mask, fused_output="hidden_states").last_hidden_state
    head = model.get_output_embeddings()
    transform = dataclasses.replace(model._hf_fused.transform, temperature=temperature)
    next_tokens = causal_shift(torch.where(attention_mask.bool(), input_ids, -100))
    return linear_topk_logprobs(hidden, head.weight, k, head.bias, labels=next_tokens.to(hidden.device),
                                transform=transform)


#: Each layout's columns and their Arrow types (lists of ``T`` rows; the top-k columns lists of ``T`` lists).
SCHEMAS = {
    "axolotl": pa.schema([("input_ids", pa.list_(pa.int64())), ("attention_mask", pa.list_(pa.int64())),
                          ("labels", pa.list_(pa.int64())), ("target_token_ids", pa.list_(pa.list_(pa.int32()))),
                          ("target_logprobs", pa.list_(pa.list_(pa.float32()))),
                          ("target_mask", pa.list_(pa.list_(pa.int8())))]),
    "trl": pa.schema([("input_ids", pa.list_(pa.int64())), ("completion_mask", pa.list_(pa.int64())),
                      ("teacher_topk_ids", pa.list_(pa.list_(pa.int64()))),
                      ("teacher_topk_logprobs", pa.list_(pa.list_(pa.float32())))]),
}


def topk_rows(example_ids: list[np.ndarray], attention: list[np.ndarray], labels: list[np.ndarray], ids: np.ndarray,
              logprobs: np.ndarray, label_logprobs: np.ndarray, layout: str) -> dict[str, list[np.ndarray]]:
    """The output columns for a batch's examples (lists of 1-D arrays of each example's length ``T``) from the
    teacher's right-padded ``ids``/``logprobs`` ``[B, T_max, k]`` and next-token ``label_logprobs [B, T_max]``
    (module docstring: the layouts): per column, one array per example (``[T]`` or ``[T, k]``)."""
    columns: dict[str, list[np.ndarray]] = {name: [] for name in SCHEMAS[layout].names}
    k = ids.shape[-1]
    for b, (tokens, att, lab) in enumerate(zip(example_ids, attention, labels)):
        n = len(tokens)
        top_ids, top_lp = ids[b, :n], logprobs[b, :n]
        if layout == "axolotl":
            trained = np.zeros(n, dtype=np.int8)
            trained[:-1] = (lab[1:] != -100) & (att[1:] != 0)
            row = {"input_ids": tokens, "attention_mask": att, "labels": lab, "target_token_ids": top_ids,
                   "target_logprobs": top_lp, "target_mask": np.repeat(trained[:, None], k, axis=1)}
        else:  # TRL: row i describes input_ids[i] (shift by one), top-k then the realized token if missing
            full_ids = np.full((n, k + 1), -1, dtype=np.int64)
            full_lp = np.full((n, k + 1), -np.inf, dtype=np.float32)
            full_ids[1:, :k], full_lp[1:, :k] = top_ids[:-1], top_lp[:-1]
            realized = tokens[1:]
            missing = ~(top_ids[:-1] == realized[:, None]).any(axis=1)
            full_ids[1:, k] = np.where(missing, realized, -1)
            full_lp[1:, k] = np.where(missing, label_logprobs[b, : n - 1], -np.inf)
            row = {"input_ids": tokens, "completion_mask": (lab != -100).astype(np.int64),
                   "teacher_topk_ids": full_ids, "teacher_topk_logprobs": full_lp}
        for name, value in row.items():
            columns[name].append(value)
    return columns


def _list_array(arrays: list[np.ndarray], list_type: pa.DataType) -> pa.Array:
    """An Arrow list column (one list per array; a ``[T, k]`` array a list of ``T`` lists of ``k``) built from the
    flat values and offsets, with no Python object per element."""
    lengths = np.array([len(a) for a in arrays], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    if pa.types.is_list(list_type.value_type):
        inner_type = list_type.value_type
        width = arrays[0].shape[1] if arrays else 0
        values = pa.array(np.concatenate([a.reshape(-1) for a in arrays]), type=inner_type.value_type)
        inner_offsets = pa.array(np.arange(0, int(lengths.sum()) * width + 1, max(width, 1), dtype=np.int32))
        values = pa.ListArray.from_arrays(inner_offsets, values, type=inner_type)
    else:
        values = pa.array(np.concatenate(arrays), type=list_type.value_type)
    return pa.ListArray.from_arrays(offsets, values, type=list_type)


def topk_table(columns: dict[str, list[np.ndarray]], layout: str) -> pa.Table:
    """:func:`topk_rows`'s columns as an Arrow table of the layout's schema."""
    schema = SCHEMAS[layout]
    return pa.table([_list_array(columns[field.name], field.type) for field in schema], schema=schema)


def _batches(data, batch_size: int) -> Iterator[tuple[list, list, list]]:
    """``(input_ids, attention_mask, labels)`` per batch of examples, as int64 arrays of each example's length."""
    has_mask, has_labels = "attention_mask" in data.column_names, "labels" in data.column_names
    for start in range(0, len(data), batch_size):
        chunk = data[start : start + batch_size]
        ids = [np.asarray(x, dtype=np.int64) for x in chunk["input_ids"]]
        att = [np.asarray(x, dtype=np.int64) for x in chunk["attention_mask"]] if has_mask else [
            np.ones_like(x) for x in ids]
        lab = [np.asarray(x, dtype=np.int64) for x in chunk["labels"]] if has_labels else [x.copy() for x in ids]
        for tokens, mask, labels in zip(ids, att, lab):
            if not len(tokens) == len(mask) == len(labels):
                raise ValueError(f"example lengths differ: input_ids {len(tokens)}, attention_mask {len(mask)}, "
                                 f"labels {len(labels)}")
            if len(tokens) == 0:
                raise ValueError("an example has no tokens; drop empty examples first")
        yield ids, att, lab


def _padded(arrays: list[np.ndarray], value: int, device) -> torch.Tensor:
    width = max(len(a) for a in arrays)
    out = np.full((len(arrays), width), value, dtype=np.int64)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return torch.from_numpy(out).to(device)


def write_topk_dataset(model: torch.nn.Module, data, output: str, *, top_k: int = 64, batch_size: int = 8,
                       temperature: float = 1.0, layout: str = "axolotl", fmt: str = "arrow", progress: bool = True,
                       metadata: Optional[dict] = None) -> Path:
    """Run the patched teacher ``model`` over ``data`` (a ``datasets.Dataset`` with ``input_ids``) in batches and
    write the top-k columns (module docstring) to ``output``: ``output/data.parquet`` (``fmt="parquet"``, written
    batch by batch) or a ``save_to_disk`` folder (``fmt="arrow"``, through a temporary parquet file), with
    ``topk_dataset.json``. Returns ``output`` as a ``Path``.

    Raises:
        ValueError: an unknown layout or format, ``top_k`` larger than the teacher's vocabulary, empty examples.
    """
    from tqdm.auto import tqdm

    if layout not in LAYOUTS or fmt not in FORMATS:
        raise ValueError(f"layout must be one of {LAYOUTS} and fmt one of {FORMATS}, got {layout!r}, {fmt!r}")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    work = Path(tempfile.mkdtemp(prefix="topk_", dir=out)) if fmt == "arrow" else None
    parquet_path = (work if work is not None else out) / PARQUET_NAME
    writer = None
    bar = tqdm(total=len(data), unit="seq", desc="teacher top-k", disable=not progress)
    try:
        for ids, att, lab in _batches(data, batch_size):
            top = teacher_topk(model, _padded(ids, 0, device), _padded(att, 0, device), top_k, temperature)
            columns = topk_rows(ids, att, lab, top.ids.cpu().numpy(), top.logprobs.cpu().numpy(),
                                top.label_logprobs.cpu().numpy(), layout)
            table = topk_table(columns, layout)
            if writer is None:
                writer = pq.ParquetWriter(parquet_path, table.schema)
            writer.write_table(table)
            bar.update(len(ids))
            bar.set_postfix(tokens=sum(len(x) for x in ids))
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    if writer is None:
        raise ValueError("the dataset has no examples")
    if work is not None:
        import datasets

        datasets.Dataset.from_parquet(str(parquet_path), cache_dir=str(work / "cache")).save_to_disk(str(out))
        shutil.rmtree(work)
    transform = model._hf_fused.transform
    info = {"top_k": top_k, "temperature": temperature, "layout": layout, "format": fmt, "examples": len(data),
            "teacher_logit_scale": transform.logit_scale, "teacher_softcap": transform.softcap, **(metadata or {})}
    (out / METADATA_NAME).write_text(json.dumps(info, indent=2) + "\n")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    data = load_tokenized(args.dataset, args.split)
    if args.max_examples is not None:
        data = data.select(range(min(args.max_examples, len(data))))
    model = load_teacher(args.teacher, args.device, args.dtype)
    vocab = model.get_output_embeddings().weight.shape[0]
    if args.top_k > vocab:
        raise SystemExit(f"--top-k {args.top_k} exceeds the teacher's vocabulary of {vocab}")
    out = write_topk_dataset(model, data, args.output, top_k=args.top_k, batch_size=args.batch_size,
                             temperature=args.temperature, layout=args.layout, fmt=args.format,
                             metadata={"teacher": args.teacher, "dataset": args.dataset})
    print(f"wrote {len(data)} examples with the teacher's top-{args.top_k} log-probs ({args.layout} layout) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
