"""What a job kind is: the protocol every kind implements, and the work units it hands to
a backend.

A kind turns a checked spec into work units; a backend places each unit on a node of its
cluster and runs it; the kind judges the outcome and turns the job's outputs into the
run's summary. Stages, flows and the CLI speak only this protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from tasks.compute.base import Cluster, WorkUnit
from tasks.spec import JobSpec

if TYPE_CHECKING:
    from tasks.metrics.cost import PriceTable
    from tasks.stages import RunOutcome

__all__ = ["JobKind", "Report", "WorkUnit"]


class Report(BaseModel):
    """What a kind adds to the run's summary: table rows, markdown lines, and a headline
    shown under the title."""

    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    headline: list[str] = []


class JobKind:
    """One job kind. Subclasses set `name` and `model` and override what they need."""

    name: ClassVar[str]
    model: ClassVar[type[BaseModel]]  # the `job:` section of a spec of this kind
    # "module:flow" that runs this kind from the CLI; None runs it in gpu_pipeline
    flow: ClassVar[str | None] = None

    def check(self, spec: JobSpec) -> None:
        """Raise InvalidSpec when the job cannot run as written; makes nothing. Runs
        before anything is provisioned, after the spec itself was validated."""

    def uses_torch(self, spec: JobSpec) -> bool:
        """Return True when preflight should check torch and its CUDA for this job."""
        return bool(getattr(spec.job, "torch", False))

    def programs(self, spec: JobSpec) -> dict[str, str]:
        """Return the programs the job's units start, by the spec field that names each,
        for backends that can look them up before provisioning (local checks PATH)."""
        return {}

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        """Return this kind's preflight checks ({name, level, message}) on `cluster`."""
        return []

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        """Return the work units that run the job on `cluster`."""
        raise NotImplementedError(f"job kind {self.name!r} has no units")

    def run_stage(
        self, spec: JobSpec, cluster: Cluster, prices: PriceTable, flow_run_id: str
    ) -> RunOutcome:
        """Run the job's units under the spec's limits (the run stage, with its retries).
        Kinds that schedule units themselves (render chunks) override this."""
        from tasks.stages import retrying, run

        return retrying(run, spec.retry.run)(spec, cluster, prices, flow_run_id)

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        """Return what the job's outputs add to the summary; may write artifacts (plots)."""
        return Report()

    def summary(self, job: dict[str, Any]) -> list[str]:
        """Return the lines the CLI prints about the job's result.json figures."""
        return []
