"""examples/topk_dataset.py and the recipe of docs/guides/offline_distillation.md, end to end on CPU: a tiny teacher
saved from a config -> the CLI writes its top-k dataset -> the guide's recipe, as written but for the substitutions
named in ``_recipe``, trains a tiny student for a few steps, its loss computed by hf_fused's support op.

Checked against float64: the dataset's ids and log-probs against the teacher's full logits (a soft-capped Gemma 2
teacher, whose transform the builder must measure), and the recipe's loss and every student gradient on one batch
against the same divergence computed from the student's float64 logits.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from models import grads, make_model
from references import assert_same_grads, rel_err
from examples import topk_dataset
from hf_fused import original_forward_only

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "offline_distillation.md"
RTOL = 1e-5
VOCAB, K = 128, 6


def _tokenized(n=10, seed=1):
    """Sequences of 6..15 tokens, a 3-token prompt at -100 in ``labels``; every other one without ``labels``'s
    last two tokens trained (a masked tail)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (6 + i,), generator=g).tolist()
        labels = [-100] * 3 + ids[3:]
        if i % 2:
            labels[-2:] = [-100, -100]
        rows.append({"input_ids": ids, "labels": labels})
    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def teacher_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("topk")
    teacher = make_model("gemma2", seed=3)  # final_logit_softcapping=1.0: the builder must apply it
    teacher.save_pretrained(root / "teacher")
    _tokenized().save_to_disk(str(root / "data"))
    return root


def _teacher64(root):
    model = make_model("gemma2", seed=3).double().eval()
    return model


def _written(root, name, *extra):
    out = root / name
    status = topk_dataset.main(["--teacher", str(root / "teacher"), "--dataset", str(root / "data"), "--output",
                                str(out), "--top-k", str(K), "--batch-size", "3", "--device", "cpu", *extra])
    assert status == 0
    return out


def test_args_defaults_and_validation(tmp_path):
    args = topk_dataset.parse_args(["--teacher", "t", "--dataset", "d", "--output", str(tmp_path / "o")])
    assert (args.top_k, args.batch_size, args.temperature, args.format, args.layout) == (64, 8, 1.0, "arrow",
                                                                                         "axolotl")
    for bad in (["--top-k", "0"], ["--batch-size", "0"], ["--temperature", "0"], ["--layout", "x"]):
        with pytest.raises(SystemExit):
            topk_dataset.parse_args(["--teacher", "t", "--dataset", "d", "--output", str(tmp_path / "o"), *bad])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(SystemExit):
        topk_dataset.parse_args(["--teacher", "t", "--dataset", "d", "--output", str(tmp_path / "full")])


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_axolotl_layout_matches_the_teachers_float64_top_k(teacher_and_data, fmt):
    root = teacher_and_data
    out = _written(root, f"axolotl_{fmt}", "--format", fmt, "--temperature", "0.7")
    data = (datasets.load_from_disk(str(out)) if fmt == "arrow"
            else datasets.load_dataset("parquet", data_files=str(out / "data.parquet"), split="train"))
    assert data.column_names == ["input_ids", "attention_mask", "labels", "target_token_ids", "target_logprobs",
                                 "target_mask"]
    info = json.loads((out / "topk_dataset.json").read_text())
    assert info["top_k"] == K and info["temperature"] == 0.7 and info["teacher_softcap"] == 1.0
    source, teacher = _tokenized(), _teacher64(root)
    for i in range(len(source)):
        row, ids = data[i], torch.tensor(source[i]["input_ids"])
        assert row["input_ids"] == source[i]["input_ids"] and row["labels"] == source[i]["labels"]
        with torch.no_grad():
            logits = teacher(input_ids=ids[None]).logits[0]  # soft-capped by the model's own forward
        top = (logits / 0.7).log_softmax(-1).topk(K, -1)
        assert torch.equal(torch.tensor(row["target_token_ids"]), top.indices)
        assert rel_err(torch.tensor(row["target_logprobs"]), top.values) <= RTOL
        labels = torch.tensor(source[i]["labels"])
        trained = torch.cat([labels[1:] != -100, torch.tensor([False])])
        assert torch.equal(torch.tensor(row["target_mask"], dtype=torch.bool), trained[:, None].expand(-1, K))


