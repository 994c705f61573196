"""Joining a Ray cluster: one place for what every command does with ``--address``.

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

import logging
from pathlib import Path

from autopar.io.specs import SpecError

SOURCE = "arguments"


def package_env() -> dict:
    """runtime_env that ships the autopar package to every worker of the job."""
    return {"py_modules": [str(Path(__file__).resolve().parent.parent)]}


def reachable(address: str) -> None:
    """Fail fast when a host:port address does not answer."""
    import socket
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return          # "auto", "ray://...", or something Ray interprets
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as e:
        raise SpecError(SOURCE, "address",
                        f"no Ray cluster answers at {address}: {e.strerror or e}") from None


def join(address: str) -> None:
    """``ray.init`` on the cluster at ``address``, shipping the package."""
    import ray
    reachable(address)
    try:
        ray.init(address=address, runtime_env=package_env(), log_to_driver=False,
                 logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        text, cause = str(e), e.__cause__ or e.__context__
        while cause is not None:          # Ray wraps the GCS error in a ConnectionError
            text += "\n" + str(cause)
            cause = cause.__cause__ or cause.__context__
        if "InvalidAuthToken" in text or "AuthenticationError" in text:
            msg = ("the cluster requires token authentication: set RAY_AUTH_MODE=token and "
                   "provide its token (~/.ray/auth_token, RAY_AUTH_TOKEN or "
                   "RAY_AUTH_TOKEN_PATH)")
        else:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(SOURCE, "address", f"cannot connect to Ray at {address!r}: {msg}") from None
