"""The Prefect API's port, held by every process that sends it gpuflow's auth string.

The server binds its port with SO_REUSEPORT, and so does each of its clients on this
machine (`gpuflow` commands, runs, the platform's worker) without listening: Linux lets
sockets of the same user share such a port and refuses every other user's bind. So when
the server dies, its port stays this user's while any client lives, and nobody else can
take it to receive the clients' requests with the auth string. A client that finds the
port held by another user's program (its bind refused) sends it nothing and says so.

`python -m gpuflow.tasks.platform.portguard URL -- PROGRAM ARGS...` holds URL's port and
becomes PROGRAM (the socket stays open across exec): how the platform's worker runs."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
from urllib.parse import urlsplit

_HELD: dict[tuple[str, int], socket.socket] = {}
_LOCK = threading.Lock()


class PortTaken(OSError):
    """Another user's program holds the API's port: its server is not there."""


def loopback(url: str) -> tuple[str, int] | None:
    """Return (address, port) of a loopback http(s) URL; None for any other."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if host == "localhost":
        host = "127.0.0.1"
    try:
        return (host, port) if ipaddress.ip_address(host).is_loopback else None
    except ValueError:
        return None


def reusable_socket(address: str, server: bool = False) -> socket.socket:
    """Return a TCP socket for `address` whose port this user's other sockets may share
    (SO_REUSEPORT). Only the server's also has SO_REUSEADDR (a restart past TIME_WAIT): a
    holder with it would let another user's wildcard bind through while it is not
    listening."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    made = socket.socket(family, socket.SOCK_STREAM)
    if server:
        made.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    made.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return made


def hold(url: str) -> bool:
    """Hold `url`'s port for this process's life (nothing for a URL not on loopback);
    return True when held. PortTaken (one sentence) when another program holds it."""
    where = loopback(url)
    if where is None:
        return False
    with _LOCK:
        if where in _HELD:
            return True
        held = reusable_socket(where[0])
        try:
            held.bind(where)
        except OSError as exc:
            held.close()
            raise PortTaken(
                exc.errno,
                f"{where[0]}:{where[1]}, the Prefect API's port at {url}, is held by a program"
                " that is not its server (another user's, or one started before gpuflow held"
                " its ports): gpuflow sends it nothing, not its auth string; stop that program,"
                " or restart the API (`gpuflow platform down && gpuflow platform up`)",
            ) from None
        _HELD[where] = held
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m gpuflow.tasks.platform.portguard URL -- PROGRAM ARGS...")
        return 2
    try:
        hold(argv[0])
    except PortTaken as exc:
        print(f"gpuflow: {exc.strerror}", file=sys.stderr)
        return 1
    for held in _HELD.values():
        held.set_inheritable(True)  # the program holds it from here
    os.execvp(argv[2], argv[2:])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
