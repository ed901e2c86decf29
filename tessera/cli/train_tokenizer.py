"""`tessera train-tokenizer`: a byte-level BPE tokenizer.json from JSONL text, offline."""

from __future__ import annotations

import argparse
import time

from tessera.cli.args import OneLineParser, fail

PROG = "tessera train-tokenizer"


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog=PROG, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                     description="Train a byte-level BPE tokenizer (Hugging Face tokenizers) on JSONL text. "
                                 "Use the result with --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH.")
    parser.add_argument("--input", nargs="+", required=True, help="JSONL file(s): paths or globs; .gz is read too")
    parser.add_argument("--output", required=True, help="the tokenizer.json to write")
    parser.add_argument("--json-key", default="text", help="key holding the text")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size, special token included")
    parser.add_argument("--min-frequency", type=int, default=2, help="fewest occurrences of a pair to merge it")
    parser.add_argument("--max-bytes", type=int, help="train on at most this many bytes of input")
    parser.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) malformed lines")
    args = parser.parse_args(argv)
    from tessera.data.preprocess import PreprocessError
    from tessera.data.train_tokenizer import TrainingText, train_bpe_tokenizer

    text = TrainingText(args.input, args.json_key, args.max_bytes, args.skip_bad_lines)
    start = time.perf_counter()
    try:
        tokenizer = train_bpe_tokenizer(text, args.output, args.vocab_size, args.min_frequency)
    except (PreprocessError, ValueError, OSError) as exc:
        fail(PROG, str(exc))
    print(f"trained on {text.documents:,} documents ({text.bytes / 1e6:,.1f} MB, {text.skipped_lines:,} lines "
          f"skipped) in {time.perf_counter() - start:,.1f} s: vocabulary {tokenizer.get_vocab_size():,} -> {args.output}")
    return 0
