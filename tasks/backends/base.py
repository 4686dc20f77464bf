"""The Backend protocol: the verbs every backend speaks, and what each does on retry and
when things are already gone."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, Protocol

from tasks.contract import (
    Capabilities,
    Cluster,
    JobResult,
    LineSink,
    Needs,
    ReapReport,
    RunStates,
    StopCheck,
    TeardownReport,
    WorkUnit,
)
from tasks.spec import JobSpec, Placement


class Backend(Protocol):
    """Every backend speaks these verbs; each says what it does on retry and when things are gone."""

    name: ClassVar[str]
    # what it can do; a backend whose units do not run here also gives `describe(spec)`
    capabilities: ClassVar[Capabilities]

    @classmethod
    def at(cls, placement: Placement | None = None) -> Backend:
        """Return the backend for a spec's placement (its block, namespace); None: defaults."""

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """Raise InvalidSpec if this backend cannot run `spec` (with what its kind `needs`;
        None: nothing beyond the spec); makes nothing. The pipeline matches `needs` with
        `capabilities` itself."""

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
