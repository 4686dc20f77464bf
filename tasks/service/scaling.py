"""How many replicas a service needs: pure, from what the endpoint and the GPUs say.

The HPA's rule (desired = ceil(current x metric / target), nothing done within 10 % of
the target) for GPU utilisation; ceil(rate / target) for requests per second; the larger
need wins; ceil(connections / per replica) where each replica takes a bounded number of
open connections (a stream's clients). Up at once; down only to the largest need of the last `down_after_s` (the
HPA's stabilisation window), and to zero only after `to_zero_after_s` without a request.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

TOLERANCE = 0.1  # the HPA's: no change while the metric is within 10 % of its target


@dataclass(frozen=True)
class Load:
    """What the scaler sees at one moment."""

    t: float  # seconds, any clock the caller keeps
    replicas: int  # replicas started and not ending (starting or ready)
    ready: int  # of them, passing their readiness check
    rps: float  # requests per second at the endpoint over the window
    gpu_util: float | None  # mean utilisation of the ready replicas' GPUs (%); None: unknown
    waiting: bool  # a request waits at the endpoint for a replica
    last_request_t: float | None  # when the endpoint last saw a request
    connections: int = 0  # open at the replicas, and waiting at the endpoint for one


@dataclass(frozen=True)
class Targets:
    least: int
    most: int
    gpu_util: float | None = None
    rps: float | None = None
    connections: int | None = None  # per replica, at most
    down_after_s: float = 30.0
    to_zero_after_s: float | None = None  # None: never to zero


@dataclass(frozen=True)
class Need:
    replicas: int
    why: str


def need_now(targets: Targets, load: Load) -> Need:
    """Return the replicas `load` needs this moment, before the stabilisation window."""
    needs: list[Need] = []
    if targets.rps is not None:
        count = math.ceil(load.rps / targets.rps) if load.rps > 0 else 0
        if load.replicas and abs(load.rps / (load.replicas * targets.rps) - 1) <= TOLERANCE:
            count = load.replicas
        needs.append(
            Need(count, f"{load.rps:.1f} requests/s at a target of {targets.rps:g} per replica")
        )
    if targets.connections is not None:
        count = math.ceil(load.connections / targets.connections)
        needs.append(
            Need(
                count,
                f"{load.connections} connection(s) open or waiting, at most"
                f" {targets.connections} per replica",
            )
        )
    if targets.gpu_util is not None and load.gpu_util is not None and load.ready:
        ratio = load.gpu_util / targets.gpu_util
        count = load.ready if abs(ratio - 1) <= TOLERANCE else math.ceil(load.ready * ratio)
        needs.append(
            Need(
                count,
                f"GPUs {load.gpu_util:.0f} % busy on {load.ready} replica(s) at a target of"
                f" {targets.gpu_util:g} %",
            )
        )
    if not needs:
        return Need(targets.least, "no scaling target: replicas.min")
    return max(needs, key=lambda need: need.replicas)


class Scaler:
    """The replica count over time: the needs of the stabilisation window, kept here."""

    def __init__(self, targets: Targets) -> None:
        self.targets = targets
        self._recent: deque[tuple[float, int]] = deque()

    def decide(self, load: Load) -> Need:
        """Return the replica count to have now and why, between min and max."""
        targets = self.targets
        now = need_now(targets, load)
        self._recent.append((load.t, now.replicas))
        while self._recent and self._recent[0][0] < load.t - targets.down_after_s:
            self._recent.popleft()
        wanted, why = now.replicas, now.why
        if wanted < load.replicas:  # down only to the largest need of the window
            held = min(max(count for _, count in self._recent), load.replicas)
            if held > wanted:
                wanted = held
                why = f"{why}; held for scaling.down_after_s ({targets.down_after_s:g} s)"
        if wanted < max(targets.least, 1):
            wanted, why = self._floor(load, wanted, why)
        return Need(min(wanted, targets.most), why)

    def _floor(self, load: Load, wanted: int, why: str) -> tuple[int, str]:
        """Return the count below one replica's need: min, or, with min 0, one while a
        request waits or came within to_zero_after_s, zero after that."""
        targets = self.targets
        if targets.least > 0:
            return targets.least, why
        if load.waiting:
            return 1, "a request waits for a replica"
        if load.replicas == 0:
            return 0, why
        quiet_s = None if load.last_request_t is None else load.t - load.last_request_t
        to_zero = targets.to_zero_after_s
        if to_zero is not None and (quiet_s is None or quiet_s >= to_zero):
            return 0, f"no request for {to_zero:g} s: to zero"
        return 1, why
