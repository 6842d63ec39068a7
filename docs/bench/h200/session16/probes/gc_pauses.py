# Run on the device as _dev/s16_gc.py (kept as it ran).
import gc, time, sys, runpy, threading
_t = {}
def cb(phase, info):
    if phase == "start": _t["s"] = time.perf_counter()
    else:
        d = (time.perf_counter() - _t["s"]) * 1e3
        if d > 20: print(f"[gc] gen{info['generation']} {d:.0f} ms collected {info['collected']}", flush=True)
gc.callbacks.append(cb)
def threads():
    while True:
        time.sleep(0.25)
        names = [t.name for t in threading.enumerate()]
        if len(names) > 1: print("[threads]", names, flush=True); break
threading.Thread(target=threads, daemon=True, name="probe").start()
sys.argv = ["benchmarks.e2e"] + sys.argv[1:]
try:
    runpy.run_module("benchmarks.e2e", run_name="__main__")
finally:
    print("[objects]", len(gc.get_objects()), flush=True)
