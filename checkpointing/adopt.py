"""``etrain ckpt adopt``: make a checkpoint written by stock DCP a committed etrain checkpoint.

    # written by dcp.save(state, storage_writer=FileSystemWriter(".../my-run/checkpoints/step_000000010"))
    etrain ckpt adopt file:///ckpt/my-run/checkpoints/step_000000010 --samples-consumed 80
    # written anywhere else: its files are copied into the run first
    etrain ckpt adopt s3://bucket/exported --into s3://bucket/runs/my-run --step 10 --samples-consumed 80

A stock DCP checkpoint (``FileSystemWriter`` or ``FsspecWriter``, default
settings) has every file etrain needs but no manifest, so no etrain reader
sees it. ``adopt`` checks it the way a load would, then commits it:

1. the DCP metadata (at most ``checkpointing.dcp.reader.MAX_METADATA_BYTES``, checked on the
   listing before a byte is read) is read with the restricted unpickler, as a
   load reads it, one pickle and nothing after it; every item must be
   a ``_StorageInfo`` byte range, without stream transforms, of a bare
   ``*.distcp`` file of the directory, and every chunk the metadata describes
   must have one;
2. every referenced file is read: each tensor item must be the ``torch.save``
   archive of a tensor of the dtype and shape the metadata records, each
   other item plain data (``torch.load(weights_only=True)``); its size and
   crc32c go into the manifest;
3. holding the run's writer lock, ``MANIFEST.json`` is written exclusively
   (a committed step is never adopted again, and a live run is never written
   beside).

The step is the checkpoint's ``step_<N>`` directory, or ``--step`` with
``--into`` (or the step ``--into`` names); where more than one of these is
given they must agree, and the refusal names each. The data cursor is the
user's to say (``--samples-consumed``: how many samples the run has trained
on; etrain resumes its data order there, at ``step x train.global_batch``
for a run that always trained with etrain's batch). The manifest records no config (``config_hash`` empty), the fence's
epoch, and where it came from (``extra.adopted_from``). Anything that is not
an adoptable DCP checkpoint is refused (:class:`AdoptRefused`, exit 2) naming
what is wrong; nothing is written then (files copied by ``--into`` are removed).
"""

from __future__ import annotations

import posixpath
import re
import time

from .dcp.format import CorruptCheckpointError, StorageInfo
from .errors import CheckpointError
from .layout import parse_url
from .manager import CheckpointManager
from .manifest import MANIFEST_NAME, METADATA_NAME, SHARD_RE, FileEntry, Manifest, checksum, parse_step_dir
from .names import check_url, redact
from .storage.base import Storage

_RANK_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


class AdoptRefused(CheckpointError):
    """What was given is not an adoptable DCP checkpoint (or the run cannot take it)."""


def resolve(url: str, *, into: str | None, step: int | None) -> tuple[str, str, int]:
    """(root, run_id, step) of the etrain checkpoint that adopting ``url`` makes."""
    check_url(url, "URL")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise AdoptRefused(f"--step must be an integer >= 0, not {step!r}")
    dir_name = url.rstrip("/").rsplit("/", 1)[-1]
    if into is None:
        root, run_id, url_step = parse_url(url)
        if url_step is None:
            raise AdoptRefused(f"{redact(url)} is not a step directory of a run: adopt one in place at "
                               "<root>/<run_id>/checkpoints/step_<N>, or copy it into a run with "
                               "--into <root>/<run_id> --step N")
        into_step = None
    else:
        check_url(into, "--into")
        root, run_id, into_step = parse_url(into)
        url_step = parse_step_dir(dir_name)
    said = [(s, who) for s, who in ((step, "--step"), (into_step, "--into"), (url_step, f"URL's directory {dir_name}"))
            if s is not None]
    if not said:
        raise AdoptRefused("--into needs the step the checkpoint is of: pass --step N")
    if len({s for s, _ in said}) > 1:
        raise AdoptRefused("the step is ambiguous: " + ", ".join(f"{who} says {s}" for s, who in said)
                           + "; make them agree: pass the step the checkpoint is of")
    return root, run_id, said[0][0]


