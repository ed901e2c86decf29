"""On-disk cache of the sample indices, keyed by a hash of everything that determines them.

Building a GPT or blend index walks the whole dataset; reading it back is a memory-map.
The key is the MD5 of the JSON description (Megatron's scheme), so a change to any input
-- dataset files, split, sample count, sequence length, seed -- gives a new entry
instead of stale indices. Files are written under temporary names and renamed, the
description last, so that ranks or jobs building the same entry at the same time (on a
shared filesystem), or a crash mid-write, never leave a half-written entry that looks
complete. Within one job the trainer builds on rank 0 first and the other ranks read its
entry (tessera.parallel.launch.build_in_turns).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from tessera.files import atomic_write


def default_cache_dir(prefix: str) -> str:
    """Megatron's default: a directory named like the dataset prefix, beside the dataset."""
    return os.path.join(prefix, "cache", "GPTDataset_indices")


def describe_files(prefix: str) -> dict:
    """What identifies a dataset's content cheaply: its resolved path and file sizes."""
    return {"path": os.path.realpath(prefix),
            "bin_bytes": os.path.getsize(prefix + ".bin"), "idx_bytes": os.path.getsize(prefix + ".idx")}


def cached_arrays(cache_dir: str | None, kind: str, description: dict, names: tuple[str, ...],
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays `names` for `description`: memory-mapped from the cache, else built and saved.

    Without a cache directory, or when it cannot be written, they are built in memory.
    """
    text = json.dumps(description, indent=4, sort_keys=True)
    key = hashlib.md5(text.encode("utf-8")).hexdigest()
    if cache_dir is None:
        return build()
    stem = Path(cache_dir) / f"{key}-{kind}-{description.get('split', 'all')}"
    paths = {name: Path(f"{stem}-{name}.npy") for name in names}
    description_path = Path(f"{stem}-description.txt")
    if description_path.is_file() and all(p.is_file() for p in paths.values()):
        return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
    arrays = build()
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        for name, path in paths.items():
            atomic_write(path, lambda f, a=arrays[name]: np.save(f, a))
        atomic_write(description_path, lambda f: f.write(text.encode("utf-8")))
    except OSError as exc:
        warnings.warn(f"cannot write the index cache in {cache_dir} ({exc}); indices will be rebuilt next run")
    return arrays

