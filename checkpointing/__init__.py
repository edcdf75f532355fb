"""Sharded, transactional checkpoints on any fsspec URL, and resharding on load.

Knows nothing of Ray or of the model. Its rooms: ``storage/`` (the storage seam and its backends),
``dcp/`` (the DCP writer and reader), ``export/`` (exports of a committed step), ``recovery/`` (the
host-memory tier); at its top, the manager, one save attempt (``transaction``), the manifest, the run
root's layout, the writer lock, names and errors.
"""
