"""The argument parser of every ``etrain`` command: argparse's, whose usage errors never repeat a secret.

    ap = ArgumentParser(prog="etrain ckpt", description="...")    # as argparse.ArgumentParser

argparse quotes a bad value back (``invalid int value: 's3://user:pass@b/x'``); here every URL in that
message is shown with its ``user:password@`` part and query hidden (:func:`checkpointing.names.redact_text`),
as every other etrain message is. Exit 2 with the usage line, as argparse does.
"""

from __future__ import annotations

import argparse
import sys

from .names import redact_text


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, redact_text(f"{self.prog}: error: {message}\n"))
