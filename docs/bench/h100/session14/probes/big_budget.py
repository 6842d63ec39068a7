"""Device probe (not committed): the one pass at larger explicit budgets (the 4 GiB peer with its budget replaced)."""
import sys
from benchmarks import peers
from benchmarks.__main__ import main
gib = float(sys.argv[1])
cls = [c for c in vars(peers).values() if isinstance(c, type) and getattr(c, "key", None) == "hf_fused_4gib"][0]
cls.tile_budget_bytes = int(gib * 2**30)
cls.label = f"hf_fused (one pass, {gib:g} GiB)"
sys.exit(main(sys.argv[2:]))
