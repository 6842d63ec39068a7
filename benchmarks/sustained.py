"""Steps run back to back for seconds, with the GPU's clock and power beside their speed: ``python -m
benchmarks.sustained [--shapes ce-32k-h2048-v152k] [--peers hf_fused,trl] [--seconds 10] [--interval-ms 50]``.

The floor that ``python -m benchmarks`` and :mod:`benchmarks.kernel_breakdown` measure a step against is the useful
FLOPs at the rate of a burst: the median of 50 bf16 products of 8192³ (about 70 ms of work). A GPU held at work for
longer keeps within its power limit by lowering its SM clock, and a matmul's rate follows the clock. This tool runs,
for ``--seconds`` each, the 8192³ product and each (problem, peer)'s forward + backward (as ``python -m benchmarks``
calls it), back to back with no host synchronization between steps, while a thread reads the device through NVML
(``nvidia-ml-py``) every ``--interval-ms``: the SM clock (MHz), the power drawn (W), the temperature (°C) and the
driver's clock-event reasons (why the clock is below its maximum: the software power cap, thermal or hardware
slowdown).

Printed per case: the steps run, TFLOP/s over the first tenth of them and over the last half (useful FLOPs:
:meth:`~benchmarks.problems.Problem.flops` over the kept tokens, ``2·n³`` for the product), and over the last half of
the case's time the median SM clock, power and temperature and the share of samples under each reason. Without NVML
or on CPU the device columns stay empty (the CPU run is a smoke test of the tool).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import measure
from .peers import select_peers
from .problems import make_inputs, select_problems
from .runner import run_step

#: NVML's clock-event reason bits (``nvmlClocksEventReason*``) that lower the clock under load, by the name printed.
REASONS = {"power cap": 0x4, "hw slowdown": 0x8, "sw thermal": 0x20, "hw thermal": 0x40, "power brake": 0x80}


@dataclass
class Sample:
    """One NVML reading: host time (``time.perf_counter``, s), SM clock (MHz), power (W), temperature (°C), reasons
    (NVML's bit mask)."""

    t: float
    sm_mhz: int
    watts: float
    celsius: int
    reasons: int


@dataclass
class Sampler:
    """Reads ``read()`` every ``interval`` seconds in a thread while open (``with Sampler(...) as s:``)."""

    read: Callable[[], Sample]
    interval: float
    samples: list[Sample] = field(default_factory=list)

    def __enter__(self) -> "Sampler":
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self.interval)


def nvml_reader(device: torch.device) -> Optional[Callable[[], Sample]]:
    """A function reading ``device`` through NVML, or None without NVML (not installed, no driver, a CPU device)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:  # NVML numbers every GPU of the machine; CUDA_VISIBLE_DEVICES renumbers the ones CUDA sees
            index = torch.cuda._get_nvml_device_index(index)
        except Exception:
            pass
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    except Exception as err:
        print(f"no device readings: NVML unavailable ({measure.short_error(err, 120)})")
        return None

    def read() -> Sample:
        return Sample(time.perf_counter(), pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                      pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                      pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU), reasons(handle))

    return read


def device_summary(samples: list[Sample], start: float, end: float) -> dict:
    """Median SM clock, power and temperature and the share of samples under each of :data:`REASONS`, over the
    samples taken in ``[start, end]`` (host seconds); empty where none was."""
    window = [s for s in samples if start <= s.t <= end]
    if not window:
        return {}
    out = {"sm_mhz": statistics.median(s.sm_mhz for s in window),
           "watts": statistics.median(s.watts for s in window),
           "celsius": statistics.median(s.celsius for s in window)}
    for name, bit in REASONS.items():
        out[name] = sum(bool(s.reasons & bit) for s in window) / len(window)
    return out


def run_case(step: Callable[[], object], flops: float, device: torch.device, seconds: float,
             read: Optional[Callable[[], Sample]], interval: float) -> dict:
    """``step`` back to back for ``seconds`` of host time (:func:`benchmarks.measure.held_ms`): TFLOP/s over the
    first tenth and the last half of the steps, and :func:`device_summary` over the last half of the case's time."""
    step()  # compiled and cached before the clock starts (held_ms synchronizes first)
    with Sampler(read, interval) if read else contextlib.nullcontext() as sampler:
        t0 = time.perf_counter()
        times = measure.held_ms(step, device, seconds)
        t1 = time.perf_counter()
    first = times[:max(1, len(times) // 10)]
    last = times[len(times) // 2:] or times

    def tflops(ms: list[float]) -> float:
        return flops / (statistics.median(ms) * 1e-3) / 1e12

    row = {"steps": len(times), "first_tflops": tflops(first), "last_tflops": tflops(last),
           "last_ms": statistics.median(last)}
    row.update(device_summary(sampler.samples if sampler else [], t0 + (t1 - t0) / 2, t1))
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sustained",
        description="Steps run back to back for seconds each (the floor's 8192³ bf16 product, then each problem and "
        "peer): TFLOP/s at the start and at the end, with the SM clock, power and clock-event reasons NVML reads.")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    parser.add_argument("--shapes", default="ce-32k-h2048-v152k", help="shape names, kinds or groups, as python -m "
                        "benchmarks")
    parser.add_argument("--peers", default="hf_fused,trl", help="peer keys, as python -m benchmarks")
    parser.add_argument("--seconds", type=measure.duration_arg(True), default=10.0,
                        help="host seconds of steps per case (default 10)")
    parser.add_argument("--interval-ms", type=measure.duration_arg(True), default=50.0,
                        help="between NVML readings (default 50)")
    parser.add_argument("--matmul-n", type=int, default=None, help="the product's size (default 8192; 256 with "
                        "--quick)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    read, interval = nvml_reader(device), args.interval_ms / 1e3
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"{measure.device_name(device)}: {args.seconds:g} s per case, NVML every {args.interval_ms:g} ms; "
          + ", ".join(f"{name} {version}" for name, version in measure.versions().items() if version))
    rows = []
    n = args.matmul_n or (256 if args.quick else 8192)
    step = measure.matmul_product(device, dtype, n)
    rows.append((f"matmul {n}³", "torch.mm", run_case(step, 2.0 * n**3, device, args.seconds, read, interval)))
    del step
    measure.free_memory(device)
    for problem in select_problems(args.shapes, args.quick):
        for peer in select_peers(args.peers):
            why = peer.cannot_run(problem, device)
            if why:
                print(f"{problem.name} · {peer.key}: {why}")
                continue
            inp = make_inputs(problem, device, dtype)

            def peer_step(inp=inp, peer=peer, problem=problem):
                inp.hidden.grad = inp.weight.grad = None
                run_step(peer, problem, inp)

            rows.append((problem.name, peer.key, run_case(peer_step, problem.flops(inp.n_valid), device,
                                                         args.seconds, read, interval)))
            del inp, peer_step
            measure.free_memory(device)
    print("\n".join(measure.text_table(
        ["case", "peer", "steps", "ms (last half)", "TFLOP/s first 10%", "TFLOP/s last half", "SM MHz", "W", "°C",
         *REASONS],
        [[case, peer, str(r["steps"]), f"{r['last_ms']:.2f}", f"{r['first_tflops']:.0f}", f"{r['last_tflops']:.0f}",
          *(f"{r[k]:.0f}" if k in r else "" for k in ("sm_mhz", "watts", "celsius")),
          *(f"{r[k]:.0%}" if k in r else "" for k in REASONS)] for case, peer, r in rows], align_left=2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
