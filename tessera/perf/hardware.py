"""Dense peak rates and memory of the GPUs that MFU is measured against.

Peaks are the vendors' dense (not 2:4 sparse) datasheet figures in TFLOP/s; MFU uses
them as Megatron-LM's maintainers do (989 for H100 SXM bf16, not the 1979 sparse figure).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: dict          # dtype name -> dense TFLOP/s
    memory_gb: float           # HBM capacity, GB (1e9 bytes)
    hbm_tb_per_s: float        # HBM bandwidth, TB/s
    host_link_gb_per_s: float = 64.0   # PCIe to the host, GB/s per direction (Gen5 x16; offloading crosses it)


_HOPPER_SXM = {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.7, "fp32": 66.9}

GPUS: dict[str, GPU] = {
    "a100": GPU("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 80, 2.039, 32.0),  # PCIe Gen4
    "h100-sxm": GPU("H100 SXM", _HOPPER_SXM, 80, 3.35),
    # H800: the H100 SXM's compute and memory with less NVLink (the export part DeepSeek-V3 trained on)
    "h800": GPU("H800 SXM", _HOPPER_SXM, 80, 3.35),
    "h100-pcie": GPU("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0}, 80, 2.0),
    "h200": GPU("H200", _HOPPER_SXM, 141, 4.8),
    "b200": GPU("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 75.0}, 180, 8.0),
}
GPUS["h100"] = GPUS["h100-sxm"]

# Substrings of torch.cuda.get_device_name(), most specific first.
_NAME_PATTERNS = [("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("h800", "h800"), ("h200", "h200"),
                  ("a100", "a100"), ("b200", "b200")]


def detect_gpu(device_name: str) -> GPU | None:
    """The GPU entry for a CUDA device name such as 'NVIDIA H200', or None if unknown."""
    lowered = device_name.lower()
    for pattern, key in _NAME_PATTERNS:
        if pattern in lowered:
            return GPUS[key]
    return None


def lookup_gpu(key: str) -> GPU:
    if key.lower() not in GPUS:
        raise ValueError(f"unknown GPU '{key}'; choose one of {', '.join(sorted(GPUS))}")
    return GPUS[key.lower()]