def adopt(url: str, *, samples_consumed: int, into: str | None = None, step: int | None = None,
          log=print) -> Manifest:
    """Verify the stock DCP checkpoint at ``url`` and commit it as an etrain checkpoint (see the module
    doc). Returns the manifest written; AdoptRefused naming the problem otherwise."""
    if isinstance(samples_consumed, bool) or not isinstance(samples_consumed, int) or samples_consumed < 0:
        raise AdoptRefused(f"--samples-consumed must be an integer >= 0, not {samples_consumed!r}")
    root, run_id, step = resolve(url, into=into, step=step)
    mgr = CheckpointManager(root, run_id)
    rel = mgr.step_rel(step)
    if into is None:
        src, src_rel = mgr.storage, rel
    else:
        src, src_rel = Storage(url), ""
    shown = redact(url)
    listing = src.list_dir(src_rel)
    if not listing:
        raise AdoptRefused(f"{shown} is not a DCP checkpoint: nothing is there")
    if MANIFEST_NAME in listing or mgr.is_committed(step):
        raise AdoptRefused(f"step {step} of run {run_id!r} is committed already ({redact(mgr.url_of(step))}); "
                           "nothing to adopt")
    if METADATA_NAME not in listing:
        raise AdoptRefused(f"{shown} is not a DCP checkpoint: it has no {METADATA_NAME} (dcp.save writes it last; "
                           "was the save finished?)")
    if into is not None and mgr.storage.list_dir(rel):
        raise AdoptRefused(f"{redact(mgr.url_of(step))} holds files of an uncommitted save; remove it or adopt as "
                           "another --step")
    md_blob = _read_metadata(src, src_rel, listing, shown)
    md, names = _check_metadata(md_blob, listing, shown)
    mgr.take_writer_lock(owner="etrain ckpt adopt")
    copied: list[str] = []
    try:
        files = [FileEntry(METADATA_NAME, len(md_blob), checksum(md_blob))]
        for name in names:
            data = src.get(f"{src_rel}/{name}" if src_rel else name)
            _check_items(md, name, data, f"{shown}/{name}")
            files.append(FileEntry(name, len(data), checksum(data)))
            if into is not None:
                copied.append(name)
                mgr.storage.put(f"{rel}/{name}", data, exclusive=True)
        if into is not None:
            copied.append(METADATA_NAME)
            mgr.storage.put(f"{rel}/{METADATA_NAME}", md_blob, exclusive=True)
        ranks = {m.group(1) for m in map(_RANK_RE.match, names) if m}
        cursor = {"step": step, "samples_consumed": samples_consumed}
        manifest = Manifest(run_id=run_id, step=step, epoch=mgr.read_fence(), world_size=max(1, len(ranks)),
                            layout={}, config_hash="", trainer_state=cursor,
                            files=sorted(files, key=lambda f: f.path), created_unix=time.time(),
                            extra={"adopted_from": shown})
        if mgr.is_committed(step):
            raise AdoptRefused(f"step {step} of run {run_id!r} was committed meanwhile; nothing adopted")
        mgr.lock.check()
        try:
            mgr.storage.put(f"{rel}/{MANIFEST_NAME}", manifest.to_json(), exclusive=True)
        except FileExistsError:
            raise AdoptRefused(f"step {step} of run {run_id!r} was committed meanwhile; nothing adopted") from None
        copied = []
    finally:
        for name in copied:  # a refused --into leaves nothing behind
            try:
                mgr.storage.delete_tree(f"{rel}/{name}")
            except Exception as e:
                log(f"could not remove {redact(mgr.url_of(step))}/{name}: {e}")
        mgr.close()
    log(f"adopted {shown} as step {step} of run {run_id!r} at {redact(mgr.url_of(step))}: {len(files)} files, "
        f"{manifest.total_bytes} bytes, data cursor at {samples_consumed} samples; resume with run_id = "
        f"\"{run_id}\" and --resume")
    return manifest


def _read_metadata(src: Storage, src_rel: str, listing: dict[str, int | None], shown: str) -> bytes:
    """The DCP metadata's bytes, its size bounded on the listing before any is read (and after)."""
    from .dcp.reader import check_metadata_size

    where = f"{shown}/{METADATA_NAME}"
    try:
        check_metadata_size(listing[METADATA_NAME] or 0, where)
        blob = src.get(f"{src_rel}/{METADATA_NAME}" if src_rel else METADATA_NAME)
        check_metadata_size(len(blob), where)  # it grew since it was listed
    except CorruptCheckpointError as e:
        raise AdoptRefused(f"{shown} is not a DCP checkpoint: {e}") from None
    return blob


def _check_metadata(blob: bytes, listing: dict[str, int | None], shown: str):
    """The DCP metadata, checked against the directory: every item a ``_StorageInfo`` byte range of a
    present ``*.distcp`` file, every chunk stored. Returns it and the files it references, sorted."""
    from .dcp.reader import check_locations, load_metadata

    where = f"{shown}/{METADATA_NAME}"
    try:
        md = load_metadata(blob, where)
    except CorruptCheckpointError as e:
        raise AdoptRefused(f"{shown} is not a DCP checkpoint: {e}") from None
    names = set()
    for index, loc in md.storage_data.items():
        if not isinstance(loc, StorageInfo):
            raise AdoptRefused(f"{where}: {str(getattr(index, 'fqn', '?'))[:80]!r} is located by a "
                               f"{type(loc).__name__}, not stock DCP's _StorageInfo (an uncommitted etrain save "
                               "of format 2 is not a checkpoint)")
        path = loc.relative_path
        if not isinstance(path, str) or not SHARD_RE.fullmatch(path) or posixpath.basename(path) != path:
            raise AdoptRefused(f"{where}: an item is in {str(path)[:80]!r}, not a *.distcp file of the directory")
        if listing.get(path) is None:
            raise AdoptRefused(f"{where}: an item is in {path}, which is missing from {shown}")
        names.add(path)
    sizes = {n: FileEntry(n, listing[n], "") for n in names}
    try:
        check_locations(md, sizes, where)
    except CorruptCheckpointError as e:
        raise AdoptRefused(str(e)) from None
    return md, sorted(names)


def _check_items(md, name: str, data: bytes, where: str) -> None:
    """Every item of file ``name`` reads back as a load reads it (:func:`checkpointing.dcp.reader.check_items`)."""
    from .dcp.reader import check_items

    try:
        check_items(md, name, data, where)
    except CorruptCheckpointError as e:
        raise AdoptRefused(str(e)) from None
