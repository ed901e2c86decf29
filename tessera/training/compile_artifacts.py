"""torch.compile's artifacts saved with each checkpoint and loaded on --load, so that a job
restarted on a fresh machine finds its compiled kernels instead of compiling them again.

Inductor caches what it compiles (graphs, Triton kernels, autotuning choices) under
TORCHINDUCTOR_CACHE_DIR, on one machine. `torch.compiler.save_cache_artifacts` serialises
what this process compiled and `load_cache_artifacts` puts it into a fresh process's caches
before anything compiles ("Mega-Cache", PyTorch >= 2.7: https://docs.pytorch.org/tutorials/recipes/torch_compile_caching_tutorial.html).
Compilation then looks up, not builds: Dynamo still traces, which takes seconds.

Each rank writes its own file beside the checkpoint's shards: pipeline stages compile
different layers. A file carries a fingerprint of what the kernels were made for (torch and
Triton versions, the device, the model, the layout and this rank's stage, the precision and
recompute settings). One that does not fit (another layout, GPU or torch), or that cannot be
read, is passed over with one line and the run compiles cold: it is a cache, never needed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from tessera.files import atomic_write

FILE = "compile_artifacts.rank{rank}.bin"
_HEADER_END = b"\n"   # the fingerprint's JSON line, then the artifacts' bytes


def supported() -> bool:
    return hasattr(torch.compiler, "save_cache_artifacts")


def fingerprint(config, mesh, device: torch.device) -> dict[str, Any]:
    """What this rank's compiled kernels depend on; equal fingerprints can share artifacts."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    train = config.train
    kernels = {"model": dataclasses.asdict(config.model),
               "precision": [train.bf16, train.fp16, train.fp8_format, train.fp8_recipe],
               "recompute": [train.recompute_granularity, train.recompute_method, train.recompute_num_layers],
               "micro_batch": [train.micro_batch_size, config.model.seq_length],
               "layout": [mesh.tp_size, mesh.cp_size, mesh.pp_size, mesh.pp_rank, mesh.ep_size, mesh.etp_size,
                          config.parallel.sequence_parallel],
               "lora": config.posttrain.lora}
    return {"torch": torch.__version__, "triton": triton_version,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "kernels": hashlib.sha256(json.dumps(kernels, sort_keys=True, default=str).encode()).hexdigest()}


def save(directory: Path, rank: int, made_for: dict[str, Any]) -> None:
    """This process's compiled artifacts into `directory` (nothing if it compiled nothing)."""
    artifacts = torch.compiler.save_cache_artifacts() if supported() else None
    if artifacts is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    header = json.dumps(made_for, sort_keys=True).encode() + _HEADER_END
    atomic_write(directory / FILE.format(rank=rank), lambda file: (file.write(header), file.write(artifacts[0])))


def load(directory: Path, rank: int, made_for: dict[str, Any]) -> str | None:
    """Load this rank's artifacts from checkpoint `directory` into the compile caches; a line
    saying why they were passed over, or None (loaded, or the checkpoint has none)."""
    path = directory / FILE.format(rank=rank)
    if not path.is_file() or not supported():
        return None
    try:
        header, artifacts = path.read_bytes().split(_HEADER_END, 1)
        saved_for = json.loads(header)
    except (OSError, ValueError) as exc:
        return f"compile artifacts {path} cannot be read ({type(exc).__name__}): compiling from scratch"
    different = sorted(key for key in made_for if saved_for.get(key) != made_for[key])
    if different:
        return (f"compile artifacts {path} were made for another {', '.join(different)}: compiling from scratch "
                "(--no-compile-artifacts stops saving them)")
    try:
        torch.compiler.load_cache_artifacts(artifacts)
    except Exception as exc:  # noqa: BLE001 -- a cache: any failure means compiling cold
        return f"compile artifacts {path} could not be loaded ({type(exc).__name__}: {str(exc)[:200]}): " \
               "compiling from scratch"
    return None
