# Run on the device as _dev/s16_mprobe.py (kept as it ran).
"""Does a new row count cost a QuACK plan/compile? Times the first and second call per distinct N."""
import time, torch, sys
from hf_fused.ops import linear_cross_entropy
from hf_fused.ops.backends import triton_cublas as tc
torch.manual_seed(0)
V, H = 151936, 2048
w = (torch.randn(V, H, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
def step(n):
    h = torch.randn(n, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, V, (n,), device="cuda"); y[::10] = -100
    torch.cuda.synchronize(); t = time.perf_counter()
    loss = linear_cross_entropy(h, w, y); loss.backward()
    torch.cuda.synchronize(); return (time.perf_counter() - t) * 1e3
print("quack module:", tc._quack() is not None)
for n in [4096, 4096, 4095, 4095, 4000, 4000, 3001, 3001, 2500, 4096, 1234, 1234]:
    print(f"N={n:5d}  {step(n):8.1f} ms", flush=True)
print("quack still on:", tc._quack() is not None, tc._QUACK_ERROR)
# QuACK alone
q = tc._quack()
if q is not None:
    for m in [2048, 2048, 2047, 2047, 1999, 1999, 1000, 1000]:
        h = torch.randn(m, H, device="cuda", dtype=torch.bfloat16); y = torch.randint(0, V, (m,), device="cuda")
        out = torch.empty(m, V, device="cuda", dtype=torch.bfloat16); lse = torch.empty(m, device="cuda"); ll = torch.empty(m, device="cuda")
        torch.cuda.synchronize(); t = time.perf_counter()
        q.logits_with_statistics(h, w.detach(), y, out, lse=lse, label_logit=ll)
        torch.cuda.synchronize(); print(f"quack stats M={m:5d} {(time.perf_counter()-t)*1e3:8.1f} ms", flush=True)
