"""What the GPU did while a benchmark ran: its SM clock, power, temperature and the reasons NVML
gives for holding the clock down, sampled on a thread.

    with GpuSampler() as gpu:
        run()
    record["gpu"] = gpu.summary()   # None without NVML (no GPU, or nvidia-ml-py not installed)

    python3 bench/gpu_state.py [--busy-watts 300] -- COMMAND ...

runs a command that samples nothing itself (the anchors' scripts) and prints, after it, one
`GPU_STATE {...}` line over the samples drawing at least --busy-watts (its GPU work, not its
start-up and compilation), so that both sides of a comparison carry their clocks.

The same kernels' time on one H200 moved by 20% between runs (docs/performance.md, generation);
the clock and the throttle reasons say whether the GPU or the code changed. NVML is read
through nvidia-ml-py's `pynvml` (on the device image); the device index is NVML's, which is
CUDA's when CUDA_VISIBLE_DEVICES does not reorder the GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading

# NVML's clock-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*)
REASONS = {0x1: "idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
           0x100: "display_clocks"}


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:   # no library, no driver, no GPU: nothing to sample
        return None


class GpuSampler:
    def __init__(self, device_index: int = 0, interval_s: float = 0.02, nvml=None):
        self.nvml = nvml if nvml is not None else _nvml()
        self.interval_s = interval_s
        self.samples: list[tuple[int, float, int, int]] = []   # (SM MHz, watts, degrees C, reason bits)
        self.error: str | None = None
        self._handle = self.nvml.nvmlDeviceGetHandleByIndex(device_index) if self.nvml else None
        self._reasons = self.nvml and (getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                                       or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons)   # the newer name first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> GpuSampler:
        if self._handle is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample_until_stopped(self) -> None:
        while True:
            try:
                self.samples.append(self._sample())
            except Exception as exc:   # a reading this GPU or driver refuses: say so in the summary, stop
                self.error = f"{type(exc).__name__}: {exc}"
                return
            if self._stop.wait(self.interval_s):
                return

    def _sample(self) -> tuple[int, float, int, int]:
        nvml, handle = self.nvml, self._handle
        return (nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM), nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU), self._reasons(handle))

    def summary(self, busy_watts: float = 0.0) -> dict | None:
        """Over the samples drawing at least `busy_watts` (all of them by default)."""
        samples = [sample for sample in self.samples if sample[1] >= busy_watts]
        if not samples:
            return None if self.error is None else dict(samples=0, error=self.error)
        clocks, watts, temperatures, reasons = zip(*samples)
        seen = 0
        for bits in reasons:
            seen |= bits
        return dict(samples=len(samples), sm_clock_mhz_mean=round(statistics.fmean(clocks)),
                    sm_clock_mhz_min=min(clocks), power_w_mean=round(statistics.fmean(watts), 1),
                    temperature_c_max=max(temperatures),
                    clock_limited_by=[name for bit, name in REASONS.items() if seen & bit],
                    **({} if self.error is None else dict(error=self.error)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a command; then say what the GPU did while it was busy.")
    parser.add_argument("--busy-watts", type=float, default=300.0,
                        help="count the samples drawing at least this many watts (default 300: an H200 idles near 100)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    with GpuSampler() as gpu:
        returncode = subprocess.run(command).returncode
    print("GPU_STATE " + json.dumps(gpu.summary(busy_watts=args.busy_watts)), flush=True)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
