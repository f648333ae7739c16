"""Connecting to a rendezvous store that may not listen yet, or may be no store at all.

torch's client retries its connection with a backoff that overshoots its timeout about twice over,
and its handshake with a listener that is no store (another program on the port) waits forever,
past its timeout. A client here first waits for the port with plain sockets, then makes torch's
client on a thread of its own, and keeps its deadline either way; ``tell_if_due`` hears why it
cannot connect yet, each try.
"""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch.distributed as dist

__all__ = ["connect", "seconds_left", "launcher_hosts_store"]


def launcher_hosts_store(environ: Mapping[str, str]) -> bool:
    """torchrun and ``ddpkit run`` host the store their workers meet on; elsewhere rank 0 does."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def connect(host: str, port: int, world_size: int, deadline: float,
            tell_if_due: Callable[[str], None] = lambda reason: None) -> dist.Store:
    """A client of the store at ``host:port``, by ``deadline`` (``time.monotonic()``); OSError then."""
    _wait_until_listening(host, port, deadline, tell_if_due)
    return _client_store(host, port, world_size, deadline, tell_if_due)


def seconds_left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.1, deadline - time.monotonic()))


def _client_store(host: str, port: int, world_size: int, deadline: float,
                  tell_if_due: Callable[[str], None]) -> dist.Store:
    """torch's store client, made on a thread of its own: its handshake with a listener that is no
    store (another program holds the port) waits forever, past its timeout. The thread is left
    behind, blocked, when the deadline passes; the error that follows ends the job."""
    made: dict[str, Any] = {}

    def make() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, world_size, is_master=False, timeout=seconds_left(deadline),
                                          wait_for_workers=False)
        except Exception as e:  # raised again on the calling thread
            made["error"] = e

    thread = threading.Thread(target=make, name="ddpkit-rendezvous-connect", daemon=True)
    thread.start()
    while True:
        thread.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        if not thread.is_alive():
            break
        if time.monotonic() >= deadline:
            raise OSError(f"what listens on port {port} of {host} accepted the connection but never answered "
                          "as a rendezvous store: another program may hold the port")
        tell_if_due(f"what listens on port {port} of {host} accepted the connection but does not answer as a "
                    "rendezvous store; another program may hold the port")
    if "error" in made:
        raise made["error"]
    return made["store"]


def _wait_until_listening(host: str, port: int, deadline: float, tell_if_due: Callable[[str], None]) -> None:
    """Return once ``host:port`` accepts a connection; OSError at the deadline. Meanwhile
    ``tell_if_due`` hears why not, each try."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, seconds_left(deadline).total_seconds())):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise OSError(f"nothing accepted a connection there ({e})") from e
            tell_if_due(f"nothing accepts a connection on port {port} of {host} ({e})")
            time.sleep(0.05)  # polling a port that is not open yet: no event to wait on