def test_trl_layout_shifts_by_one_and_adds_the_realized_token(teacher_and_data):
    root = teacher_and_data
    out = _written(root, "trl", "--layout", "trl", "--format", "parquet")
    data = datasets.load_dataset("parquet", data_files=str(out / "data.parquet"), split="train")
    assert data.column_names == ["input_ids", "completion_mask", "teacher_topk_ids", "teacher_topk_logprobs"]
    source, teacher = _tokenized(), _teacher64(root)
    appended = 0
    for i in range(len(source)):
        row, ids = data[i], torch.tensor(source[i]["input_ids"])
        cand, lp = np.array(row["teacher_topk_ids"]), np.array(row["teacher_topk_logprobs"], dtype=np.float64)
        assert cand.shape == (len(ids), K + 1) and (cand[0] == -1).all() and np.isneginf(lp[0]).all()
        assert row["completion_mask"] == [int(x != -100) for x in source[i]["labels"]]
        with torch.no_grad():
            logp = teacher(input_ids=ids[None]).logits[0].log_softmax(-1)
        for pos in range(1, len(ids)):  # row pos: the prediction of input_ids[pos], made at pos - 1
            top = logp[pos - 1].topk(K)
            assert torch.equal(torch.from_numpy(cand[pos, :K]), top.indices)
            assert np.allclose(lp[pos, :K], top.values.numpy(), rtol=RTOL, atol=0)
            realized = int(ids[pos])
            if realized in top.indices.tolist():
                assert cand[pos, K] == -1 and np.isneginf(lp[pos, K])
            else:
                appended += 1
                assert cand[pos, K] == realized and np.isclose(lp[pos, K], logp[pos - 1, realized].item(), rtol=RTOL)
    assert appended > 0


def test_bad_dataset_is_refused(tmp_path):
    datasets.Dataset.from_list([{"text": "a"}]).save_to_disk(str(tmp_path / "raw"))
    with pytest.raises(ValueError, match="no input_ids column"):
        topk_dataset.load_tokenized(str(tmp_path / "raw"))
    with pytest.raises(ValueError, match="save_to_disk folder"):
        topk_dataset.load_tokenized(str(tmp_path / "data.csv"))


# -- the guide's recipe ----------------------------------------------------------------------------------------------


def _recipe(student_path, data_path) -> str:
    """The guide's training block with its substitutions: the local student for the Hub id, in fp32 (CPU); the
    dataset path; CPU, three steps, no reporting (``bf16=True`` stays: autocast on the CPU)."""
    text = GUIDE.read_text()
    code = re.findall(r"^```python\n(.*?)^```", text[text.index("## 2. Train the student"):], flags=re.S | re.M)[0]
    assert code.count('from_pretrained("Qwen/Qwen3-0.6B", dtype="bfloat16")') == 1
    assert code.count('load_from_disk("qwen3-8b-top64")') == 1 and code.count('TrainingArguments("out", ') == 1
    code = code.replace('from_pretrained("Qwen/Qwen3-0.6B", dtype="bfloat16")',
                        f'from_pretrained("{student_path}", dtype="float32")')
    code = code.replace('load_from_disk("qwen3-8b-top64")', f'load_from_disk("{data_path}")')
    return code.replace('TrainingArguments("out", ', 'TrainingArguments(OUTPUT, use_cpu=True, max_steps=3, '
                        'report_to=[], save_strategy="no", ')


def _kl(a, b, valid):
    a_s, b_s = torch.where(valid, a, 1.0), torch.where(valid, b, 1.0)
    return torch.where(valid, a * (a_s.log() - b_s.log()), 0.0).sum(-1)


