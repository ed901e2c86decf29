"""Writing a file that other ranks, nodes or jobs may open at any moment.

The content goes to a temporary name unique to this host and process (two nodes of a job,
or two jobs, can share a filesystem and even a pid), then is renamed over the target: a
reader sees the old file or the new one, never a part, and a crash leaves no half file.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import BinaryIO, Callable


def temporary_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object], *, durable: bool = False) -> None:
    """write(file) into a temporary file, then rename it to `path`; `durable` also fsyncs
    the file and its directory (the checkpoint tracker must survive a power loss)."""
    path = Path(path)
    temporary = temporary_name(path)
    try:
        with open(temporary, "wb") as file:
            write(file)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
