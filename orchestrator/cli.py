"""The ``etrain`` command.

    etrain train --config examples/tiny.toml [--set parallel.tp=2 ...]
    etrain ckpt {ls,inspect,verify} URL

``etrain train`` is ``python -m trainer`` (one process, or one rank under a
launcher such as torchrun).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="etrain", description="Fault-tolerant, elastic training on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train one config in this process (same as python -m trainer)", add_help=False)
    sub.add_parser("ckpt", help="list, inspect and verify checkpoints", add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.command == "train":
        from trainer.cli import main as train_main

        return train_main(rest)
    if args.command == "ckpt":
        from checkpointing.cli import main as ckpt_main

        return ckpt_main(rest)
    ap.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
