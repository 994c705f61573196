"""Ray sessions: joining a cluster (one place for what every command does with
``--address``), or a local Ray on loopback (``start_local_ray``); ``ray_session``
uses the running Ray or starts one of the two for a block.

``join(address)`` connects this process to the cluster with the autopar
package in the job's runtime_env (``py_modules``), so nodes need only Ray and
autopar's dependencies, not the project.  Failures become one-line
``SpecError``s on the ``address`` argument: nothing answers at a host:port
(checked first: Ray itself would retry for minutes), or the cluster wants
token authentication this process does not offer (Ray 2.60 turns it on for
the clusters ``ray start`` creates; the driver needs ``RAY_AUTH_MODE=token``
and the cluster's token, see docs/cluster.md).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from autopar.io.specs import SpecError

SOURCE = "arguments"


def package_env() -> dict:
    """runtime_env that ships the autopar package to every worker of the job."""
    return {"py_modules": [str(Path(__file__).resolve().parent.parent)]}


# The client's opening of an HTTP/2 connection (RFC 9113, section 3.4); a
# gRPC server, as Ray's GCS is, answers it with a SETTINGS frame (type 4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_SETTINGS = 0x4


def reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast when a host:port address does not answer, or answers but is
    no gRPC server (a port of another service: Ray would wait on it for
    minutes)."""
    import socket
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return          # "auto", "ray://...", or something Ray interprets
    try:
        conn = socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                        timeout=timeout)
    except OSError as e:
        raise SpecError(SOURCE, "address",
                        f"no Ray cluster answers at {address}: {e.strerror or e}") from None
    with conn:
        try:
            conn.sendall(_H2_PREFACE + bytes(9))     # the preface, then an empty SETTINGS
            head = b""
            while len(head) < 9:
                chunk = conn.recv(9 - len(head))
                if not chunk:
                    break
                head += chunk
        except OSError:
            head = b""
    if len(head) < 9 or head[3] != _H2_SETTINGS:
        raise SpecError(SOURCE, "address", f"the service at {address} is not a Ray cluster "
                                           "(it does not answer as Ray's GCS server does)")


@contextlib.contextmanager
def _stderr_held():
    """Ray's core prints its connection retries (gcs_client, grpc) straight
    to file descriptor 2; while connecting they go to a temporary file,
    whose text is yielded in a list once the block ends."""
    import os
    import sys
    import tempfile
    caught: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield caught
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            caught.append(held.read().decode("utf-8", "replace"))


def join(address: str) -> None:
    """``ray.init`` on the cluster at ``address``, shipping the package."""
    import ray
    reachable(address)
    try:
        with _stderr_held() as printed:
            ray.init(address=address, runtime_env=package_env(), log_to_driver=False,
                     logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        text, cause = str(e) + "\n" + "".join(printed), e.__cause__ or e.__context__
        while cause is not None:          # Ray wraps the GCS error in a ConnectionError
            text += "\n" + str(cause)
            cause = cause.__cause__ or cause.__context__
        if ("InvalidAuthToken" in text or "AuthenticationError" in text
                or "UNAUTHENTICATED" in text):
            msg = ("the cluster requires token authentication: set RAY_AUTH_MODE=token and "
                   "provide its token (~/.ray/auth_token, RAY_AUTH_TOKEN or "
                   "RAY_AUTH_TOKEN_PATH)")
        else:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(SOURCE, "address", f"cannot connect to Ray at {address!r}: {msg}") from None


# --------------------------------------------------------------------------
# A Ray session: a local Ray on loopback, or a cluster joined by address

def start_local_ray(num_cpus: int | None = None) -> None:
    """Start a new local Ray (never joins a running one) on loopback only, no dashboard.

    Ray 2.60 binds its servers to the node's IP address, but ``ray.init``
    replaces a loopback ``_node_ip_address`` by the machine's outward address
    unless Ray's cluster mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
    read once at import as ``ray_constants.ENABLE_RAY_CLUSTER``).  It is
    switched off only while the node starts, so every server listens on
    127.0.0.1 and nothing is reachable from other machines.
    """
    import ray
    from ray._private import ray_constants
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False,
                 logging_level=logging.WARNING)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def ray_session(address: str | None):
    """Use the running Ray, else start one (local, or joining ``address``)."""
    import os

    import ray
    started = False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if not ray.is_initialized():
        if address:
            join(address)
        else:
            start_local_ray()
        started = True
    try:
        yield
    finally:
        if started:
            ray.shutdown()
