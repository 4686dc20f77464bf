"""The Backend protocol: the verbs every backend speaks, and what each does on retry and
when things are already gone."""

from __future__ import annotations

import contextlib
import math
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import ClassVar, Protocol

from gpuflow.tasks.contract import (
    Capabilities,
    Cluster,
    JobResult,
    LineSink,
    Needs,
    Offer,
    ReapReport,
    RunStates,
    StopCheck,
    StopReason,
    TeardownReport,
    UnitEnd,
    WorkUnit,
)
from gpuflow.tasks.host import signals_deferred, stop_group
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.spec import JobSpec, Placement


class UnitHandle(Protocol):
    """What a backend gives `follow_unit` for one started unit: how to see its end, wait,
    and stop it on its kind of machine."""

    def poll(self) -> UnitEnd | None:
        """Return the unit's end once it ended, else None. May raise (a pod that can never
        be placed: ProvisionError; GPUs that stay busy: CapacityError)."""

    def wait(self, seconds: float) -> None:
        """Wait up to `seconds` for something to change (sooner when the unit ends)."""

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd | None:
        """Stop the unit for `reason`: SIGTERM, `grace_s` to save its state, SIGKILL. Return
        its end when known at once; None to keep polling for it."""

    def interrupt(self, grace_s: float) -> None:
        """This process is going down: stop the unit the same way, without waiting long."""

    def unconfirmed(self) -> UnitEnd:
        """Return the end to report when a stopped unit never confirmed its end."""


def follow_unit(
    unit: UnitHandle,
    timeout_s: float,
    should_stop: StopCheck | None,
    grace_s: float,
    every_s: float,
    confirm_s: float = 60.0,
) -> UnitEnd:
    """Follow a started unit to its end, the same way on every backend: stop it past
    `timeout_s` (TIMEOUT) or when `should_stop()` says so (CANCELLED), give a stopped unit
    `grace_s` plus `confirm_s` to say how it ended, and stop it when this process is
    interrupted (then re-raise)."""
    deadline = time.monotonic() + timeout_s
    reason: StopReason | None = None
    give_up = math.inf
    try:
        while True:
            end = unit.poll()
            if end is not None:
                return end.model_copy(update={"stop": reason}) if reason else end
            if reason is None:
                if time.monotonic() >= deadline:
                    reason = StopReason.TIMEOUT
                elif should_stop is not None and should_stop():
                    reason = StopReason.CANCELLED
                if reason is not None:
                    end = unit.stop(reason, grace_s)
                    if end is not None:
                        return end.model_copy(update={"stop": reason})
                    give_up = time.monotonic() + grace_s + confirm_s
                    continue
            elif time.monotonic() > give_up:
                return unit.unconfirmed().model_copy(update={"stop": reason})
            unit.wait(every_s)
    except BaseException:
        # Cancellation, Ctrl-C, SIGTERM from a worker: the unit gets SIGTERM to save state,
        # and its whole grace however many more signals arrive.
        with signals_deferred():
            unit.interrupt(grace_s)
        raise


class ProcessGroupUnit:
    """A unit that is a process group on this machine (started in a session of its own),
    as follow_unit sees it: for backends whose units are local processes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def poll(self) -> UnitEnd | None:
        code = self.proc.poll()
        return None if code is None else _ended(code)

    def wait(self, seconds: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=seconds)

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd:
        stop_group(self.proc.pid, None, grace_s)
        return _ended(self.proc.wait())

    def interrupt(self, grace_s: float) -> None:
        stop_group(self.proc.pid, None, grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)  # reaped: an unreaped child keeps its cgroup busy

    def unconfirmed(self) -> UnitEnd:
        return UnitEnd(signal=9)


def _ended(code: int) -> UnitEnd:
    """Return the end of a process that exited with `code` (negative: killed by a signal)."""
    return UnitEnd(exit_code=code if code >= 0 else None, signal=-code if code < 0 else None)


class Backend(Protocol):
    """Every backend speaks these verbs; each says what it does on retry and when things are gone."""

    name: ClassVar[str]
    # what it can do; a backend whose units do not run here also gives `describe(spec)`
    capabilities: ClassVar[Capabilities]

    @classmethod
    def at(cls, placement: Placement | None = None) -> Backend:
        """Return the backend for a spec's placement (its block, namespace); None: defaults."""

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec with its placement block's settings applied (values written in
        the spec win) and the prices with the block's; InvalidSpec for a missing block."""

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """Raise InvalidSpec if this backend cannot run `spec` (with what its kind `needs`;
        None: nothing beyond the spec); makes nothing. The pipeline matches `needs` with
        `capabilities` itself."""

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        """Return what this backend could give `spec` now, best first, priced with `prices`
        (its block's applied): free GPUs, the queue ahead, $/h. Makes nothing; raises
        InvalidSpec only for settings that are wrong (an unreachable cluster is an offer
        that cannot start, saying why)."""

    def describe(self, spec: JobSpec) -> list[dict[str, str]]:
        """Return preflight rows saying where and how the job would run (no host checks)."""

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Return resources for `spec`. Idempotent: a retry with the same owner adopts what
        exists. Raises CapacityError when nothing is free (retryable), ProvisionError otherwise."""

    def run(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        on_line: LineSink,
        should_stop: StopCheck | None = None,
        grace_s: float = 30.0,
    ) -> JobResult:
        """Run `unit` on its node with `env` (the job's variables: spec env, storage
        credentials, secrets; the backend adds what its nodes need and the unit's own env
        over it) and its GPUs, streaming lines, and return its outcome. On timeout, or
        when `should_stop` says so, the unit is stopped and the result says which. On an
        interruption of this process the unit gets SIGTERM, `grace_s` to save its state,
        then SIGKILL, and the interruption propagates. Several units may run at once."""

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Release everything `cluster` holds. Idempotent: never raises on "already gone"."""

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return clusters whose owner labels include `selector`, for a reaper."""

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Remove what runs that are over (or whose gpuflow died) left, asking `runs` how
        each run stands; with `dry_run`, only say what would go. Idempotent."""
