"""The driver of a run on Ray: prepare, launch, follow and resume a run (``etrain run`` / ``submit`` / ``resume``
and the Python API), and the progress it shows."""
