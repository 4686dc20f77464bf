"""Replicas that fail to serve, in a row: when the next one may start (an exponential
back-off, capped) and when the service gives up and fails with the last one's cause.

A replica fails when it ends by itself before it served for STABLE_S, or is not ready
within start_timeout_s; one that serves STABLE_S ends the row."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import psutil

STABLE_S = 30.0  # a replica ready this long ends a row of failures
FIRST_WAIT_S = 1.0  # the wait after the first failure; doubled after each next one
LONGEST_WAIT_S = 60.0


@dataclass
class Restarts:
    budget: int  # failures in a row before the service gives up (job.failures_max)
    failures: int = 0
    not_before: float = 0.0  # time.monotonic() before which no replica starts
    cause: str = ""

    def failed(self, cause: str, now: float) -> float:
        """Count one failure; return how long the next replica waits."""
        self.failures += 1
        self.cause = cause
        wait = min(LONGEST_WAIT_S, FIRST_WAIT_S * 2 ** (self.failures - 1))
        self.not_before = now + wait
        return wait

    def served(self) -> None:
        self.failures, self.not_before = 0, 0.0

    def may_start(self, now: float) -> bool:
        return now >= self.not_before

    def given_up(self) -> str | None:
        """Return why the service fails, once `budget` replicas in a row failed."""
        if self.failures < self.budget:
            return None
        return (
            f"{self.failures} replicas in a row failed to serve (job.failures_max:"
            f" {self.budget}); the last: {self.cause}"
        )


def listening_elsewhere(replica: str, port: int) -> str:
    """Return "; it listens on N, not on $PORT (P)" when a process of this machine
    started as `replica` and given `port` (its GPUFLOW_REPLICA and PORT: another service's
    replica of the same name is not it) listens on other ports; "" when none does or it
    cannot be told."""
    ports: set[int] = set()
    try:
        found = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return ""
    for conn in found:
        if conn.status != psutil.CONN_LISTEN or conn.pid is None or conn.laddr.port == port:
            continue
        try:
            proc = psutil.Process(conn.pid)
            if proc.uids().real != os.getuid():
                continue
            environ = proc.environ()  # this service's replica: its name and the port it was given
            if environ.get("GPUFLOW_REPLICA") == replica and environ.get("PORT") == str(port):
                ports.add(conn.laddr.port)
        except (psutil.Error, OSError):
            continue
    if not ports:
        return ""
    shown = ", ".join(str(p) for p in sorted(ports))
    return f"; it listens on {shown}, not on $PORT ({port})"


def address_here(host: str) -> str | None:
    """Return why the endpoint cannot listen on `host` here (not an address of this
    machine, not a name that resolves), or None when it can."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, 0))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
