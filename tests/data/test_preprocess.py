"""JSONL -> .bin/.idx: contents against the tokenizer itself, bad input, atomic outputs, the CLI."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from tessera.cli.preprocess import main as preprocess_main
from tessera.config import DataConfig
from tessera.data.encode import split_sentences
from tessera.data.indexed import IndexedDataset
from tessera.data.preprocess import PreprocessError, preprocess
from tessera.data.tokenizers import ByteTokenizer

BYTES = DataConfig(tokenizer_type="ByteTokenizer")
EOD = ByteTokenizer.eod


def documents(n=120):
    return [{"text": f"Document {i}. " + "word " * (i % 7) + "é" * (i % 3), "title": f"T{i}"} for i in range(n)]


def write_jsonl(path, docs, raw_lines=()):
    with open(path, "wb") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return str(path)


def contents(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_indices.tolist()


def test_outputs_match_the_tokenizer_for_every_key(tmp_path):
    docs = documents()
    summary = preprocess([write_jsonl(tmp_path / "in.jsonl", docs)], str(tmp_path / "out"), BYTES,
                         json_keys=["text", "title"], append_eod=True, workers=2, block_bytes=256)
    assert summary.documents == len(docs) and summary.skipped_lines == 0
    for key in ("text", "title"):
        sequences, doc_indices = contents(tmp_path / f"out_{key}_document")
        assert sequences == [list(d[key].encode()) + [EOD] for d in docs]
        assert doc_indices == list(range(len(docs) + 1))
        assert IndexedDataset(tmp_path / f"out_{key}_document").dtype == np.uint16
        assert summary.keys[key].tokens == sum(len(s) for s in sequences)


def test_output_is_identical_whatever_the_workers_blocks_and_compression(tmp_path):
    docs = documents()
    plain = write_jsonl(tmp_path / "a.jsonl", docs[:70])
    write_jsonl(tmp_path / "b.jsonl", docs[70:])
    preprocess([plain, str(tmp_path / "b.jsonl")], str(tmp_path / "one"), BYTES, workers=1)
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write((tmp_path / "b.jsonl").read_bytes())
    (tmp_path / "b.jsonl").unlink()
    preprocess([str(tmp_path / "*.jsonl*")], str(tmp_path / "many"), BYTES, workers=3, block_bytes=100)
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"many_text_document{ext}").read_bytes()


def test_split_sentences_makes_one_sequence_per_sentence(tmp_path):
    docs = [{"text": "First one. Second one! Third?"}, {"text": "Alone"}]
    preprocess([write_jsonl(tmp_path / "in.jsonl", docs)], str(tmp_path / "out"), BYTES, split_sentences=True,
               append_eod=True)
    sequences, doc_indices = contents(tmp_path / "out_text_sentence")
    assert sequences == [list(b"First one."), list(b"Second one!"), list(b"Third?") + [EOD], list(b"Alone") + [EOD]]
    assert doc_indices == [0, 3, 4]


def test_sentence_splitter_rules():
    assert split_sentences("A b. C d? \"E\" f.\n\nG") == ["A b.", "C d?", "\"E\" f.", "G"]
    assert split_sentences("e.g. lower case stays. Ok") == ["e.g. lower case stays.", "Ok"]
    assert split_sentences("One.\nTwo.", keep_newlines=True) == ["One.\n", "Two."]
    assert split_sentences("") == [""]


def test_empty_documents_and_blank_lines(tmp_path):
    docs = [{"text": "ab"}, {"text": ""}, {"text": "c"}]
    path = write_jsonl(tmp_path / "in.jsonl", docs, raw_lines=[b"", b"   "])
    summary = preprocess([path], str(tmp_path / "out"), BYTES, append_eod=True)
    sequences, doc_indices = contents(tmp_path / "out_text_document")
    # An empty document closes a document with no sequence and gets no EOD (Megatron's writer).
    assert sequences == [[97, 98, EOD], [99, EOD]] and doc_indices == [0, 1, 1, 2]
    assert summary.documents == 3 and summary.keys["text"].empty_documents == 1


BAD_LINES = [
    (b'{"text": "unterminated', "malformed JSON"),
    (b'{"text": "caf\xe9"}', "not valid UTF-8"),
    (b'{"title": "no text"}', "missing key 'text'"),
    (b'{"text": 42}', "key 'text' is int"),
    (b'["text"]', "expected a JSON object"),
    (b'{"text": "lone \\ud800 surrogate"}', "key 'text' holds a lone surrogate"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_bad_line_stops_with_file_and_line_and_leaves_no_output(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "in.jsonl", documents(50), raw_lines=[line])
    with pytest.raises(PreprocessError, match=rf"in\.jsonl:51: {reason}"):
        preprocess([path], str(tmp_path / "out"), BYTES, workers=2, block_bytes=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


STOPS_WITHOUT_HANGING = """
import json, signal, sys
from tessera.config import DataConfig
from tessera.data.preprocess import PreprocessError, preprocess
signal.signal(signal.SIGTERM, lambda *_: None)   # as a Trainer with --exit-signal-handler leaves it
folder = sys.argv[1]
lines = [json.dumps({"text": f"document {i} " * 2000}) for i in range(300)]
with open(folder + "/good.jsonl", "w") as f:
    f.write("\\n".join(lines) + "\\n")
