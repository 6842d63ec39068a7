"""Device probe (not committed): host time from the forward's one sync (the .tolist() in flatten_head_inputs) to
the first matmul launch, and GPU idle estimate, per step, for one-pass / lean / hint peers. No profiler."""
import time, sys, statistics
import torch
from benchmarks.peers import select_peers
from benchmarks.problems import make_inputs, select_problems
from benchmarks.runner import _step, _zero_grads
from hf_fused.ops import head_inputs

marks = {}
real_nz = torch.nonzero_static
def nz(*a, **k):
    marks.setdefault("sync_done", time.perf_counter())
    return real_nz(*a, **k)
head_inputs.torch.nonzero_static = nz  # the module's torch is the global torch
real_mm, real_addmm = torch.mm, torch.addmm
def mm(*a, **k):
    if "sync_done" in marks: marks.setdefault("first_mm", time.perf_counter())
    return real_mm(*a, **k)
torch.mm = mm
for shape, peer_key in [("ce-32k-h2048-v152k", "hf_fused"), ("ce-32k-h2048-v152k", "hf_fused_4gib"),
                        ("ce-32k-h2048-v152k", "hf_fused_lean"), ("grpo-16x2k-h2048-v152k", "hf_fused_hint")]:
    (problem,) = select_problems(shape, quick=False)
    (peer,) = select_peers(peer_key)
    peer.load()
    inp = make_inputs(problem, torch.device("cuda"), torch.bfloat16)
    _zero_grads(inp)
    deltas = []
    for i in range(8):
        marks.clear()
        _step(peer, problem, inp)
        torch.cuda.synchronize()
        if i >= 3 and "first_mm" in marks:
            deltas.append((marks["first_mm"] - marks["sync_done"]) * 1e3)
    print(f"{shape} / {peer_key}: host ms from the sync to the first torch.mm: median {statistics.median(deltas):.3f}, "
          f"all {[round(d, 3) for d in deltas]}", flush=True)
    del inp
    torch.cuda.empty_cache()
