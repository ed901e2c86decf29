"""The preprocessing workers' job: one block of JSONL lines in, token arrays out.

A block is a run of whole lines from one input file. Each line is one JSON document;
every --json-keys key of it is tokenized into its own output. What happens to odd
input is defined here, once:

- a blank line is ignored;
- a line that is not valid UTF-8, not valid JSON, not a JSON object, lacks a key, has
  a key whose value is not a string or holds a lone surrogate (an escape like \\ud800),
  or that the tokenizer rejects, is a *bad line*: the
  run stops naming the file and line, or with --skip-bad-lines the line is dropped from
  every output (so the outputs of different keys stay aligned) and counted;
- an empty text (or one whose sentences all tokenize to nothing) is an *empty document*:
  like Megatron it closes a document with no sequences and gets no EOD, and is counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from tessera.data.tokenizers import Tokenizer

# A sentence ends at . ! or ? (plus closing quotes/brackets) before whitespace and a
# capital, digit or opening quote; a blank line also ends one. A regex, so that it works
# offline with nothing to download (NLTK's punkt needs a data download); unlike punkt it
# does not know abbreviations, so "Dr. Smith" is split after "Dr.".
_SENTENCE_END = re.compile(r"(?<=[.!?])([\"')\]]*)(\s+)(?=[\"'(\[]?[A-Z0-9])|\n\s*\n")


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Sentences of `text`; the whitespace between them is dropped unless it holds a newline
    and keep_newlines is set, in which case it stays at the end of the earlier sentence."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        closing = match.group(1) or ""
        gap = match.group(0)[len(closing):]
        end = match.start() + len(closing)
        tail = gap if keep_newlines and "\n" in gap else ""
        sentences.append(text[start:end] + tail)
        start = match.end()
    sentences.append(text[start:])
    return [s for s in sentences if s.strip()] if len(sentences) > 1 else sentences


@dataclass
class EncodeOptions:
    json_keys: list[str]
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False


@dataclass
class EncodedKey:
    """One key's output for a block: tokens of every kept sequence, and its structure."""

    tokens: np.ndarray
    sequence_lengths: np.ndarray  # int32, one per sequence
    sequences_per_document: np.ndarray  # int64, one per document (0 for an empty one)


@dataclass
class EncodedBlock:
    keys: dict[str, EncodedKey]
    documents: int = 0
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)


def read_json_object(raw: bytes) -> dict:
    """The JSON object of one JSONL line; raises ValueError with the reason the line is bad."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 (byte {exc.start})") from None
    try:
        document = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {type(document).__name__}")
    return document


def parse_line(raw: bytes, keys: list[str]) -> dict[str, str]:
    """The texts of one JSONL line; raises ValueError with the reason the line is bad."""
    document = read_json_object(raw)
    texts = {}
    for key in keys:
        if key not in document:
            raise ValueError(f"missing key '{key}'")
        if not isinstance(document[key], str):
            raise ValueError(f"key '{key}' is {type(document[key]).__name__}, not a string")
        texts[key] = document[key]
    if b"\\ud" in raw or b"\\uD" in raw:  # a JSON escape can encode a lone surrogate: not valid Unicode
        for key, text in texts.items():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"key '{key}' holds a lone surrogate at character {exc.start}") from None
    return texts


def _tokenize_all(tokenizer: Tokenizer, texts: list[str]) -> list:
    """Token ids per text; a text the tokenizer rejects gets the exception instead."""
    try:
        return tokenizer.tokenize_batch(texts)
    except Exception:  # find which texts fail (an id out of range, a text a model rejects...)
        results = []
        for text in texts:
            try:
                results.append(tokenizer.tokenize(text))
            except Exception as exc:
                results.append(exc)
        return results


def _assemble(ids: list, sentences_per_doc: np.ndarray, dtype: np.dtype, eod: int | None) -> EncodedKey:
    """Concatenate sentence ids, drop empty sentences, append EOD to each non-empty document."""
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    tokens = np.concatenate([np.asarray(x, dtype=dtype) for x in ids]) if ids else np.zeros(0, dtype)
    keep = lengths > 0
    document_of_sentence = np.repeat(np.arange(len(sentences_per_doc)), sentences_per_doc)
    lengths = lengths[keep]
    per_document = np.bincount(document_of_sentence[keep], minlength=len(sentences_per_doc)).astype(np.int64)
    if eod is not None and len(lengths):
        last_sentence = np.cumsum(per_document)[per_document > 0] - 1
        tokens = np.insert(tokens, np.cumsum(lengths)[last_sentence], np.asarray(eod, dtype=dtype))
        lengths[last_sentence] += 1
    return EncodedKey(tokens, lengths.astype(np.int32), per_document)


def encode_block(lines: list[bytes], first_line: int, tokenizer: Tokenizer, options: EncodeOptions,
                 dtype: np.dtype) -> EncodedBlock:
    """Parse and tokenize one block of lines; `first_line` is the 1-based number of lines[0]."""
    bad: dict[int, str] = {}
    documents: list[tuple[int, dict[str, str]]] = []
    for number, raw in enumerate(lines, first_line):
        if raw.strip():
            try:
                documents.append((number, parse_line(raw, options.json_keys)))
            except ValueError as exc:
                bad[number] = str(exc)
    ids_per_key = {}
    for key in options.json_keys:
        texts = [texts[key] for _, texts in documents]
        if options.split_sentences:
            pieces = [split_sentences(text, options.keep_newlines) for text in texts]
            counts = [len(p) for p in pieces]
            flat = [sentence for p in pieces for sentence in p]
        else:
            counts, flat = [1] * len(texts), texts
        ids = _tokenize_all(tokenizer, flat)
        ids_per_key[key] = (ids, counts)
        start = 0
        for (number, _), count in zip(documents, counts):
            failure = next((x for x in ids[start:start + count] if isinstance(x, Exception)), None)
            if failure is not None:
                bad.setdefault(number, f"key '{key}': tokenizer error: {failure}")
            start += count
    good = [number not in bad for number, _ in documents]
    result = EncodedBlock(keys={}, bad_lines=sorted(bad.items()), documents=sum(good))
    eod = tokenizer.eod if options.append_eod else None
    for key, (ids, counts) in ids_per_key.items():
        kept_ids, kept_counts, start = [], [], 0
        for keep, count in zip(good, counts):
            if keep:
                kept_ids.extend(ids[start:start + count])
                kept_counts.append(count)
            start += count
        result.keys[key] = _assemble(kept_ids, np.asarray(kept_counts, dtype=np.int64), dtype, eod)
    return result
