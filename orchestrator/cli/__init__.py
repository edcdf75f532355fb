"""The ``etrain`` command: its parser and dispatch (``main``), the control commands, the queue and service
commands, ``top``, ``plot`` and ``demo``."""
