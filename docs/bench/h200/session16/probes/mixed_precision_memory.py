# CPU probe (TRITON_INTERPRET=1 PYTHONPATH=. python probes/mixed_precision_memory.py 64 trl,hf_fused_lean,hf_fused triton).
"""Peak memory above inputs+grads of one fwd+bwd under bf16 autocast with fp32 inputs, real vocab/hidden, few rows."""
import sys, torch
from benchmarks.problems import _ce, make_inputs
from benchmarks.peers import select_peers
from benchmarks.runner import _step, _zero_grads
from benchmarks import measure
torch.set_num_threads(1)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
prob = _ce(n, 2048, 151936)
inp = make_inputs(prob, torch.device("cpu"), torch.float32)
for peer in select_peers(sys.argv[2] if len(sys.argv) > 2 else "trl,hf_fused,hf_fused_lean", hf_backend=sys.argv[3] if len(sys.argv) > 3 else None):
    peer.load()
    _zero_grads(inp)
    inp.hidden.grad = inp.weight.grad = None
    (loss, *_), peak = measure.peak_memory(lambda: _step(peer, prob, inp, torch.bfloat16), torch.device("cpu"))
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (inp.hidden, inp.weight) if t.grad is not None)
    print(f"{peer.key:16s} N={n} loss {float(loss):.4f}  peak above inputs+grads {(peak - grads) / 2**20:8.1f} MiB "
          f"(grads {grads / 2**20:.0f} MiB, dtypes {inp.hidden.grad.dtype}, {inp.weight.grad.dtype})", flush=True)
    inp.hidden.grad = inp.weight.grad = None
