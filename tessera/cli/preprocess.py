"""`tessera preprocess`: JSONL to Megatron .bin/.idx (the flags of Megatron's tools/preprocess_data.py)."""

from __future__ import annotations

import argparse
import dataclasses

from tessera.cli.args import _Parser, fail
from tessera.config import ConfigError, DataConfig, flag

PROG = "tessera preprocess"
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
                    "tiktoken_pattern", "tiktoken_num_special_tokens")


def add_tokenizer_flags(parser: argparse.ArgumentParser) -> None:
    """The tokenizer flags of training (same names, help and choices, from DataConfig)."""
    group = parser.add_argument_group("tokenizer (local files only)")
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    for name in TOKENIZER_FIELDS:
        meta, default = fields[name].metadata, fields[name].default
        group.add_argument(flag(name), dest=name, default=default, choices=meta.get("choices"),
                           type=type(default) if default is not None else str, help=meta["help"])
    group.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size (or a cap on TikTokenizer's)")


def tokenizer_config(args: argparse.Namespace) -> DataConfig:
    return DataConfig(**{name: getattr(args, name) for name in TOKENIZER_FIELDS})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                     description="Tokenize JSONL documents into Megatron-Core IndexedDataset files, "
                                 "one PREFIX_KEY_document.bin/.idx pair per JSON key.")
    group = parser.add_argument_group("input and output")
    group.add_argument("--input", nargs="+", required=True, help="JSONL file(s): paths or globs; .gz is read too")
    group.add_argument("--output-prefix", required=True, help="output path prefix")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one output pair each")
    group.add_argument("--append-eod", action="store_true", help="append the EOD token to every non-empty document")
    group.add_argument("--split-sentences", action="store_true",
                      help="one sequence per sentence (a regex splitter that needs no downloads)")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip (and count) malformed lines instead of stopping at the first")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="tokenizing processes")
    group.add_argument("--partitions", type=int, default=1,
                       help="accepted for Megatron scripts; tessera streams in one pass, so the output is the same")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines (no terminal)")
    add_tokenizer_flags(parser)
    return parser


def main(argv: list[str]) -> int:
    from tessera.data.preprocess import PreprocessError, preprocess

    args = build_parser().parse_args(argv)
    if args.partitions < 1 or args.workers % args.partitions:
        fail(PROG, f"--workers ({args.workers}) must be a positive multiple of --partitions ({args.partitions})")
    try:
        summary = preprocess(args.input, args.output_prefix, tokenizer_config(args), json_keys=args.json_keys,
                             append_eod=args.append_eod, split_sentences=args.split_sentences,
                             keep_newlines=args.keep_newlines, workers=args.workers,
                             skip_bad_lines=args.skip_bad_lines, log_interval=args.log_interval,
                             vocab_size=args.vocab_size)
    except (ConfigError, PreprocessError, OSError) as exc:
        fail(PROG, str(exc))
    print("\n".join(summary.lines()))
    return 0
