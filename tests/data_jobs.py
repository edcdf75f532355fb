"""Data jobs that tests run inside real multi-process groups (see tests.harness), and a dataset factory.

``train_recording`` loads the corpus on every rank before any process group
exists (as ``python -m trainer`` does: the ranks race for the token cache),
trains through the real Trainer, and records what each step consumed: for
each global sample position, a hash of the token row the Batcher handed the
step. Resuming goes through a real checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.checkpoints import checkpoint_manager
from trainer.loop import Trainer
from trainer.world import World, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def train_recording(payload: dict) -> dict:
    """Train ``steps`` steps (after resuming when ``resume``); rows consumed by position, this rank."""
    world = World.from_env()
    cfg = load_config(None, payload["overrides"])
    corpus = load_corpus(cfg.data)  # before the process group, on every rank at once
    init_distributed(world, CPU)
    try:
        trainer = Trainer(cfg, world, corpus=corpus, device=CPU)
        mgr = checkpoint_manager(cfg, world)
        if payload.get("resume"):
            manifest = trainer.load_checkpoint(mgr)
            assert manifest is not None, "nothing to resume from"
        rows: dict[int, str] = {}
        tokens = trainer.batcher.tokens

        def recording(positions):
            x, y = tokens(positions)
            full = torch.cat([x, y[:, -1:]], dim=1).numpy()
            for pos, row in zip(positions, full):
                rows[pos] = xxhash.xxh64(np.ascontiguousarray(row).tobytes()).hexdigest()
            return x, y

        trainer.batcher.tokens = recording
        start = trainer.samples_consumed
        losses = [trainer.train_step().loss for _ in range(payload["steps"])]
        if mgr is not None:
            trainer.save_checkpoint(mgr)
            mgr.wait()
            mgr.close()
        return {"rows": rows, "start": start, "samples_consumed": trainer.samples_consumed, "losses": losses,
                "corpus": corpus.describe(), "dp": trainer.dims.dp}
    finally:
        shutdown_distributed()


class TokenDocuments:
    """A map-style dataset of token-id documents (``data.source = "python"``)."""

    def __init__(self, n: int, seed: int):
        rng = np.random.default_rng(seed)
        self.docs = [rng.integers(1, 300, size=int(rng.integers(5, 60))) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.docs[i]) if i % 2 else self.docs[i].tolist()


def token_documents(table: dict) -> TokenDocuments:
    """``data.factory = "tests.data_jobs:token_documents"``: 200 documents, fixed by data.seq_len."""
    return TokenDocuments(200, table["seq_len"])


def no_documents(table: dict) -> list:
    return []


def not_a_dataset(table: dict) -> int:
    return 3
