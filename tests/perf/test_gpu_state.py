"""bench/gpu_state.py: what NVML said while a run went, summed up; nothing where there is no NVML."""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gpu_state import GpuSampler  # noqa: E402


def _fake_nvml(readings):
    """An NVML whose device reports `readings` (clock MHz, milliwatts, degrees, reason bits) in turn."""
    state = iter(readings)
    current = {}

    def next_reading(_handle):
        current.update(zip(("clock", "mw", "temp", "reasons"), next(state, readings[-1])))
        return current["clock"]

    return SimpleNamespace(
        NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0, nvmlDeviceGetHandleByIndex=lambda index: ("gpu", index),
        nvmlDeviceGetClockInfo=lambda handle, kind: next_reading(handle),
        nvmlDeviceGetPowerUsage=lambda handle: current["mw"], nvmlDeviceGetTemperature=lambda h, k: current["temp"],
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda handle: current["reasons"])


def test_the_summary_gives_the_clock_power_temperature_and_every_limiting_reason_seen():
    readings = [(1980, 650_000, 60, 0x0), (1500, 700_000, 71, 0x4), (1755, 690_000, 68, 0x20)]
    sampler = GpuSampler(interval_s=0.001, nvml=_fake_nvml(readings))
    sampler.samples = [sampler._sample() for _ in readings]
    summary = sampler.summary()
    assert summary == dict(samples=3, sm_clock_mhz_mean=1745, sm_clock_mhz_min=1500, power_w_mean=680.0,
                           temperature_c_max=71, clock_limited_by=["sw_power_cap", "sw_thermal"])


def test_the_thread_samples_while_the_run_goes_and_stops_after():
    with GpuSampler(interval_s=0.001, nvml=_fake_nvml([(1980, 650_000, 60, 0)])) as sampler:
        deadline = time.monotonic() + 10   # however loaded the machine is
        while len(sampler.samples) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
    taken = len(sampler.samples)
    time.sleep(0.02)
    assert taken >= 5 and len(sampler.samples) == taken


def test_without_nvml_there_is_nothing_to_say(monkeypatch):
    import gpu_state

    monkeypatch.setattr(gpu_state, "_nvml", lambda: None)
    with GpuSampler() as sampler:
        pass
    assert sampler.summary() is None


def test_a_reading_the_gpu_refuses_ends_the_sampling_and_is_said():
    nvml = _fake_nvml([(1980, 650_000, 60, 0)])

    def refused(handle):
        raise RuntimeError("Not Supported")

    nvml.nvmlDeviceGetPowerUsage = refused
    with GpuSampler(interval_s=0.001, nvml=nvml) as sampler:
        pass   # the first reading fails; leaving joins the thread
    assert sampler.summary() == dict(samples=0, error="RuntimeError: Not Supported")


def test_the_busy_summary_leaves_out_the_idle_samples():
    readings = [(1980, 90_000, 40, 0x1), (1500, 700_000, 71, 0x4), (1600, 650_000, 70, 0x4)]
    sampler = GpuSampler(interval_s=0.001, nvml=_fake_nvml(readings))
    sampler.samples = [sampler._sample() for _ in readings]
    assert sampler.summary(busy_watts=300) == dict(samples=2, sm_clock_mhz_mean=1550, sm_clock_mhz_min=1500,
                                                   power_w_mean=675.0, temperature_c_max=71,
                                                   clock_limited_by=["sw_power_cap"])
    assert sampler.summary()["samples"] == 3


def test_a_command_runs_under_the_sampler_and_keeps_its_exit_status(monkeypatch, capsys):
    import gpu_state

    monkeypatch.setattr(gpu_state, "_nvml", lambda: _fake_nvml([(1700, 650_000, 60, 0x4)]))
    status = gpu_state.main(["--busy-watts", "300", "--", sys.executable, "-c", "import time; time.sleep(0.3); exit(3)"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert status == 3 and line.startswith("GPU_STATE ")
    summary = json.loads(line.removeprefix("GPU_STATE "))
    assert summary["samples"] >= 1 and summary["sm_clock_mhz_mean"] == 1700
