"""What the GPU did while a benchmark ran: its SM clock, power, temperature and the reasons NVML
gives for holding the clock down, sampled on a thread.

    with GpuSampler() as gpu:
        run()
    record["gpu"] = gpu.summary()   # None without NVML (no GPU, or nvidia-ml-py not installed)

The same kernels' time on one H200 moved by 20% between runs (docs/performance.md, generation);
the clock and the throttle reasons say whether the GPU or the code changed. NVML is read
through nvidia-ml-py's `pynvml` (on the device image); the device index is NVML's, which is
CUDA's when CUDA_VISIBLE_DEVICES does not reorder the GPUs.
"""

from __future__ import annotations

import statistics
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

    def summary(self) -> dict | None:
        if not self.samples:
            return None if self.error is None else dict(samples=0, error=self.error)
        clocks, watts, temperatures, reasons = zip(*self.samples)
        seen = 0
        for bits in reasons:
            seen |= bits
        return dict(samples=len(self.samples), sm_clock_mhz_mean=round(statistics.fmean(clocks)),
                    sm_clock_mhz_min=min(clocks), power_w_mean=round(statistics.fmean(watts), 1),
                    temperature_c_max=max(temperatures),
                    clock_limited_by=[name for bit, name in REASONS.items() if seen & bit],
                    **({} if self.error is None else dict(error=self.error)))
