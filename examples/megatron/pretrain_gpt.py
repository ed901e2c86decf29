"""Megatron-LM's `pretrain_gpt.py`, run by tessera: a Megatron launch script works unchanged from
this folder, e.g.

    torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 24 --hidden-size 2048 ... --bf16

The flags are Megatron's (`tessera train --help` lists them by group; Megatron's shorthands and its
Transformer Engine switches are taken as examples/megatron/README.md says). Each rank runs
`tessera train`'s main.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's tessera

from tessera.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
