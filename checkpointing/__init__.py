"""Sharded, transactional checkpoints on any fsspec URL, and resharding on load.

Knows nothing of Ray or of the model.
"""
