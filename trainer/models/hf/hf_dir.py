"""Hugging Face directories and weight files, validated before anything reads them.

    weights = open_weights("/models/llama", "model.init_from='/models/llama'")   # ConfigError (exit 2)
    weights.entries["model.norm.weight"].shape        # every tensor's dtype and shape, from checked headers
    t = weights.read("model.norm.weight")             # one tensor; ConfigError when it holds nan/inf
    config = read_config("/models/llama", "model.hf_config='/models/llama'")   # config.json as a dict

Everything here is data from someone else, read as data and refused with a ConfigError that
names the file and the fix:

* a safetensors header is at most :data:`MAX_HEADER_BYTES`, lies inside the file, is JSON
  without duplicate keys, and describes the data section exactly: every tensor's dtype is known,
  its shape x dtype size is its byte span, and the spans tile the data section without a gap
  or an overlap (the format's own rule; ``safe_open`` then reads what was checked);
* a weight index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) names
  plain file names in the directory: no absolute path, no ``..``, nothing a symbolic link takes
  outside the directory (a Hugging Face cache snapshot may link into its own repository's
  ``blobs``); every tensor it names is in the file it names;
* ``.bin`` / ``.pt`` weights are read only with ``torch.load(weights_only=True)`` (no code runs;
  a pickle of anything but tensors is refused) and must be a flat ``{name: tensor}``;
* a tensor name in two files is refused (which one would win?), and so is a directory holding
  both ``model.safetensors`` and an index;
* ``config.json`` is a JSON object of bounded size whose well-known fields have their types
  (sizes positive integers, ``model_type`` a string);
* a floating tensor holding nan or inf is refused when it is read, naming it.

What needs a package of the ``[hf]`` extra (transformers, tokenizers, datasets, pyarrow, safetensors) checks
for it first, before anything is written, with :func:`require_hf`: a ConfigError (exit 2) that says
``pip install "etrain[hf]"``, never an ImportError from deep inside a command.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass

import torch

from checkpointing.errors import ConfigError

MAX_HEADER_BYTES = 16 * 2**20  # far above any real model's shard (a few hundred KB at most)
MAX_JSON_BYTES = 16 * 2**20  # config.json, a weight index
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64}
INDEXES = {".safetensors": "model.safetensors.index.json", ".bin": "pytorch_model.bin.index.json"}
CORRUPT = "the file is damaged or not what its name says; download or export it again"
# config.json fields whose type a model build relies on: sizes are integers >= 1
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "head_dim", "n_positions", "n_ctx", "n_embd",
          "n_layer", "n_head")


HF_EXTRA = 'pip install "etrain[hf]"'


def missing_modules(*modules: str) -> list[str]:
    """The ``modules`` that cannot be imported here (found without importing them: transformers reads
    ``HF_HUB_OFFLINE`` when it is imported, which its users set first)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def require_hf(what: str, *modules: str) -> None:
    """ConfigError (exit 2) when one of ``modules`` (default: transformers), packages of etrain's ``[hf]``
    extra, is not installed: ``what`` needs it, and ``pip install "etrain[hf]"`` installs it."""
    missing = missing_modules(*(modules or ("transformers",)))
    if missing:
        raise ConfigError(f"{what} needs {' and '.join(missing)}, of etrain's [hf] extra, which is not installed "
                          f"here; install it: {HF_EXTRA}")


class NonFiniteWeights(ConfigError):
    """A tensor of the weights holds nan or inf (exit 2; under Ray a failure that is not retried)."""


@dataclass(frozen=True)
class TensorEntry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


# --- files and JSON ----------------------------------------------------------------------------


def regular_file(path: str, what: str) -> int:
    """The size of ``path``, a regular file (not a FIFO, a device or a directory); ConfigError otherwise."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{what}: {path} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what}: {path} is not a regular file; give the weights' directory or file")
    return st.st_size


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(data: bytes, what: str):
    """Strict JSON (UTF-8, no duplicate keys, no NaN/Infinity); ConfigError naming ``what``."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{what} is not valid JSON ({str(e)[:120]}); {CORRUPT}") from None


