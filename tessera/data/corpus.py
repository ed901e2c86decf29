"""A real-text corpus that exists offline on every machine: the Python standard library.

For the demo and the preprocessing benchmark: every `.py` file of the running
interpreter's standard library (third-party site-packages excluded), one JSONL document
per file, in sorted path order so the corpus is the same on every run of one Python.
More directories of Python sources (a site-packages, say) can follow it, for a corpus
that a longer run does not repeat.
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


def _sources(more_roots: tuple[Path, ...]) -> list[tuple[Path, str]]:
    """(file, its name in the corpus): the standard library's, then each of `more_roots`' `.py` files
    under the root's own name, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    named = [(path, str(path.relative_to(stdlib))) for path in stdlib_sources()]
    for root in map(Path, more_roots):
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a directory of Python sources")
        named += [(path, str(Path(root.name) / path.relative_to(root)))
                  for path in sorted(root.rglob("*.py"), key=lambda p: str(p.relative_to(root)))]
    return named


def build_stdlib_corpus(out_jsonl: str | os.PathLike, max_mb: float | None = None,
                        more_roots: tuple[str | os.PathLike, ...] = ()) -> tuple[int, int]:
    """Write the standard library's sources (then those under `more_roots`) as {"text", "path"}
    lines, up to max_mb megabytes.

    Returns (documents, bytes written). Files that are not UTF-8 are skipped. The file is
    written under a temporary name and renamed, so a partial corpus never looks complete.
    """
    limit = None if max_mb is None else int(max_mb * 1e6)
    out_jsonl = Path(out_jsonl)
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    temporary = out_jsonl.with_name(f"{out_jsonl.name}.tmp{os.getpid()}")
    sources = _sources(tuple(more_roots))   # a missing root fails before anything is written
    documents = written = 0
    with open(temporary, "wb") as out:
        for path, name in sources:
            try:
                text = path.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            line = json.dumps({"text": text, "path": name}, ensure_ascii=False).encode() + b"\n"
            if limit is not None and written + len(line) > limit:
                break
            out.write(line)
            documents += 1
            written += len(line)
    os.replace(temporary, out_jsonl)
    return documents, written