lines[3] = "{not json"
with open(folder + "/bad.jsonl", "w") as f:
    f.write("\\n".join(lines) + "\\n")
for attempt in range(8):
    try:
        preprocess([folder + "/bad.jsonl"], folder + "/out", DataConfig(tokenizer_type="ByteTokenizer"),
                   workers=2, block_bytes=1 << 16)
    except PreprocessError:
        pass
    preprocess([folder + "/good.jsonl"], folder + f"/out{attempt}", DataConfig(tokenizer_type="ByteTokenizer"),
               workers=2, block_bytes=1 << 16)
print("done")
"""


def test_an_error_with_blocks_in_flight_stops_without_hanging(tmp_path):
    """A bad line while the workers still encode large blocks: multiprocessing.Pool's terminate()
    hung there (workers blocked writing results nothing read), in most of a few tries; so does a
    pool whose parent only notes SIGTERM. In a subprocess, so that a hang fails the test."""
    result = subprocess.run([sys.executable, "-c", STOPS_WITHOUT_HANGING, str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-2000:]


def test_skip_bad_lines_drops_them_from_every_key_and_counts(tmp_path):
    docs = [{"text": "ab", "title": "x"}, {"text": "cd", "title": "y"}]
    path = write_jsonl(tmp_path / "in.jsonl", docs[:1], raw_lines=[line for line, _ in BAD_LINES])
    with open(path, "ab") as f:
        f.write(json.dumps(docs[1]).encode() + b"\n")
    summary = preprocess([path], str(tmp_path / "out"), BYTES, json_keys=["text", "title"], skip_bad_lines=True)
    assert summary.skipped_lines == len(BAD_LINES) and summary.documents == 2
    assert contents(tmp_path / "out_text_document")[0] == [[97, 98], [99, 100]]
    assert contents(tmp_path / "out_title_document")[0] == [[120], [121]]


def test_cli_runs_and_reports_errors_in_one_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", documents(5))
    args = ["--input", path, "--output-prefix", str(tmp_path / "out"), "--workers", "1",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"]
    with pytest.raises(SystemExit) as exit_info:  # the texts are not ids
        preprocess_main(args)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "in.jsonl:1: key 'text': tokenizer error" in error


def test_cli_success_prints_summary(tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4"}])
    assert preprocess_main(["--input", path, "--output-prefix", str(tmp_path / "out"), "--workers", "1",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--append-eod"]) == 0
    assert "documents: 2" in capsys.readouterr().out
    assert contents(tmp_path / "out_text_document") == ([[1, 2, 3, 49], [4, 49]], [0, 1, 2])
    path = write_jsonl(tmp_path / "range.jsonl", [{"text": "1 50"}])
    with pytest.raises(SystemExit):
        preprocess_main(["--input", path, "--output-prefix", str(tmp_path / "r"), "--workers", "1",
                         "--tokenizer-type", "NullTokenizer", "--vocab-size", "50"])
    assert "outside the vocabulary" in capsys.readouterr().err
