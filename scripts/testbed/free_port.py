"""Print a TCP port that is free on every address of this host and below the kernel's
ephemeral range.

A port from bind(("127.0.0.1", 0)) lies in the ephemeral range, where the kernel also hands
out the local ports of outgoing connections and of every other bind to port 0: between
choosing it and the server binding it (a kubelet that starts a minute later), another
process on a busy machine can take it. Below that range only a port someone names is taken.
"""

from __future__ import annotations

import random
import socket

LOWEST = 20000  # above the ports that servers are commonly configured to use


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    high = max(ephemeral_low(), LOWEST + 1000)
    for port in random.sample(range(LOWEST, high), min(500, high - LOWEST)):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))  # taken on any address: taken
            except OSError:
                continue
            return port
    raise SystemExit(f"no free TCP port between {LOWEST} and {high}")


if __name__ == "__main__":
    print(free_port())
