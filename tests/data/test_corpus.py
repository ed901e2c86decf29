"""The offline demo corpus: the standard library's sources as JSONL."""

import json
import sysconfig
from pathlib import Path

import pytest

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


def test_more_roots_follow_the_standard_library_under_their_own_names(tmp_path):
    extra = tmp_path / "pkg"
    (extra / "sub").mkdir(parents=True)
    (extra / "b.py").write_text("b = 2\n")
    (extra / "sub" / "a.py").write_text("a = 1\n")
    (extra / "notes.txt").write_text("not Python\n")
    out = tmp_path / "corpus.jsonl"
    documents, _ = build_stdlib_corpus(out, more_roots=(extra,))
    rows = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert documents == len(rows)
    assert [(r["path"], r["text"]) for r in rows[-2:]] == [("pkg/b.py", "b = 2\n"), ("pkg/sub/a.py", "a = 1\n")]
    assert len(rows) > 2 and not any(r["path"].startswith("pkg/") for r in rows[:-2])   # the stdlib first


def test_a_missing_root_is_named_and_nothing_is_written(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: not a directory"):
        build_stdlib_corpus(tmp_path / "corpus.jsonl", more_roots=(tmp_path / "nowhere",))
    assert list(tmp_path.iterdir()) == []
