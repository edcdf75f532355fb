"""``python -m trainer`` (see trainer.cli)."""

import sys

from .cli import main

sys.exit(main())
