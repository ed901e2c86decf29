"""Entry point of `tessera <command>` and `python -m tessera <command>`."""

import sys

from tessera.cli import run


def main() -> int:
    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