def _dense_forward_kl_with_tail(logits, batch):
    """Float64 forward KL(teacher ‖ student) on the support with the tail bucket (the recipe's ``beta = 0``), from
    probabilities: the student's full softmax, its mass at the candidates, the tail ``1 − Σ p``."""
    valid = batch["target_mask"]
    ps = torch.where(valid, logits.log_softmax(-1).gather(-1, batch["target_token_ids"]).exp(), 0.0)
    pt = torch.where(valid, batch["target_logprobs"].double().exp(), 0.0)
    ps = torch.cat([ps, 1 - ps.sum(-1, keepdim=True)], -1)
    pt = torch.cat([pt, 1 - pt.sum(-1, keepdim=True)], -1)
    valid = torch.cat([valid, torch.ones_like(valid[..., :1])], -1)
    return torch.where(batch["target_mask"].any(-1), _kl(pt, ps, valid), 0.0)


def test_recipe_trains_a_student_through_the_support_op(teacher_and_data, tmp_path, monkeypatch):
    import hf_fused.ops

    root = teacher_and_data
    data_path = _written(root, "recipe")
    student = make_model("qwen3", seed=5, tie_word_embeddings=True, vocab_size=VOCAB)
    student.save_pretrained(tmp_path / "student")
    calls = []
    real = hf_fused.ops.sparse_distillation_loss

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_fused.ops, "sparse_distillation_loss", counted)
    code = _recipe(tmp_path / "student", data_path)
    setup, _, rest = code.partition("\ntrainer.train()")
    namespace = {"OUTPUT": str(tmp_path / "out")}
    exec(compile(setup, str(GUIDE), "exec"), namespace)
    trainer, collate, dataset = namespace["trainer"], namespace["collate"], namespace["dataset"]

    # One batch: the recipe's loss and every student gradient against float64 on the same batch.
    batch = collate([dataset[i] for i in range(4)])
    n = int((batch["labels"][:, 1:] != -100).sum())
    model = trainer.model
    reference = copy.deepcopy(model).double()
    loss = trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(n))
    loss.backward()
    assert len(calls) == 1 and calls[0]["beta"] == 0.0
    with original_forward_only(reference):
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = _dense_forward_kl_with_tail(logits, batch).sum() / n
    expected.backward()
    assert rel_err(loss, expected) <= RTOL
    assert_same_grads(grads(model), grads(reference))
    model.zero_grad()

    # A few steps as the guide runs them (bf16 autocast on the CPU), each loss from the support op.
    exec(compile("trainer.train()" + rest, str(GUIDE), "exec"), namespace)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    losses = losses or [trainer.state.log_history[-1]["train_loss"]]  # logging_steps=10 > max_steps
    assert trainer.state.global_step == 3 and len(calls) >= 1 + 3
    assert losses and all(np.isfinite(losses)) and all(x > 0 for x in losses)
    assert re.search(r"remove_unused_columns=False", code)


def test_guides_reverse_kl_block_matches_float64():
    """The guide's sampled-token reverse-KL block, as written: its loss and gradients against float64."""
    from references import dense_logits, leaf64

    text = GUIDE.read_text()
    code = re.findall(r"^```python\n(.*?)^```", text[text.index("## Other objectives"):], flags=re.S | re.M)[0]
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(code, str(GUIDE), "exec"), namespace)
    hidden, weight, sampled, teacher = (namespace[k] for k in ("hidden", "weight", "sampled", "teacher"))
    ref = [leaf64(hidden), leaf64(weight)]
    s = dense_logits(*ref).log_softmax(-1).gather(-1, sampled)
    loss = ((s - teacher.double()).detach() * s).sum()
    loss.backward()
    assert rel_err(namespace["out"].loss, loss) <= RTOL
    assert rel_err(hidden.grad, ref[0].grad) <= RTOL and rel_err(weight.grad, ref[1].grad) <= RTOL