def read_json(path: str, what: str):
    size = regular_file(path, what)
    if size > MAX_JSON_BYTES:
        raise ConfigError(f"{what}: {path} holds {size} bytes, more than the {MAX_JSON_BYTES >> 20} MiB a "
                          f"config or an index can be; {CORRUPT}")
    with open(path, "rb") as f:
        return parse_json(f.read(MAX_JSON_BYTES + 1), f"{what}: {path}")


def read_config(path: str, what: str) -> dict:
    """``config.json`` (``path``: the file, or a directory holding it) as a dict, its well-known fields
    type-checked; ConfigError naming the field otherwise."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        path = confined(path, "config.json", what)
    config = read_json(path, what)
    if not isinstance(config, dict):
        raise ConfigError(f"{what}: {path} holds a JSON {type(config).__name__}, not an object; give a "
                          "transformers config.json")
    for key in _SIZES:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{what}: {path}: {key}={value!r:.40} must be an integer >= 1")
    for key in ("model_type", "torch_dtype", "dtype"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ConfigError(f"{what}: {path}: {key}={config[key]!r:.40} must be a string")
    if config.get("architectures") is not None and not (
            isinstance(config["architectures"], list) and all(isinstance(a, str) for a in config["architectures"])):
        raise ConfigError(f"{what}: {path}: architectures must be a list of class names")
    for key in ("tie_word_embeddings",):
        if key in config and not isinstance(config[key], bool):
            raise ConfigError(f"{what}: {path}: {key}={config[key]!r:.40} must be true or false")
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{what}: {path}: {key} is not a finite number")
    return config


# --- confinement -------------------------------------------------------------------------------


def _root(directory: str) -> str:
    """What files of ``directory`` may resolve into: the directory, or for a Hugging Face cache snapshot
    (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs``) its repository."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    return os.path.dirname(parent) if os.path.basename(parent) == "snapshots" else real


def confined(directory: str, name: str, what: str) -> str:
    """``directory``/``name`` for a plain relative ``name`` that stays inside the directory, symbolic
    links resolved; ConfigError otherwise."""
    bad = (not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\0" in name
           or any(part in ("", ".", "..") for part in name.split("/")))
    if bad:
        raise ConfigError(f"{what}: the file name {name!r:.80} is not a plain name inside {directory}; the index "
                          "is corrupt or hostile: fix it, or download the model again")
    root = _root(directory)
    real = os.path.realpath(os.path.join(directory, name))
    if os.path.commonpath([root, real]) != root:
        raise ConfigError(f"{what}: {name!r} resolves to {real}, outside {directory} (a symbolic link?); "
                          "copy the file into the directory")
    return os.path.join(directory, name)


# --- safetensors -------------------------------------------------------------------------------


def safetensors_header(path: str, what: str) -> dict[str, TensorEntry]:
    """Every tensor of the safetensors file ``path``, its header checked against the file (module
    docstring); ConfigError naming the file and what is wrong."""
    size = regular_file(path, what)
    where = f"{what}: {path}"
    if size < 8:
        raise ConfigError(f"{where} holds {size} bytes, too few for safetensors; {CORRUPT}")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise ConfigError(f"{where}: its header claims {n} bytes, more than the {MAX_HEADER_BYTES >> 20} MiB "
                              f"bound; {CORRUPT}")
        if n > size - 8:
            raise ConfigError(f"{where}: its header claims {n} bytes, but the file holds {size - 8} after the "
                              f"header's length: it is truncated; {CORRUPT}")
        header = parse_json(f.read(n), f"{where}: the safetensors header")
    if not isinstance(header, dict):
        raise ConfigError(f"{where}: the safetensors header is not a JSON object; {CORRUPT}")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ConfigError(f"{where}: __metadata__ must map names to strings; {CORRUPT}")
    data_size = size - 8 - n
    entries, spans = {}, []
    for name, info in header.items():
        dtype, shape, begin, end = _entry(info, f"{where}: tensor {name!r:.80}")
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize:
            raise ConfigError(f"{where}: tensor {name!r:.80} is {list(shape)} of {dtype} ({count * dtype.itemsize} "
                              f"bytes) but spans {end - begin} bytes; {CORRUPT}")
        entries[name] = TensorEntry(path, dtype, shape)
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ConfigError(f"{where}: tensor {name!r:.80} starts at byte {begin} of the data, not {at}: the "
                              f"tensors {'overlap' if begin < at else 'leave a gap'}; {CORRUPT}")
        at = end
    if at != data_size:
        raise ConfigError(f"{where}: the tensors cover {at} bytes of data, the file holds {data_size}; {CORRUPT}")
    return entries


