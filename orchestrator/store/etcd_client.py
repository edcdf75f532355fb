"""The etcd client of the run store: its credentials and TLS files from the environment, its errors made plain.

    client = connect("10.0.0.5", 2379, timeout_s=5)     # etcd3gw client; user/password and TLS from the env
    client = connect("10.0.0.5", 2379, 5, tls=True)    # an etcds:// store: HTTPS, whatever the env says
    value = call("etcd://10.0.0.5:2379/etrain", lambda: client.get(key))   # StoreUnavailable on any failure

Credentials never appear in a store URL (``etcd://user:pw@...`` is refused where URLs are checked); they
come from the environment of every process that opens the store (the CLI, the driver, the controller and
the workers, which check the epoch fence at each commit):

| variable | what |
|---|---|
| ``ETRAIN_ETCD_USER``, ``ETRAIN_ETCD_PASSWORD`` | a user of etcd's authentication; both or neither |
| ``ETRAIN_ETCD_TLS=1`` | talk HTTPS (as an ``etcds://`` URL does), checked against the system's trust store |
| ``ETRAIN_ETCD_CA`` | the CA bundle that signed the server's certificate: talk HTTPS and check it against this |
| ``ETRAIN_ETCD_CERT``, ``ETRAIN_ETCD_KEY`` | a client certificate and its key (etcd's ``--client-cert-auth``) |
| ``ETRAIN_ETCD_INSECURE=1`` | let a user and password go over plain HTTP (a warning each time a process connects) |

HTTPS is on for an ``etcds://`` URL, or with any of ``ETRAIN_ETCD_TLS``, ``ETRAIN_ETCD_CA`` or a client
certificate. Without ``ETRAIN_ETCD_CA`` the server's certificate is checked against the system's trust
store (OpenSSL's default bundle, which ``$SSL_CERT_FILE`` overrides). A user and password over plain HTTP
would cross the network in the clear: they are refused (:class:`ConfigError`, exit 2) unless
``ETRAIN_ETCD_INSECURE=1`` says that is meant (etcd on loopback, or behind a tunnel).

With a user, the client asks etcd for a token (``/v3/auth/authenticate``) and sends it with every
request, asking for a new one when etcd says it expired. The password is sent only there, and is never
written to a message.
"""

from __future__ import annotations

import logging
import os
import ssl

from checkpointing.errors import ConfigError
from checkpointing.names import redact

from .documents import StoreUnavailable

log = logging.getLogger("etrain")

USER, PASSWORD, CA, CERT, KEY = ("ETRAIN_ETCD_USER", "ETRAIN_ETCD_PASSWORD", "ETRAIN_ETCD_CA", "ETRAIN_ETCD_CERT",
                                 "ETRAIN_ETCD_KEY")
TLS, INSECURE = "ETRAIN_ETCD_TLS", "ETRAIN_ETCD_INSECURE"
SCHEMES = ("etcd://", "etcds://")  # the etcd run store's URLs: over HTTP, over HTTPS
# What etcd says when it wants credentials, or refuses the ones it got.
_AUTH_ERRORS = ("user name is empty", "invalid auth token", "authentication failed", "permission denied",
                "user name not found", "auth: revision")


def _pair(a: str, b: str) -> tuple[str, str] | None:
    va, vb = os.environ.get(a, ""), os.environ.get(b, "")
    if bool(va) != bool(vb):
        raise ConfigError(f"${a if not va else b} is not set but ${b if not va else a} is: set both, or neither")
    return (va, vb) if va else None


def _file(var: str) -> str:
    path = os.environ[var]
    if not os.path.isfile(path):
        raise ConfigError(f"${var}={path!r} is not a readable file; point it at the PEM file")
    return path


def _flag(var: str) -> bool:
    value = os.environ.get(var, "").strip().lower()
    if value not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"${var}={value[:20]!r} is not a switch; set it to 1 (on) or 0 (off)")
    return value in ("1", "true", "yes")


def trust_store() -> str | bool:
    """What checks a server's certificate without ``$ETRAIN_ETCD_CA``: the system's CA bundle (OpenSSL's
    default file, ``$SSL_CERT_FILE`` if set), or requests' own bundle (True) where the system has none."""
    paths = ssl.get_default_verify_paths()
    return paths.cafile if paths.cafile and os.path.isfile(paths.cafile) else True


_warned: set[str] = set()


