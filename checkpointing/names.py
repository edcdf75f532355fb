"""Names and URLs that reach storage: run ids, and URLs without credentials in them; and where etrain
keeps per-user state.

    validate_run_id("tiny")                      # returns it; ConfigError for "..", "a/b", 300 chars, ...
    check_url("s3://bucket/runs", "checkpoint.url")   # ConfigError if a secret sits in the URL
    redact("s3://k:pw@bucket/x?token=t")         # "s3://***@bucket/x?***": how every message shows a URL
    redact_text(str(error), url)                 # every URL in a message redacted, and url's secrets alone too
    redact_config(cfg.to_dict())                 # a JSON-clean copy, any URL with a secret redacted
    etrain_home()                                # $ETRAIN_HOME, else ~/.etrain

A run id becomes a path component of every object a run writes
(``<root>/<run_id>/...``), in the checkpoint storage and in the run stores,
so it is checked wherever one enters: the config, the CLI, the checkpoint
manager and both run stores. URLs are logged and stored (the run store keeps
the spec), so a credential inside one would leak: such URLs are refused, and
the message never repeats the secret.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .errors import ConfigError

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_RUN_ID_RE = re.compile(RUN_ID_PATTERN)

# Query parameters that carry a secret (presigned URLs, SAS tokens, API keys).
_SECRET_QUERY = re.compile(r"(key|token|secret|signature|sig|password|passwd|credential|auth)", re.IGNORECASE)

CREDENTIAL_CHAINS = ("use the standard credential chains instead: for S3 the AWS_ACCESS_KEY_ID / "
                     "AWS_SECRET_ACCESS_KEY environment variables, ~/.aws/credentials or an instance role; "
                     "for GCS GOOGLE_APPLICATION_CREDENTIALS")


def validate_run_id(run_id: object, field: str = "run_id") -> str:
    """``run_id`` if it is a safe name (``RUN_ID_PATTERN``, not ``.`` or ``..``); ConfigError otherwise."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id) or run_id in (".", ".."):
        if isinstance(run_id, str) and ("@" in run_id or "?" in run_id):  # cut from a URL: its secrets may be in it
            run_id = redact(f"//{run_id}").removeprefix("//")
        shown = repr(run_id) if not isinstance(run_id, str) or len(run_id) <= 40 else repr(run_id[:40] + "...")
        raise ConfigError(
            f"{field}={shown} is not a valid run id: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit (and not '.' or '..'), e.g. run_id = \"llama-7b-v2\"")
    return run_id


def has_credentials(url: str) -> bool:
    """Whether ``url`` carries a user:password@ part or a query parameter that looks like a secret."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    if "@" in parts.netloc and (parts.password is not None or parts.username):
        return True
    return any(_SECRET_QUERY.search(k) for k, _ in parse_qsl(parts.query, keep_blank_values=True))


def redact(url: str) -> str:
    """``url`` with any user:password@ part and the whole query replaced by ``***`` (for messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=netloc, query="***" if parts.query else "").geturl()


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_text(text: str, *urls: str) -> str:
    """``text`` (an exception's message, a log line) with every URL in it :func:`redact`-ed, and each secret
    part of the ``urls`` it is about (user:password, the query) replaced wherever it appears alone, as a
    library's message may repeat it."""
    for url in urls:
        if not url:
            continue
        text = text.replace(url, redact(url))
        try:
            parts = urlsplit(url)
        except ValueError:
            continue
        for secret in (parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else "", parts.query,
                       parts.password or ""):
            if secret:
                text = text.replace(secret, "***")
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def check_url(url: str, field: str, fix: str = CREDENTIAL_CHAINS) -> str:
    """``url`` unless it holds credentials (ConfigError naming ``field`` and ``fix``, without the secret)."""
    if url and has_credentials(url):
        raise ConfigError(f"{field}={redact(url)} carries credentials in the URL; remove them and {fix}")
    return url


def redact_config(config: dict[str, Any]) -> dict[str, Any]:
    """A JSON-clean copy of a run config (tuples become lists, anything else not JSON its ``str``) in
    which every string that is a URL carrying credentials is :func:`redact`-ed: what a manifest
    may record. (etrain refuses such URLs in its config anyway; this is the second lock.)"""

    def clean(v):
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, str):
            return redact(v) if "://" in v and has_credentials(v) else v
        if v is None or isinstance(v, (bool, int, float)):
            return v
        return clean(str(v))

    return clean(config)


def etrain_home() -> str:
    """$ETRAIN_HOME, else ~/.etrain: where etrain keeps per-user state (the run registry, detached runs' logs,
    Prometheus targets, the planner's calibration)."""
    return os.environ.get("ETRAIN_HOME") or os.path.join(os.path.expanduser("~"), ".etrain")
