"""The local paths of a run that ``etrain submit`` hands to a Ray job, made what the job must be given.

    job_url("runs", "checkpoint.url", "http://127.0.0.1:8265")   # "file:///home/me/proj/runs"
    job_url("runs", "checkpoint.url", "http://head:8265")        # ConfigError: the cluster does not reach it
    job_data_paths(cfg, "proj")                                  # ["data.source=\"data/*.txt\""], as --set

A job runs in a temporary copy of its working directory on the cluster's machines. A local run store or
``checkpoint.url`` there would be inside that copy, lost with it and out of this machine's sight: it is
made an absolute ``file://`` URL against the submitting directory when the cluster reaches it (the
cluster is on this machine, or the path is on a shared filesystem named in ``$ETRAIN_SHARED_PATHS``),
and refused otherwise. Relative data paths are read in the job's working directory: they are given
relative to it. docs/operations.md#submitting-a-run.
"""

from __future__ import annotations

import json
import os

from checkpointing.errors import ConfigError
from checkpointing.names import redact

# Directories mounted at the same path on this machine and every machine of the cluster (an NFS or Lustre
# mount), separated by ":": a local path under one of them is one the cluster reaches (etrain submit).
SHARED_PATHS = "ETRAIN_SHARED_PATHS"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def local_path(url: str) -> str | None:
    """The path on this machine's filesystem that ``url`` names (a plain path or a ``file://`` URL, as fsspec
    reads them: ``file://runs`` is relative), else None."""
    if "::" in url:  # an fsspec chain (simplecache::s3://...): not a plain local path
        return None
    scheme, sep, rest = url.partition("://")
    return url if not sep else rest if scheme == "file" else None


def cluster_is_local(address: str) -> bool:
    """Whether the Ray cluster at ``address`` (a dashboard URL or host:port) is on this machine's loopback."""
    from urllib.parse import urlsplit

    host = urlsplit(address if "://" in address else f"//{address}").hostname or ""
    return host.lower() in LOOPBACK or host.startswith("127.")


def shared_root(path: str) -> str | None:
    """The directory of ``$ETRAIN_SHARED_PATHS`` that holds the absolute ``path``, or None."""
    for root in filter(None, os.environ.get(SHARED_PATHS, "").split(":")):
        root = os.path.abspath(root)
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return root
    return None


def job_url(url: str, field: str, address: str, need: str = "a run store") -> str:
    """``url`` as a job on the cluster at ``address`` must be given it: a local path made an absolute
    ``file://`` URL (resolved against this directory), when the cluster reaches it: the cluster is on this
    machine (``address`` on loopback), or the path is under a directory of ``$ETRAIN_SHARED_PATHS``.
    Other URLs (``s3://``, ``etcd://``, ...) as they are. ConfigError, naming ``field`` and the fix, else."""
    path = local_path(url)
    if path is None:
        return url
    path = os.path.abspath(path)
    if cluster_is_local(address) or shared_root(path):
        return f"file://{path}"
    raise ConfigError(f"a submitted run needs {need} that the cluster and this machine both reach: {field} is "
                      f"{path}, a path on this machine, which the cluster at {redact(address)} does not reach (a "
                      "job runs in a temporary directory on the cluster's machines); use shared storage such as "
                      "s3://bucket/runs" + (", or --store etcd://HOST:2379/etrain" if need == "a run store" else "") +
                      f", or a shared filesystem mounted at the same path on every machine and named in "
                      f"${SHARED_PATHS} (e.g. {SHARED_PATHS}=/nfs)")


def job_relative(path: str, field: str, working_dir: str) -> str:
    """A relative local ``path`` of the run (relative to this directory) as the job finds it: relative to its
    working directory, which is ``working_dir`` uploaded. ConfigError if ``path`` lies outside it."""
    if local_path(path) != path or os.path.isabs(path):
        return path
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(working_dir))
    if rel == ".." or rel.startswith("../"):
        raise ConfigError(f"{field}={path!r} is outside --working-dir {working_dir}, which is all the job gets; "
                          "move it there, or name it by an absolute path that every machine of the cluster has, "
                          "or by a URL such as s3://bucket/data")
    return rel


def job_data_paths(cfg, working_dir: str) -> list[str]:
    """``--set`` overrides that give the job the run's (``cfg``'s) relative local data paths relative to its
    working directory (``working_dir`` uploaded) as this directory names them; ConfigError for one outside it."""
    d, sets = cfg.data, []
    fields = [("eval.source", cfg.eval.source)]
    if d.source not in ("stdlib", "python") and d.format != "hf":  # "hf": a builder's name, not a path
        fields.append(("data.source", d.source))
    if d.tokenizer != "bytes":
        fields.append(("data.tokenizer", d.tokenizer))
    for field, path in fields:
        rel = job_relative(path, field, working_dir) if path else path
        if rel != path:
            sets.append(f"{field}={json.dumps(rel)}")
    files = [job_relative(f, "data.data_files", working_dir) for f in d.data_files]
    if files != list(d.data_files):
        sets.append(f"data.data_files={json.dumps(files)}")
    return sets
