"""A real-text corpus that exists offline on every machine: the Python standard library.

For the demo and the preprocessing benchmark: every `.py` file of the running
interpreter's standard library (third-party site-packages excluded), one JSONL document
per file, in sorted path order so the corpus is the same on every run of one Python.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts),
                  key=lambda p: str(p.relative_to(root)))


def build_stdlib_corpus(out_jsonl: str | os.PathLike, max_mb: float | None = None) -> tuple[int, int]:
    """Write the standard library's sources as {"text", "path"} lines, up to max_mb megabytes.

    Returns (documents, bytes written). Files that are not UTF-8 are skipped. The file is
    written under a temporary name and renamed, so a partial corpus never looks complete.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    limit = None if max_mb is None else int(max_mb * 1e6)
    out_jsonl = Path(out_jsonl)
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_jsonl.with_name(f"{out_jsonl.name}.tmp{os.getpid()}")
    documents = written = 0
    with open(temporary, "wb") as out:
        for path in stdlib_sources():
            try:
                text = path.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            line = json.dumps({"text": text, "path": str(path.relative_to(root))}, ensure_ascii=False).encode() + b"\n"
            if limit is not None and written + len(line) > limit:
                break
            out.write(line)
            documents += 1
            written += len(line)
    os.replace(temporary, out_jsonl)
    return documents, written
