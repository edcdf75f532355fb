"""examples/python_api.py runs without a warning in its normal flow: the run it resumes in this process has
the config its checkpoints were written with, so the trainer has no config change to warn of (the check
`Trainer.load_checkpoint` makes). Fast: the example's calls are recorded, nothing is trained."""

from __future__ import annotations

import importlib.util
import os

import pytest

import etrain
from checkpointing.manifest import config_changes
from etrain.api import config_document
from trainer.config.load import config_from_dict

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "python_api.py")


class Stop(Exception):
    pass


def test_the_example_resumes_with_the_config_it_trained(monkeypatch):
    spec = importlib.util.spec_from_file_location("python_api_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    calls = []

    def train(config, overrides=(), *, resume=False, **_):
        calls.append((config_from_dict(config_document(config, overrides)).to_dict(), resume))
        return etrain.TrainResult(20, 5.0, 4.0, 4.1, 1.0)

    def submit(*a, **k):
        raise Stop  # the Ray part is not this test's

    monkeypatch.setattr(etrain, "train", train)
    monkeypatch.setattr(etrain, "submit", submit)
    with pytest.raises(Stop):
        example.main()
    (first, _), *resumed = calls
    assert resumed and all(again for _, again in resumed)
    for doc, _ in resumed:  # what load_checkpoint compares, and warns of when it differs
        assert config_changes(first, doc, ("model", "data", "train"),
                              ignore=("train.log_every", "train.skip_nonfinite_steps")) == []
