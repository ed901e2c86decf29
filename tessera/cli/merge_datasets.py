"""`tessera merge-datasets`: concatenate .bin/.idx datasets (the job of Megatron's tools/merge_datasets.py)."""

from __future__ import annotations

import argparse
import glob

from tessera.cli.args import OneLineParser, fail

PROG = "tessera merge-datasets"


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog=PROG, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                     description="Concatenate datasets of one token dtype, in the order given, into one pair.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="directory: merge every PREFIX.bin/.idx pair in it, sorted by name")
    source.add_argument("--input-prefixes", nargs="+", help="dataset prefixes to merge, in this order")
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged .bin/.idx")
    args = parser.parse_args(argv)
    from tessera.data.indexed import IndexedDatasetError, merge_datasets

    prefixes = args.input_prefixes or sorted(path[:-4] for path in glob.glob(f"{glob.escape(args.input)}/*.idx"))
    if not prefixes:
        fail(PROG, f"--input {args.input}: no .idx files there")
    try:
        merged = merge_datasets(prefixes, args.output_prefix)
    except (IndexedDatasetError, ValueError, OSError) as exc:
        fail(PROG, str(exc))
    print(f"merged {len(prefixes)} datasets: {merged.num_documents:,} documents, {len(merged):,} sequences, "
          f"{merged.num_tokens:,} tokens -> {args.output_prefix}.bin/.idx")
    return 0
