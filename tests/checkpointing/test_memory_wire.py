"""The memory tier's wire format (``MemorySnapshot.to_bytes`` / ``from_bytes``) under hostile input: every
malformed blob is refused with the tier's own error (``CorruptCheckpointError``), never another exception,
and nothing that differs from what was sent is ever accepted as it.

A seeded fuzz draws several hundred mutations of a real snapshot's bytes: bit flips anywhere, truncation,
extension, header lengths, JSON fields (with the header's checksum recomputed, as a hostile sender would),
file and metadata sizes, trainer state. One process, no process group: seconds.
"""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

from checkpointing.dcp.format import CorruptCheckpointError
from checkpointing.manifest import checksum
from checkpointing.recovery.snapshot import MAGIC, MemorySnapshot
from checkpointing.recovery.tier import MemoryTier

FUZZ_SEED = 2026
FUZZ_MUTATIONS = 400


@pytest.fixture(scope="module")
def blob() -> bytes:
    g = torch.Generator().manual_seed(3)
    state = {"model": {"w": torch.randn(17, 5, generator=g), "b": torch.randn(4, generator=g)},
             "optim": {"w": {"exp_avg": torch.randn(17, 5, generator=g), "step": torch.tensor(2.0)}}}
    tier = MemoryTier(0, 1)
    try:
        res = tier.take(7, state, {"step": 7, "samples_consumed": 84, "epoch": 0, "corpus_digest": "abc",
                                   "history_row": [7, 2.5, 1, 84, 1.7e9, 0.1, 900.0, None]})
        assert res.ok, res.reason
        return res.snapshot.to_bytes()
    finally:
        tier.close()


def split(blob: bytes) -> tuple[dict, bytes, int]:
    """(header, the bytes after it, the frame's size after MAGIC) of a ``to_bytes`` blob."""
    (n,) = struct.unpack_from("<Q", blob, len(MAGIC))
    for frame in (12, 8):  # length and crc32c of the header; (the first format: its length alone)
        head = blob[len(MAGIC) + frame: len(MAGIC) + frame + n]
        if head[:1] == b"{":
            return json.loads(head), blob[len(MAGIC) + frame + n:], frame
    raise AssertionError("not a snapshot blob")


def join(header: dict | bytes, body: bytes, frame: int) -> bytes:
    """A blob of ``header`` and ``body`` with a consistent frame (length, and crc32c where it has one)."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    crc = struct.pack("<I", int(checksum(head), 16)) if frame == 12 else b""
    return MAGIC + struct.pack("<Q", len(head)) + crc + head + body


def refused(data: bytes) -> str:
    """The tier's error for ``data``; fails the test on any other outcome."""
    try:
        MemorySnapshot.from_bytes(data, "the copy")
    except CorruptCheckpointError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - the point: no other error type may escape
        pytest.fail(f"{type(e).__name__} escaped from_bytes: {str(e)[:200]}")
    pytest.fail("a malformed snapshot was accepted")


def test_the_blob_round_trips(blob):
    snap = MemorySnapshot.from_bytes(blob)
    assert snap.to_bytes() == blob and snap.trainer_state["samples_consumed"] == 84


def test_two_malformed_headers_raise_the_tiers_error_not_another(blob):
    header, body, frame = split(blob)
    # metadata without its checksum: an IndexError escaped
    assert "metadata" in refused(join({**header, "metadata": header["metadata"][:1]}, body, frame))
    # a header nested deeper than the JSON parser recurses: a RecursionError escaped
    assert "invalid header" in refused(join(b"[" * 100_000 + b"]" * 100_000, body, frame))


def test_a_flipped_bit_in_the_header_is_refused_not_read_as_another_state(blob):
    at = blob.index(b'"samples_consumed": 84') + len('"samples_consumed": 8')
    flipped = bytearray(blob)
    flipped[at] ^= 0x01  # 84 -> 85: valid JSON, another data cursor
    assert "checksum" in refused(bytes(flipped))


@pytest.mark.parametrize("state, why", [
    ({"step": 7, "samples_consumed": -1}, "samples_consumed"),
    ({"step": 7, "samples_consumed": "84"}, "samples_consumed"),
    ({"step": 7, "samples_consumed": 84.5}, "samples_consumed"),
    ({"step": 6, "samples_consumed": 84}, "step is 6"),
    ({"step": 7, "samples_consumed": 84, "corpus_digest": 5}, "corpus_digest"),
    ({"step": 7, "samples_consumed": 84, "history_row": "x" * 10}, "history_row"),
    ({"step": 7, "samples_consumed": 84, "note": float("nan")}, "note"),
    ({"step": 7, "samples_consumed": 84, "nested": {"a": 1}}, "nested"),
    ([1, 2], "not a table"),
])
def test_the_trainer_state_is_checked_against_its_schema(blob, state, why):
    header, body, frame = split(blob)
    assert why in refused(join({**header, "trainer_state": state}, body, frame))


