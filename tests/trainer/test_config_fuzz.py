"""A seeded config fuzz: hostile values for the keys of every section, each loaded the way `etrain run` loads a run
(the trainer's sections, ``[elastic]`` and ``[recovery]``, then the sizes it may take). Each input is accepted or
refused with a ConfigError that names a key it changed, never a traceback, and each takes under 2 s."""

import dataclasses
import math
import random
import signal
import time
import typing

import pytest

from checkpointing.errors import ConfigError
from orchestrator.config import ElasticConfig, RecoveryConfig, check_sizes, elastic_from_raw, recovery_from_raw
from trainer.config import SECTIONS, TOP_LEVEL
from trainer.config.load import config_from_dict

# Every key of every section, from the dataclasses themselves: (section or None for a top-level key, key, type).
OWN = {**SECTIONS, "elastic": ElasticConfig, "recovery": RecoveryConfig}
KEYS = [(section, f.name, typing.get_type_hints(cls)[f.name])
        for section, cls in OWN.items() for f in dataclasses.fields(cls)] + [(None, k, t) for k, t in TOP_LEVEL.items()]

HUGE = [2**62, 2**63 - 1, -2**63, 10**9, 1000000007, 2**40, 10**400]
NUMBERS = [-1, -7, 0, 1, 3, 1e-9, 0.5, 1e300, -1e300, math.nan, math.inf, -math.inf]
TEXT = ["", " ", "\t", "\x00", "a\x00b", "../x", "/tmp/../x", "..", "s3://b/\x00", "file:///x/y", "x" * 5000,
        "tiny", "builtin", "hf", "nvme", "ulysses", "a:b", "0.0.0.0", "é", "[1,2]"]
WRONG = [[], {}, [1, "a"], {"k": "\x00"}, {"\x00": 1}, [["x"]], True, False, None, ("t",), b"bytes"]


def value_for(rng: random.Random, tp) -> object:
    """A value for a field of type ``tp``: mostly hostile, sometimes of the right type and near its range."""
    pool = rng.choice([HUGE, NUMBERS, TEXT, WRONG, "own"])
    if pool != "own":
        return rng.choice(pool)
    if typing.get_origin(tp) is typing.Literal:
        return rng.choice(typing.get_args(tp))
    if tp is bool:
        return rng.random() < 0.5
    if tp is int:
        return rng.choice([rng.randint(-3, 70), 2 ** rng.randint(0, 70)])
    if tp is float:
        return rng.choice([rng.uniform(-2, 100), 10.0 ** rng.randint(-12, 12)])
    if typing.get_origin(tp) is list:
        return [rng.choice(TEXT) for _ in range(rng.randint(0, 3))]
    if tp is dict:
        return {rng.choice(["k", "x", "delay_s", "fail_rate"]): rng.choice(HUGE + NUMBERS + TEXT)}
    return rng.choice(TEXT)


def fuzz_input(seed: int) -> tuple[dict, list[str]]:
    """A run document with one to three keys set to fuzzed values, and those keys' dotted names."""
    rng = random.Random(seed)
    raw: dict = {"elastic": {"workers": 2}}
    changed = []
    for section, key, tp in rng.sample(KEYS, rng.randint(1, 3)):
        value = value_for(rng, tp)
        if section is None:
            raw[key] = value
            changed.append(key)
        else:
            raw.setdefault(section, {})[key] = value
            changed.append(f"{section}.{key}")
    return raw, changed


def load_like_a_run(raw: dict) -> None:
    """What `etrain run` does with a run document before anything starts (orchestrator.driver.run.parse_config and
    check_sizes), minus the preflight that builds the model."""
    cfg = config_from_dict(raw)
    ecfg = elastic_from_raw(raw)
    recovery_from_raw(raw)
    check_sizes(cfg, ecfg)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang


def check_one(seed: int) -> None:
    raw, changed = fuzz_input(seed)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)  # a hang fails this input instead of the whole run
    start = time.monotonic()
    try:
        load_like_a_run(raw)
    except ConfigError as e:
        message = str(e)
        assert any(key in message for key in changed), f"seed {seed}: {changed} not named in: {message}"
    except Hang:
        pytest.fail(f"seed {seed}: loading {changed} did not finish in 10 s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - start < 2.0, f"seed {seed}: loading {changed} took {time.monotonic() - start:.1f} s"


def test_the_key_list_covers_every_section():
    sections = {s for s, _, _ in KEYS}
    assert sections == set(SECTIONS) | {"elastic", "recovery", None}
    assert ("parallel", "offload_dir", str) in KEYS and ("elastic", "max_workers", int) in KEYS
    assert len(KEYS) > 100


def test_fuzzed_values_are_loaded_or_refused_naming_their_key():
    load_like_a_run({"elastic": {"workers": 2}})  # the imports the sizes need, outside any input's time
    for seed in range(30):
        check_one(seed)


@pytest.mark.slow
def test_fuzzed_values_are_loaded_or_refused_naming_their_key_at_length():
    load_like_a_run({"elastic": {"workers": 2}})
    for seed in range(1000, 1200):
        check_one(seed)