def _entry(info, where: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise ConfigError(f"{where} is not {{dtype, shape, data_offsets}}; {CORRUPT}")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise ConfigError(f"{where}: dtype {info['dtype']!r:.40} is not one etrain reads "
                          f"({', '.join(DTYPES)}); convert the weights")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise ConfigError(f"{where}: shape {shape!r:.80} is not a list of sizes >= 0; {CORRUPT}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(o) for o in offsets) or \
            offsets[0] > offsets[1]:
        raise ConfigError(f"{where}: data_offsets {offsets!r:.80} is not [begin, end] with begin <= end; {CORRUPT}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _natural(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# --- torch.save files --------------------------------------------------------------------------


def torch_weights(path: str, what: str) -> dict[str, torch.Tensor]:
    """A ``.bin`` / ``.pt`` file of ``{name: tensor}``, read with ``torch.load(weights_only=True, mmap=True)``:
    no code runs; anything else is refused."""
    regular_file(path, what)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch.load refuses hostile or damaged input in many ways
        # torch's own text for a refused pickle suggests weights_only=False: name what it refused instead
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
        found = re.search(r"GLOBAL ([\w.]+)", text)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not re.search(
            "weights_only|documentation|trust", ln)] or [type(e).__name__]
        first = f"it calls {found.group(1)}, which is not plain data" if found else lines[0][:160]
        raise ConfigError(f"{what}: {path} is not weights that torch.load(weights_only=True) reads ({first}); "
                          "a pickle holding code is never loaded: convert the weights to safetensors") from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise ConfigError(f"{what}: {path} holds a {type(obj).__name__}, not a flat {{name: tensor}} state dict; "
                          "save the model's state_dict(), or convert it to safetensors")
    return obj


# --- directories -------------------------------------------------------------------------------


class Weights:
    """Validated weights of a directory or a file: ``entries`` (every tensor's file, dtype and shape)
    and :meth:`read` (one tensor, checked finite)."""

    def __init__(self, path: str, what: str, files: list[str], index: dict[str, str] | None = None):
        self.path, self.what = path, what
        self.safetensors = files[0].endswith(".safetensors")
        if self.safetensors:
            require_hf(what, "safetensors")
        self.entries: dict[str, TensorEntry] = {}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        for file in files:
            if self.safetensors:
                found = safetensors_header(file, what)
            else:
                self._loaded[file] = torch_weights(file, what)
                found = {k: TensorEntry(file, t.dtype, tuple(t.shape)) for k, t in self._loaded[file].items()}
            for name, entry in found.items():
                if name in self.entries:
                    raise ConfigError(f"{what}: tensor {name!r:.80} is in both {self.entries[name].file} and "
                                      f"{file}; remove one of the files")
                self.entries[name] = entry
        for name, file in (index or {}).items():
            entry = self.entries.get(name)
            if entry is None or os.path.basename(entry.file) != os.path.basename(file):
                raise ConfigError(f"{what}: the index puts {name!r:.80} in {os.path.basename(file)}, which does not "
                                  "hold it; the index does not match the files: fix it or download the model again")

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``; ConfigError when it holds nan or inf, or its file changed since."""
        entry = self.entries[name]
        if self.safetensors:
            from safetensors import safe_open

            try:
                with safe_open(entry.file, framework="pt") as f:
                    t = f.get_tensor(name)
            except Exception as e:  # noqa: BLE001 - the file changed since its header was checked
                raise ConfigError(f"{self.what}: {entry.file}: {str(e)[:160]}; {CORRUPT}") from None
        else:
            t = self._loaded[entry.file][name]
        if t.dtype != entry.dtype or tuple(t.shape) != entry.shape:
            raise ConfigError(f"{self.what}: {entry.file} changed while it was read; read it again")
        refuse_nonfinite(name, t, f"{self.what}: {os.path.basename(entry.file)}")
        return t

    def check_finite(self) -> None:
        """Read every floating tensor once (one at a time); ConfigError naming the first with nan/inf."""
        for name, entry in self.entries.items():
            if entry.dtype.is_floating_point or entry.dtype.is_complex:
                self.read(name)


def open_weights(path: str, what: str) -> Weights:
    """The weights of a directory (module docstring: which files) or of one ``.safetensors`` / ``.bin`` /
    ``.pt`` file; ConfigError naming the file and the fix."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        if not path.endswith((".safetensors", ".bin", ".pt")):
            raise ConfigError(f"{what}: {path} is not a weights file (.safetensors, .bin or .pt) or a directory")
        return Weights(path, what, [path])
    for ext, index_name in INDEXES.items():
        if os.path.lexists(os.path.join(path, index_name)):
            if ext == ".safetensors" and os.path.lexists(os.path.join(path, "model.safetensors")):
                raise ConfigError(f"{what}: {path} holds both model.safetensors and {index_name}: which are the "
                                  "weights? remove one")
            index = _read_index(path, index_name, ext, what)
            files = sorted({index[n] for n in index})
            if not files:
                raise ConfigError(f"{what}: {index_name} names no tensors; fix it or download the model again")
            return Weights(path, what, files, index)
        names = sorted(n for n in os.listdir(path) if n.endswith(ext) or (ext == ".bin" and n.endswith(".pt")))
        if names:
            return Weights(path, what, [confined(path, n, what) for n in names])
    raise ConfigError(f"{what}: {path} holds no .safetensors weights (nor .bin/.pt that torch.load(weights_only=True) "
                      "reads); give a transformers directory saved with safetensors, or an etrain checkpoint URL")


def _read_index(directory: str, index_name: str, ext: str, what: str) -> dict[str, str]:
    """{tensor name: confined file path} of a weight index."""
    where = f"{what}: {index_name}"
    doc = read_json(confined(directory, index_name, what), what)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{where} has no \"weight_map\" object; fix it or download the model again")
    out = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(ext):
            raise ConfigError(f"{where}: {name!r:.80} maps to {file!r:.80}, not a {ext} file name")
        out[name] = confined(directory, file, where)
    return out


def refuse_nonfinite(name: str, t: torch.Tensor, what: str) -> None:
    """ConfigError naming tensor ``name`` when it holds nan or inf (floating and complex tensors)."""
    if not (t.dtype.is_floating_point or t.dtype.is_complex) or t.numel() == 0:
        return
    values = t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
    # A sum is finite only if every value is (nan and inf propagate); 7x faster than isfinite().all()
    # here. A sum that overflows is looked at value by value.
    if bool(torch.isfinite(values.sum(dtype=torch.float32 if values.dtype in (torch.float16, torch.bfloat16)
                                      else None))):
        return
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return
    bad = int((~finite).sum())
    raise NonFiniteWeights(f"{what}: tensor {name!r:.80} holds {bad} non-finite value{'s' if bad > 1 else ''} (nan or "
                      "inf): the weights are damaged or diverged; use weights from before they diverged")
