"""The offline demo corpus: the standard library's sources as JSONL."""

import json
import sysconfig
from pathlib import Path

from tessera.data.corpus import build_stdlib_corpus


def test_stdlib_corpus_holds_the_sources_in_order_within_the_limit(tmp_path):
    out = tmp_path / "corpus.jsonl"
    documents, written = build_stdlib_corpus(out, max_mb=0.3)
    lines = out.read_bytes().splitlines()
    assert documents == len(lines) > 0 and written == out.stat().st_size <= 300_000
    rows = [json.loads(line) for line in lines]
    assert [r["path"] for r in rows] == sorted(r["path"] for r in rows)
    root = Path(sysconfig.get_paths()["stdlib"])
    for row in rows:
        assert row["path"].endswith(".py") and row["text"] == (root / row["path"]).read_text(encoding="utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]