# --- the seeded fuzz ---------------------------------------------------------------------------------

BAD_VALUES = [None, "x", -1, 1 << 70, 1.5, [], {}, [[1]], True, [None, None]]
BAD_CELLS = [  # per column of a table row: path, size, crc32c, owner
    ["../../etc/passwd.distcp", None, "", ".metadata", "a/b.distcp", 5],
    [-1, "x", None, 1.5, True],
    ["zzzzzzzz", 5, "ABCDEF01", "", "00000000"],
    [-1, 5, "0", None, True],
]
BAD_STATE = [("step", -1), ("step", 8), ("step", "7"), ("step", None), ("samples_consumed", -5),
             ("samples_consumed", 1.5), ("samples_consumed", True), ("epoch", "x"), ("corpus_digest", 5),
             ("corpus_digest", "y" * 5000), ("history_row", "x"), ("history_row", [[1]]), ("history_row", [True]),
             ("history_row", list(range(17))), ("other", float("inf")), ("other", [1]), ("other", {"a": 1})]
KINDS = ["flip", "truncate", "extend", "length", "field", "missing", "extra", "sizes", "table", "state", "splice"]


def mutate(blob: bytes, kind: str, rng: random.Random) -> bytes:
    """``blob`` changed by one mutation of ``kind``: a blob ``from_bytes`` must refuse (or ``blob`` itself
    where the draw changed nothing)."""
    header, body, frame = split(blob)
    b = bytearray(blob)
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        b = b[: rng.randrange(len(b))]
    elif kind == "extend":
        b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == "length":
        (n,) = struct.unpack_from("<Q", blob, len(MAGIC))
        struct.pack_into("<Q", b, len(MAGIC), rng.choice([0, 1, n - 1, n + 1, 2 * n, len(blob), 1 << 40,
                                                          (1 << 64) - 1, rng.randrange(n)]))
    elif kind == "field":  # a wrong type or range, with a consistent frame (as a hostile sender would make)
        key, value = rng.choice(sorted(header)), rng.choice(BAD_VALUES)
        if (key == "agreed" and isinstance(value, bool)) or (key == "trainer_state" and value == {}):
            return blob  # valid: a snapshot that says it is not agreed, one without trainer state
        b = join({**header, key: value}, body, frame)
    elif kind == "missing":
        key = rng.choice(sorted(header))
        b = join({k: v for k, v in header.items() if k != key}, body, frame)
    elif kind == "extra":
        b = join({**header, rng.choice(["extra", "files", "pickle"]): rng.choice(BAD_VALUES)}, body, frame)
    elif kind in ("sizes", "table", "state"):
        h = json.loads(json.dumps(header))
        if kind == "sizes":  # the metadata's or a file's size off
            delta = rng.choice([-7, -1, 1, 3, 1 << 20])
            cell = h["metadata"] if rng.random() < 0.5 else rng.choice(h["table"])
            i = 0 if cell is h["metadata"] else 1
            cell[i] = max(0, cell[i] + delta)
        elif kind == "table":
            col = rng.randrange(4)
            rng.choice(h["table"])[col] = rng.choice(BAD_CELLS[col])
            if rng.random() < 0.3:
                h["table"].append(list(h["table"][0]))  # a duplicate row
        else:
            key, value = rng.choice(BAD_STATE)
            h["trainer_state"][key] = value
        b = join(h, body, frame)
    elif kind == "splice":  # a valid header over a body a byte short
        b = join(header, body[: len(body) // 2] + body[len(body) // 2 + 1:], frame)
    return bytes(b)


def test_seeded_fuzz_of_the_wire_format_never_escapes_and_never_accepts_a_change(blob):
    rng = random.Random(FUZZ_SEED)
    original = MemorySnapshot.from_bytes(blob).to_bytes()
    seen: dict[str, int] = {}
    escaped, accepted = [], []
    while sum(seen.values()) < FUZZ_MUTATIONS:
        kind = rng.choice(KINDS)
        data = mutate(blob, kind, rng)
        if data == blob:
            continue
        seen[kind] = seen.get(kind, 0) + 1
        try:
            snap = MemorySnapshot.from_bytes(data, "the copy")
        except CorruptCheckpointError:
            continue
        except Exception as e:  # noqa: BLE001 - recorded: no other error type may escape
            escaped.append((kind, f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        if snap.to_bytes() != original:  # accepted: only a blob that reads back as exactly what was sent
            accepted.append(kind)
    assert len(seen) == len(KINDS), seen
    assert not escaped, escaped[:5]
    assert not accepted, accepted[:5]
