"""``python -m orchestrator ...`` is the ``etrain`` command (for clusters where only the source is shipped)."""

import sys

from .cli.main import main

sys.exit(main())