def connect(host: str, port: int, timeout_s: float, tls: bool = False):
    """An etcd3gw client for ``host:port``, with the user, password and TLS files of the environment; HTTPS
    when ``tls`` (an ``etcds://`` URL) or the environment asks for it. ConfigError for a user and password
    that would go over plain HTTP, unless ``$ETRAIN_ETCD_INSECURE`` allows it."""
    import etcd3gw

    login = _pair(USER, PASSWORD)
    cert = _pair(CERT, KEY)
    ca = _file(CA) if os.environ.get(CA) else None
    if cert:
        cert = (_file(CERT), _file(KEY))
    tls = bool(tls or _flag(TLS) or ca or cert)
    where = f"{host}:{port}"
    if login and not tls:
        if not _flag(INSECURE):
            raise ConfigError(f"etcd at {where}: ${USER} and ${PASSWORD} would be sent over plain HTTP, in the "
                              f"clear; use TLS (an etcds://{where}/... store URL or ${TLS}=1, with ${CA} for a "
                              f"private CA), or set ${INSECURE}=1 if the path to etcd is trusted (loopback, a tunnel)")
        if where not in _warned:
            _warned.add(where)
            log.warning("etcd at %s: the password of $%s goes over plain HTTP, in the clear ($%s=1); use TLS "
                        "(etcds://) unless the path to etcd is trusted", where, USER, INSECURE)
    session = _session(f"{'https' if tls else 'http'}://{where}", login, timeout_s, ca or trust_store(), cert)
    return etcd3gw.client(host=host, port=port, protocol="https" if tls else "http", timeout=timeout_s,
                          session=session)


def _session(base: str, login: tuple[str, str] | None, timeout_s: float, verify: str | bool, cert):
    import requests

    class Session(requests.Session):
        """Sends etcd's auth token with each request (authenticating first, and again when it expired), and
        checks the server against ``verify`` (a CA bundle): given with every request, as $REQUESTS_CA_BUNDLE
        would win over a session's own ``verify``."""

        token: str | None = None

        def authenticate(self) -> None:
            self.token = None
            resp = super().request("POST", f"{base}/v3/auth/authenticate", timeout=timeout_s, verify=verify,
                                   cert=cert, json={"name": login[0], "password": login[1]})
            if resp.status_code != 200:
                raise StoreUnavailable(f"etcd at {base} refused the user ${USER}={login[0]!r}: "
                                       f"{_detail(resp.text)}; check ${USER} and ${PASSWORD}")
            self.token = resp.json().get("token") or ""

        def request(self, method, url, *args, **kwargs):
            kwargs.update(verify=verify, cert=cert)
            if login is None or url.endswith("/version"):  # the API discovery asks no credentials
                return super().request(method, url, *args, **kwargs)
            for attempt in range(2):
                if self.token is None:
                    self.authenticate()
                kwargs["headers"] = {**(kwargs.get("headers") or {}), "Authorization": self.token}
                resp = super().request(method, url, *args, **kwargs)
                if attempt == 0 and resp.status_code == 401 and "invalid auth token" in resp.text:
                    self.token = None  # expired (etcd's --auth-token-ttl): a new one, once
                    continue
                return resp
            return resp

    return Session()


def _detail(text: str) -> str:
    import json

    try:
        return str(json.loads(text).get("error") or text)[:200]
    except (ValueError, AttributeError):
        return text[:200]


def _tls_refused(url: str) -> bool:
    """Whether ``url`` is spoken over TLS and its server answers TCP: a failed connection is then its handshake."""
    import socket
    from urllib.parse import urlsplit

    tls = url.startswith("etcds://") or any(os.environ.get(v) for v in (CA, CERT))
    try:
        tls = tls or _flag(TLS)
        parts = urlsplit(url)
        if not tls or not parts.hostname:
            return False
        with socket.create_connection((parts.hostname, parts.port or 2379), timeout=1):
            return True
    except (ConnectionResetError, ConnectionAbortedError):  # it answered, then reset us before connect returned
        return True
    except (OSError, ValueError, ConfigError):  # nobody listens (refused), no route, a bad URL
        return False


def call(url: str, fn):
    """``fn()``, its failures as :class:`StoreUnavailable` saying what to do."""
    import requests
    from etcd3gw import exceptions as ex

    try:
        return fn()
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ex.ConnectionFailedError,
            ex.ConnectionTimeoutError) as e:
        # etcd3gw keeps requests' text in detail_text; a plain-HTTP server may just reset the handshake
        if "SSL" in f"{e} {getattr(e, 'detail_text', '')}" or _tls_refused(url):
            against = f"${CA}" if os.environ.get(CA) else f"the system's trust store (${CA} unset)"
            raise StoreUnavailable(f"etcd at {redact(url)}: the TLS handshake failed (the server's certificate "
                                   f"checked against {against}); set ${CA} to the CA that signed it, check "
                                   f"${CERT} / ${KEY}, and that the server speaks TLS") from None
        raise StoreUnavailable(f"etcd at {redact(url)} is unreachable ({type(e).__name__}); "
                               "is the server up and the address right?") from None
    except ex.Etcd3Exception as e:
        detail = _detail(e.detail_text or str(e))
        if any(s in detail for s in _AUTH_ERRORS):
            who = f"the user ${USER}={os.environ[USER]!r}" if os.environ.get(USER) else f"no user (${USER} unset)"
            raise StoreUnavailable(f"etcd at {redact(url)} refused {who}: {detail}; set ${USER} and ${PASSWORD} "
                                   "to a user with read-write access to the store's prefix") from None
        raise StoreUnavailable(f"etcd at {redact(url)} refused the request: {detail}") from None
