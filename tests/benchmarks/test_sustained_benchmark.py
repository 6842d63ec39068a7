"""``python -m benchmarks.sustained``: the device readings' window and reason shares, the sampler thread, one case's
step times and rates, and a CPU smoke run of the whole tool."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from benchmarks.sustained import REASONS, Sample, Sampler, device_summary, main, run_case


def test_device_summary_reads_only_the_window():
    samples = [Sample(0.0, 1980, 300.0, 40, 0), Sample(1.0, 1700, 700.0, 60, REASONS["power cap"]),
               Sample(2.0, 1600, 690.0, 62, REASONS["power cap"] | REASONS["hw thermal"]),
               Sample(3.0, 1650, 695.0, 61, 0x1)]  # 0x1: idle, not a reason this tool reports
    got = device_summary(samples, 1.0, 3.0)
    assert got["sm_mhz"] == 1650 and got["watts"] == 695.0 and got["celsius"] == 61
    assert got["power cap"] == pytest.approx(2 / 3) and got["hw thermal"] == pytest.approx(1 / 3)
    assert got["hw slowdown"] == got["sw thermal"] == got["power brake"] == 0
    assert device_summary(samples, 5.0, 6.0) == {}


def test_sampler_reads_until_closed():
    counter = itertools.count()
    with Sampler(lambda: Sample(time.perf_counter(), next(counter), 0.0, 0, 0), 0.001) as sampler:
        time.sleep(0.05)
    n = len(sampler.samples)
    time.sleep(0.01)
    assert n >= 2 and len(sampler.samples) == n  # stopped at exit
    assert [s.sm_mhz for s in sampler.samples] == list(range(n))


def test_run_case_rates_from_step_times(monkeypatch):
    # a step of known duration: first steps slower than the rest, as a clock that drops would not (the tool must
    # tell the two ends apart, not average them)
    durations = iter([0.02] * 3 + [0.01] * 1000)
    calls = []

    def step():
        calls.append(1)
        time.sleep(next(durations))

    row = run_case(step, flops=1e9, device=torch.device("cpu"), seconds=0.3, read=None, interval=0.01)
    assert row["steps"] == len(calls) - 1  # the first call is the warm-up, untimed
    assert row["first_tflops"] < row["last_tflops"]
    assert row["last_tflops"] == pytest.approx(1e9 / (row["last_ms"] * 1e-3) / 1e12)
    assert "sm_mhz" not in row  # no readings without a reader


def test_cpu_smoke(capsys):
    assert main(["--device", "cpu", "--quick", "--shapes", "ce-128-h64-v1k", "--peers", "hf_fused,trl,quack",
                 "--seconds", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "matmul 256³" in out and "ce-128-h64-v1k" in out and "hf_fused" in out and "power cap" in out
    # QuACK needs CUDA: said, not run (skipped where it is not installed)
    assert "ce-128-h64-v1k · quack: n/a (needs a CUDA device)" in out or "ce-128-h64-v1k · quack: skipped (" in out


def test_held_calls_are_timed_one_by_one():
    from benchmarks.measure import held_ms

    durations = iter([0.02, 0.02] + [0.005] * 1000)
    times = held_ms(lambda: time.sleep(next(durations)), torch.device("cpu"), 0.2)
    assert 10 < len(times) < 60
    assert min(times[:2]) >= 20 and max(times[2:]) < 20  # each call's own time, in order


def test_the_ceiling_held_is_the_median_of_its_last_half(monkeypatch):
    """``matmul_tflops(hold_s=...)`` (``python -m benchmarks --ceiling-hold``): the product's calls back to back for
    that long, the median of the last half; the default is the burst, and the report says which."""
    from benchmarks import measure
    from benchmarks.report import _header

    monkeypatch.setattr(measure, "held_ms", lambda fn, device, seconds: [1.0] * 5 + [2.0, 2.0, 4.0, 4.0, 4.0])
    held = measure.matmul_tflops(torch.device("cpu"), torch.float32, 32, 1, hold_s=3.0)
    assert held["ms"] == 4.0 and held["hold_s"] == 3.0 and held["tflops"] == pytest.approx(2 * 32**3 / 4e-3 / 1e12)
    burst = measure.matmul_tflops(torch.device("cpu"), torch.float32, 32, 1)
    assert burst["hold_s"] == 0.0 and burst["ms"] > 0
    run = {"device": "cpu", "dtype": "float32", "timer": "t", "repeats": 1, "versions": {}, "flop_convention": ""}
    held_line, burst_line = (next(line for line in _header({"runs": [{**run, "matmul_ceiling": c}], "results": []},
                                                           True) if "ceiling" in line) for c in (held, burst))
    assert "held 3 s" in held_line and "a burst" in burst_line


@pytest.mark.parametrize("event_reasons", [True, False])
def test_nvml_reader_reads_clock_power_temperature_and_reasons(monkeypatch, event_reasons):
    """The reader against a stand-in ``pynvml``: milliwatts to watts, the SM clock, the GPU temperature, and the
    clock-event reasons from ``nvmlDeviceGetCurrentClocksEventReasons`` (NVML 12.5+) or, in older bindings, its
    former name ``...ThrottleReasons``."""
    import sys
    from types import SimpleNamespace

    from benchmarks.sustained import nvml_reader

    asked = {}
    fake = SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: asked.update(index=i) or "handle",
        nvmlDeviceGetClockInfo=lambda h, clock: 1485 if clock == 1 else 0,
        nvmlDeviceGetPowerUsage=lambda h: 691_500, nvmlDeviceGetTemperature=lambda h, sensor: 58,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: REASONS["power cap"])
    if event_reasons:
        fake.nvmlDeviceGetCurrentClocksEventReasons = lambda h: REASONS["power cap"] | REASONS["hw thermal"]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda i: i + 2, raising=False)
    read = nvml_reader(torch.device("cuda", 1))
    sample = read()
    assert asked["index"] == 3  # CUDA's device 1 is NVML's 3 under CUDA_VISIBLE_DEVICES
    assert (sample.sm_mhz, sample.watts, sample.celsius) == (1485, 691.5, 58)
    assert sample.reasons == (REASONS["power cap"] | (REASONS["hw thermal"] if event_reasons else 0))
    assert nvml_reader(torch.device("cpu")) is None


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--seconds", "-1"], ["--interval-ms", "0"]])
def test_a_duration_that_cannot_be_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--quick", *argv])
    assert "give a duration > 0" in capsys.readouterr().err


def test_a_negative_ceiling_hold_is_refused(capsys):
    from benchmarks.__main__ import main as bench_main

    with pytest.raises(SystemExit):
        bench_main(["--device", "cpu", "--quick", "--ceiling-hold", "-2"])
    assert "give a duration >= 0" in capsys.readouterr().err
