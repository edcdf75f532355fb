"""Join a Ray cluster, or start a local one on 127.0.0.1: what ``etrain run`` / ``resume`` / ``submit`` do first.

    local = connect(address, num_cpus)      # $RAY_ADDRESS when address is None; a local Ray when neither
    use_ray_token()                         # before a JobSubmissionClient: Ray's token, as the ray CLI finds it

A cluster with Ray's token authentication (``RAY_AUTH_MODE=token`` on its head) is joined with the token
Ray finds on this machine (``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``) when
``RAY_AUTH_MODE`` is not set here, as the ``ray`` CLI does; one that refuses what this machine would send
is named at once, with the variables to set (EtrainError, exit 2), instead of Ray's 20 s of retries.
docs/operations.md#ray-token-authentication.
"""

from __future__ import annotations

import logging
import os

from checkpointing.errors import EtrainError
from checkpointing.names import redact, redact_text

from ..service import auth


def connect(address: str | None, num_cpus: int) -> bool:
    """Join the cluster at ``address`` / $RAY_ADDRESS, or start a local Ray on 127.0.0.1. True if local."""
    address = address or os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not address:
        # A local Ray stays on loopback. Without this Ray names the node by the machine's routable
        # address even when told 127.0.0.1, and the workers' rendezvous would follow it there. Ray
        # reads it when imported (hence before the import below) and its processes inherit it.
        os.environ.setdefault(_LOCAL_ONLY, "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        use_ray_token()
        check_token_accepted(address)  # a refused token is said at once, not after 20 s of Ray's retries
        try:
            ray.init(address=address, namespace="etrain", log_to_driver=False, logging_level="warning")
        except (ConnectionError, RuntimeError, ValueError) as e:  # their text repeats the address
            raise EtrainError(f"cannot join the Ray cluster at {redact(address)} (--address / $RAY_ADDRESS): "
                              f"{first_line(redact_text(str(e), address))}") from None
        return False
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = os.environ[_LOCAL_ONLY] != "0"  # in case Ray was imported earlier
    # Ray turns token authentication on for a new local cluster and warns about it on every start; this
    # one listens on loopback only, so the warning is noise in etrain's output (docs/operations.md).
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # address="local": a new instance, even when another Ray runs on this machine (ray.init() would join it).
    # Its processes, the workers among them, inherit this environment: without the shell's tokens.
    with auth.secrets_withheld():
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
                 namespace="etrain", log_to_driver=False, logging_level="warning")
    return True


_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# How Ray's clients find the token of a cluster with token authentication (RAY_AUTH_MODE=token on its head).
TOKEN_HELP = ("set RAY_AUTH_TOKEN to the cluster's token, or RAY_AUTH_TOKEN_PATH to a file holding it, or put "
              "it in ~/.ray/auth_token (`ray get-auth-token` on the head node prints it)")


def use_ray_token() -> bool:
    """Send this user's Ray token to the cluster about to be joined, as the ``ray`` CLI does: when
    ``RAY_AUTH_MODE`` is unset and Ray finds a token (``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH``
    names, else ``~/.ray/auth_token``), token mode is turned on for this process (and what it starts).
    ``RAY_AUTH_MODE`` set is left as it is. Whether token mode is on."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    # Ray's "token authentication is enabled" notice: the cluster's setting, not news to its users.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def check_token_accepted(address: str, timeout_s: float = 5.0) -> None:
    """EtrainError at once, naming the variables to set, when the cluster at ``address`` (its GCS, host:port)
    refuses the token this process would send (or its absence). Ray itself would retry for 20 s, logging a line
    each time. Anything else (an address of another form, a GCS that does not answer) is left to ``ray.init``."""
    if "://" in address or ":" not in address:  # ray://..., "auto": not a GCS to ask
        return
    try:
        import grpc
        from ray._raylet import AuthenticationTokenLoader
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return
    loader = AuthenticationTokenLoader.instance()
    header = loader.get_token_for_http_header() if loader.has_token() else {}  # what Ray will send
    try:
        with grpc.insecure_channel(address) as channel:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=list(header.items()))
        return
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAUTHENTICATED:
            return
    mode = os.environ.get("RAY_AUTH_MODE", "")
    if header:
        why = "refuses the token this machine has (from $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
    elif mode and mode.lower() != "token":
        why = f"needs a token and RAY_AUTH_MODE={mode} sends none; set RAY_AUTH_MODE=token and"
    else:
        why = "needs a token (Ray token authentication) and this machine has none"
    raise EtrainError(f"cannot join the Ray cluster at {redact(address)} (--address / $RAY_ADDRESS): it {why}; "
                      f"{TOKEN_HELP}")


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]
