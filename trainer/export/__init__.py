"""Model exports: a committed checkpoint's model as a ``transformers`` directory or one file (``convert``), and
``[checkpoint] export_every`` (``every``)."""
