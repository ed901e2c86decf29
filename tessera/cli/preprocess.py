"""`tessera preprocess`: JSONL to Megatron .bin/.idx (the flags of Megatron's tools/preprocess_data.py);
with --sft, conversations to token and loss-mask pairs (tessera.posttrain.sft_preprocess)."""

from __future__ import annotations

import argparse
import dataclasses

from tessera.cli.args import OneLineParser, fail
from tessera.config import ConfigError, DataConfig, flag
from tessera.config.posttrain import PostTrainConfig

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


def add_sft_flags(parser: argparse.ArgumentParser) -> None:
    """--sft and training's --sft-tokenizer-prompt-format (same help and choices, from PostTrainConfig)."""
    group = parser.add_argument_group("supervised fine-tuning data")
    group.add_argument("--sft", action="store_true",
                       help="the input holds conversations (rows of \"messages\", or \"prompt\" and \"completion\"): "
                            "write OUTPUT_conversations.bin/.idx (tokens) and OUTPUT_conversations_loss_mask.bin/.idx "
                            "(1 on assistant tokens), for training's --sft --data-path OUTPUT_conversations")
    prompt_format = {f.name: f for f in dataclasses.fields(PostTrainConfig)}["sft_tokenizer_prompt_format"]
    group.add_argument("--sft-tokenizer-prompt-format", default=prompt_format.default,
                       choices=prompt_format.metadata["choices"], help=prompt_format.metadata["help"])


def tokenizer_config(args: argparse.Namespace) -> DataConfig:
    return DataConfig(**{name: getattr(args, name) for name in TOKENIZER_FIELDS})


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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
    add_sft_flags(parser)
    return parser


# Flags of text preprocessing that --sft does not take, with their defaults.
TEXT_ONLY = {"json_keys": ["text"], "append_eod": False, "split_sentences": False, "keep_newlines": False}


def run(args: argparse.Namespace) -> list[str]:
    """Preprocess as `args` say; the summary's lines."""
    from tessera.data.preprocess import preprocess

    common = dict(workers=args.workers, skip_bad_lines=args.skip_bad_lines, log_interval=args.log_interval,
                  vocab_size=args.vocab_size)
    if args.sft:
        from tessera.posttrain.sft_preprocess import preprocess_sft, summary_lines

        for name, default in TEXT_ONLY.items():
            if getattr(args, name) != default:
                raise ConfigError(f"--sft takes conversations, not {flag(name)} (the tokens come from the messages)")
        return summary_lines(preprocess_sft(args.input, args.output_prefix, tokenizer_config(args),
                                            args.sft_tokenizer_prompt_format, **common))
    summary = preprocess(args.input, args.output_prefix, tokenizer_config(args), json_keys=args.json_keys,
                         append_eod=args.append_eod, split_sentences=args.split_sentences,
                         keep_newlines=args.keep_newlines, **common)
    return summary.lines()


def main(argv: list[str]) -> int:
    from tessera.data.preprocess import PreprocessError

    args = build_parser().parse_args(argv)
    if args.partitions < 1 or args.workers % args.partitions:
        fail(PROG, f"--workers ({args.workers}) must be a positive multiple of --partitions ({args.partitions})")
    try:
        lines = run(args)
    except (ConfigError, PreprocessError, OSError) as exc:
        fail(PROG, str(exc))
    print("\n".join(lines))
    return 0
