"""``python -m orchestrator ...`` is the ``etrain`` command (for clusters where only the source is shipped)."""

import sys

from .cli import main

sys.exit(main())
