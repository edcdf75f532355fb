"""Where documents come from: files of text, JSON lines, Parquet, a ``datasets`` spec, or a Python factory.

    fmt = resolve_format(cfg)                        # "text" | "jsonl" | "parquet" | "hf" | "tokens" | "python"
    inputs = list_inputs(cfg, fmt)                   # names, sizes and stamps: the token cache's key
    for text, ends_doc in iter_pieces(cfg, fmt, inputs, as_bytes=False): ...

Everything is read streaming: text files in blocks, JSON lines one line at a
time, Parquet one record batch at a time (pyarrow), a ``datasets`` spec with
``streaming=True``; nothing holds a whole corpus. A text file is one document;
a JSON line, a Parquet row or a dataset row is one (its ``data.text_field``).
Listing is cheap (names, sizes, modification stamps, no reads) because every
rank does it at every start to find its cache.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob as globmod
import json
import os
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fsspec
import numpy as np

from checkpointing.errors import ConfigError

from ..config import DataConfig

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib"}
_BLOCK = 256 << 10  # text is read (and encoded) in pieces of about this many bytes
_EXT = {".bin": "tokens", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")


@dataclass(frozen=True)
class InputFile:
    path: str
    size: int
    stamp: str  # modification time in ns (local) or the store's mtime / ETag: with the size, the quick check


@dataclass(frozen=True)
class Inputs:
    fs: fsspec.AbstractFileSystem | None  # None: local paths read with open()
    files: tuple[InputFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files, without tests and installed packages, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(out)


def expand(source: str, field: str = "data.source") -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """Files named by an fsspec URL, glob or directory, sorted."""
    if "://" not in source and not globmod.has_magic(source) and not os.path.exists(source):
        raise ConfigError(f"{field}={source!r} does not exist")
    fs, _, paths = fsspec.get_fs_token_paths(source)
    if not globmod.has_magic(source) and len(paths) == 1 and fs.isdir(paths[0]):
        paths = fs.find(paths[0])
    return fs, sorted(p for p in paths if fs.isfile(p))


def _base(path: str) -> str:
    name = path.lower()
    for ext in _COMPRESSED:
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def resolve_format(cfg: DataConfig, source: str | None = None) -> str:
    """``data.format``, with ``auto`` decided from the source's name (or a directory's files)."""
    source = cfg.source if source is None else source
    if source == "python":
        return "python"
    if cfg.format != "auto":
        return cfg.format
    if source == "stdlib":
        return "text"
    exts = {os.path.splitext(_base(source))[1]}
    if not globmod.has_magic(source) and "://" not in source and os.path.isdir(source):
        exts = {os.path.splitext(_base(p))[1] for _, _, names in os.walk(source) for p in names}
    kinds = {_EXT.get(e, "text") for e in exts}
    if len(kinds) > 1:
        raise ConfigError(f"data.source={source!r} holds files of several formats ({', '.join(sorted(exts))}); "
                          f"set data.format to one of {', '.join(sorted(kinds))}, or point data.source at a glob")
    return kinds.pop() if kinds else "text"


def _stamp(info: dict) -> str:
    for key in ("mtime", "LastModified", "last_modified", "updated", "ETag", "etag", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def _local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def list_inputs(cfg: DataConfig, fmt: str, source: str | None = None) -> Inputs:
    """The files a text-like source reads, with sizes and stamps (ConfigError when there are none)."""
    source = cfg.source if source is None else source
    if source == "stdlib":
        paths, fs = stdlib_files(), None
    elif fmt == "hf":
        fs, paths = None, []
        for pattern in cfg.data_files:
            fs_i, found = expand(pattern, "data.data_files")
            if not _local(fs_i):
                raise ConfigError(f"data.data_files={pattern!r}: format \"hf\" reads local files only; copy them "
                                  "here, or use format \"jsonl\" / \"parquet\" with data.source for remote files")
            if not found:
                raise ConfigError(f"data.data_files={pattern!r} matches no files")
            paths += found
        paths = sorted(set(paths))
    else:
        fs, paths = expand(source)
        if _local(fs):
            fs = None
    if not paths:
        raise ConfigError(f"data.source={source!r} matches no files; point it at files, a directory or a glob")
    files = []
    for p in paths:
        if fs is None:
            st = os.stat(p)
            files.append(InputFile(p, st.st_size, str(st.st_mtime_ns)))
        else:
            info = fs.info(p)
            files.append(InputFile(p, int(info.get("size") or 0), _stamp(info)))
    return Inputs(fs, tuple(files))


def _open(inputs: Inputs, path: str, mode: str = "rb"):
    if inputs.fs is None:
        if _base(path) != path.lower():
            return fsspec.open(path, mode, compression="infer").open()
        return open(path, mode)
    return inputs.fs.open(path, mode, compression="infer")


# A piece is (text, ends_document); a document is one or more pieces. ``Progress`` gets (input bytes
# done, input bytes in all) now and then.
Progress = Callable[[int, int], None]


def _text_pieces(f, as_bytes: bool) -> Iterator[tuple[str | bytes, bool]]:
    """One file as pieces of about ``_BLOCK`` bytes, cut after a newline where there is one (a file
    shorter than that is one piece); an empty file is no document."""
    decoder = None if as_bytes else codecs.getincrementaldecoder("utf-8")("replace")
    carry, block = b"", f.read(_BLOCK)
    while block:
        following = f.read(_BLOCK)
        data = carry + block
        if not following:
            yield (data if as_bytes else decoder.decode(data, final=True)), True
            return
        cut = data.rfind(b"\n") + 1 or len(data)
        carry = data[cut:]
        yield (data[:cut] if as_bytes else decoder.decode(data[:cut])), False
        block = following


def _record_text(rec, field: str, where: str) -> str:
    if not isinstance(rec, dict):
        raise ConfigError(f"{where} is not a JSON object; each line must be a record with a {field!r} field")
    if field not in rec:
        keys = ", ".join(sorted(map(str, rec))[:10]) or "none"
        raise ConfigError(f"{where} has no field {field!r} (its fields: {keys}); set data.text_field to the field "
                          "that holds the text")
    text = rec[field]
    if not isinstance(text, str):
        raise ConfigError(f"{where}: field {field!r} is {type(text).__name__}, not text; set data.text_field to a "
                          "text field")
    return text


def _jsonl_docs(f, path: str, field: str) -> Iterator[str]:
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path} line {n} is not JSON ({e}); data.format=\"jsonl\" wants one record per "
                              "line") from None
        yield _record_text(rec, field, f"{path} line {n}")


def _parquet_docs(f, path: str, field: str) -> Iterator[str]:
    from ..models.hf.hf_dir import require_hf

    require_hf('data.format="parquet"', "pyarrow")
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    names = pf.schema_arrow.names
    if field not in names:
        raise ConfigError(f"{path} has no column {field!r} (its columns: {', '.join(names[:10])}); set "
                          "data.text_field to the column that holds the text")
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        col = batch.column(0)
        if not (col.type == "string" or col.type == "large_string"):
            raise ConfigError(f"{path}: column {field!r} is {col.type}, not text; set data.text_field to a text "
                              "column")
        yield from (s for s in col.to_pylist() if s is not None)


def _hf_docs(cfg: DataConfig, inputs: Inputs, cache_dir: str) -> Iterator[str]:
    from ..models.hf.hf_dir import require_hf

    require_hf('data.format="hf"', "datasets")
    import datasets

    try:
        ds = datasets.load_dataset(cfg.source, data_files=[f.path for f in inputs.files], split="train",
                                   streaming=True, cache_dir=os.path.join(cache_dir, "hf-datasets"))
        first = True
        for batch in ds.iter(batch_size=1000):
            if cfg.text_field not in batch:
                cols = ", ".join(sorted(batch)[:10])
                raise ConfigError(f"the {cfg.source!r} dataset has no column {cfg.text_field!r} (its columns: "
                                  f"{cols}); set data.text_field to the column that holds the text")
            col = batch[cfg.text_field]
            if first and col and not isinstance(col[0], str):
                raise ConfigError(f"the {cfg.source!r} dataset's column {cfg.text_field!r} holds "
                                  f"{type(col[0]).__name__}, not text; set data.text_field to a text column")
            first = False
            yield from (s for s in col if s is not None)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many kinds for a bad builder or file
        raise ConfigError(f"data.source={cfg.source!r} with data.data_files: datasets cannot read them "
                          f"({_error_phrase(e)}); data.source names a builder such as \"json\", \"parquet\", "
                          "\"csv\" or \"text\", and every file of data.data_files must hold that format: replace "
                          "or remove a damaged file") from None


def _file_docs(inputs: Inputs, path: str, fmt: str, cfg: DataConfig,
               as_bytes: bool) -> Iterator[tuple[str | bytes, bool]]:
    """The pieces of one file; a file that cannot be opened, decompressed or parsed as ``fmt`` is a
    ConfigError naming it (pyarrow, gzip, zstd and the rest each raise their own kinds)."""
    try:
        with _open(inputs, path) as fh:
            if fmt == "text":
                yield from _text_pieces(fh, as_bytes)
            elif fmt == "jsonl":
                yield from ((t, True) for t in _jsonl_docs(fh, path, cfg.text_field))
            else:
                yield from ((t, True) for t in _parquet_docs(fh, path, cfg.text_field))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or mislabelled input file, whatever its reader raises
        raise ConfigError(f"data.source: {path} cannot be read as {fmt} ({_error_phrase(e)}); replace or remove "
                          "the file, or set data.format to what it holds") from None


def iter_pieces(cfg: DataConfig, fmt: str, inputs: Inputs, *, as_bytes: bool, cache_dir: str,
                progress: Progress | None = None) -> Iterator[tuple[str | bytes, bool]]:
    """Every document of the source in order, as pieces, up to ``data.max_bytes`` of text."""
    budget = cfg.max_bytes or -1
    total, done = inputs.total_bytes, 0

    def clip(text: str | bytes) -> tuple[str | bytes, bool]:
        """The text within the budget, and whether the budget is spent."""
        nonlocal budget
        if budget < 0:
            return text, False
        raw = text if isinstance(text, bytes) else text.encode("utf-8")
        if len(raw) < budget:
            budget -= len(raw)
            return text, False
        raw, budget = raw[:budget], 0
        return (raw if isinstance(text, bytes) else raw.decode("utf-8", "ignore")), True

    if fmt == "hf":
        for n, text in enumerate(_hf_docs(cfg, inputs, cache_dir), 1):
            text, spent = clip(text)
            done += len(text)
            yield (text.encode("utf-8") if as_bytes else text), True
            if progress is not None and n % 1024 == 0:
                progress(min(done, total), total)
            if spent:
                break
        if progress is not None:
            progress(total, total)
        return
    if fmt not in ("text", "jsonl", "parquet"):
        raise ConfigError(f"data.format={fmt!r} is not a text format")
    for f in inputs.files:
        for text, end in _file_docs(inputs, f.path, fmt, cfg, as_bytes):
            text, spent = clip(text)
            if as_bytes and isinstance(text, str):
                text = text.encode("utf-8")
            yield text, end or spent
            if spent:
                return
        done += f.size
        if progress is not None:
            progress(done, total)


def _error_phrase(e: BaseException, user_code: bool = False) -> str:
    """An exception as one phrase: its type and message, and with ``user_code`` the line that raised it."""
    tb = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__] if user_code else []
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def python_dataset(cfg: DataConfig):
    """``data.factory``(the [data] table as a dict): a map-style dataset of token ids, and its length.

    Anything wrong with the factory, its module or what it returns is a ConfigError naming data.factory."""
    from ..models import resolve_ref  # torch: only for a Python dataset

    ref = cfg.factory
    if ref.count(":") != 1 or not all(ref.split(":")):
        raise ConfigError(f"data.factory={ref!r} must look like \"package.module:function\"")
    factory = resolve_ref(ref, "data.factory")
    try:
        ds = factory(dataclasses.asdict(cfg))
    except Exception as e:  # noqa: BLE001 - the user's code: whatever it raises, the field to fix is this one
        raise ConfigError(f"data.factory={ref!r} raised {_error_phrase(e, user_code=True)}; fix the factory (it "
                          "gets the [data] table as a dict and returns a map-style dataset of token ids)") from None
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(ds, m)]
    if missing:
        raise ConfigError(f"data.factory={ref!r} returned a {type(ds).__name__} without "
                          f"{' and '.join(missing)}; return a map-style dataset (__len__, __getitem__(i) -> token ids)")
    try:
        n = len(ds)
    except Exception as e:  # noqa: BLE001 - a __len__ that raises or returns no count
        raise ConfigError(f"data.factory={ref!r}: len() of its {type(ds).__name__} fails ({_error_phrase(e)}); "
                          "__len__ must return the number of documents, an int >= 0") from None
    return ds, n


def factory_item(ds, i: int, limit: int, factory: str):
    """Item ``i`` of a factory's dataset as a 1-D array of ids below ``limit`` (ConfigError naming data.factory)."""
    try:
        item = ds[i]
        if type(item).__module__.startswith("torch") and hasattr(item, "numpy"):
            item = item.detach().cpu().numpy()
        arr = np.asarray(item)
    except Exception as e:  # noqa: BLE001 - the user's __getitem__, or an item numpy cannot make an array of
        raise ConfigError(f"data.factory={factory!r}: item {i} cannot be read as token ids "
                          f"({_error_phrase(e, user_code=True)}); __getitem__(i) must return a 1-D sequence of "
                          "ints for every i below len()") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ConfigError(f"data.factory={factory!r}: item {i} is not a 1-D sequence of integer token ids "
                          f"(got shape {arr.shape}, dtype {arr.dtype})")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        raise ConfigError(f"data.factory={factory!r}: item {i} holds token id {int(arr.max())} or "
                          f"{int(arr.min())}, outside [0, {limit}); check data.tokenizer and the dataset")
    return arr
