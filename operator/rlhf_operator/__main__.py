"""`python -m rlhf_operator`: the operator's own command line (`operator`, `crd`), for the operator
image, which installs `rlhf_api` and `rlhf_operator` only (no trainer, no torch). Where the whole
project is installed, `rlhf operator` and `rlhf crd` are the same subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rlhf_operator import cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_operator",
        description="The rlhf-operator controller: run it (operator) or print its CRD (crd).",
    )
    cli.add_subcommands(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
