"""The driver of a run on Ray: prepare, launch, follow and resume a run (``etrain run`` / ``submit`` / ``resume``
and the Python API), and the progress it shows: ``run.py`` (prepare, launch, follow, resume), ``cluster.py``
(join a Ray cluster, or start a local one; Ray's token), ``job_paths.py`` (the local paths a submitted run's
Ray job is given), ``progress.py``."""
