"""Megatron-LM's `tools/preprocess_data.py`, run by tessera: JSONL to Megatron's .bin/.idx with
Megatron's flags (--input, --output-prefix, --tokenizer-type, --vocab-file, --merge-file,
--tokenizer-model, --json-keys, --append-eod, --workers, ...), byte for byte what Megatron writes
for the same tokenizer. It is `tessera preprocess`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # this checkout's tessera

from tessera.cli.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
