"""What the benches that start servers share: a free port, whether one listens, and a wait
on a condition (never on a fixed sleep) with a bound that names what to look at."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def listening(port: int) -> bool:
    """Return True when something accepts connections on 127.0.0.1:`port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def until(condition: Callable[[], bool], limit_s: float = 180.0, look_at: str = "its logs") -> None:
    """Return once `condition()` holds; end the bench, naming `look_at`, after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"the bench waited too long; see {look_at}")
        time.sleep(0.05)
