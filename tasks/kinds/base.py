"""What a job kind is: the protocol every kind implements, and the work units it hands to
a backend.

A kind turns a checked spec into work units; a backend places each unit on a node of its
cluster and runs it; the kind judges the outcome and turns the job's outputs into the
run's summary. Stages, flows and the CLI speak only this protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from gpuflow.tasks.contract import Capabilities, Cluster, Needs, RunOutcome, UnitRunner, WorkUnit
from gpuflow.tasks.spec import JobSpec, job_as

J = TypeVar("J", bound=BaseModel)

__all__ = ["JobKind", "Report", "WorkUnit"]


class Report(BaseModel):
    """What a kind adds to the run's summary: table rows, markdown lines, and a headline
    shown under the title."""

    rows: list[dict[str, Any]] = []
    lines: list[str] = []
    headline: list[str] = []


class JobKind(Generic[J]):
    """One job kind, generic over its job model J. Subclasses set `name` and `model` and
    override what they need; `job_of(spec)` is the spec's job as J."""

    name: ClassVar[str]
    model: type[J]  # the `job:` section of a spec of this kind
    # "module:flow" that runs this kind from the CLI; None runs it in gpu_pipeline
    flow: ClassVar[str | None] = None

    # True when the kind hands out its own units (`schedule`) instead of the run stage
    # running every unit of `units` at once
    schedules_units: ClassVar[bool] = False
    # the figures its job writes to outputs/result.json; None: the job's own, free-form
    result: ClassVar[type[BaseModel] | None] = None

    def job_of(self, spec: JobSpec) -> J:
        """Return the spec's job as this kind's model (InvalidSpec for another kind's)."""
        return job_as(spec, self.model)

    def sized(self, spec: JobSpec, where: Capabilities) -> JobSpec:
        """Return `spec` as a backend that can do `where` provisions it (a service holds
        room for its most replicas where they share its node); the spec itself for most
        kinds. Applied once, before every check."""
        return spec

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        """Raise InvalidSpec when the job cannot run as written on a backend that can do
        `where`; makes nothing. Runs before anything is provisioned, after the spec itself
        was validated and the kind's `needs` were matched with the backend."""

    def check_in_image(self, spec: JobSpec, where: Capabilities) -> None:
        """The checks that need the job's image (pinned, on this host where its units run
        here): run after it was pulled, before anything is provisioned."""

    def extra(self, spec: JobSpec, where: Capabilities) -> str | None:
        """Return the gpuflow extra (tasks/extras.py) this job needs in gpuflow's own
        environment on a backend that can do `where`; None for none."""
        return None

    def interpreter(self, spec: JobSpec) -> str | None:
        """Return the Python the job's own command runs where its units run here (preflight
        checks torch as that one imports it); None: gpuflow's own (the kinds that start
        gpuflow's modules)."""
        return None

    def uses_torch(self, spec: JobSpec) -> bool:
        """Return True when preflight should check torch and its CUDA for this job (the
        kinds whose model has a `torch` field say so from it)."""
        return False

    def batch_size(self, spec: JobSpec) -> int | None:
        """Return the job's samples per step, for a diagnosis of running out of GPU
        memory; None for a kind that has none."""
        return None

    def needs(self, spec: JobSpec) -> Needs:
        """Return what the job needs from the backend: programs it starts, files it reads
        or writes, an MPI launcher. The pipeline refuses a backend that cannot give them."""
        return Needs()

    def nothing_to_do(self, spec: JobSpec, where: Capabilities) -> str | None:
        """Return why the job has nothing left to do (a rerun whose outputs are all in
        storage), so that nothing is provisioned for it; None when there is work."""
        return None

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        """Return this kind's preflight checks ({name, level, message}) on `cluster`."""
        return []

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        """Return the work units that run the job on `cluster`."""
        raise NotImplementedError(f"job kind {self.name!r} has no units")

    def schedule(self, spec: JobSpec, runner: UnitRunner, deadline: float) -> RunOutcome:
        """Run the job's units one by one through `runner` until `deadline` (time.time());
        only for kinds with `schedules_units` (render chunks as GPUs free up)."""
        raise NotImplementedError(f"job kind {self.name!r} does not schedule its units")

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        """Return what the job's outputs add to the summary; may write artifacts (plots)."""
        return Report()

    def figures(self, job: dict[str, Any]) -> BaseModel | None:
        """Return the job's result.json figures read through the kind's `result` model;
        None without one, or for figures not of it (a job that stopped before its end)."""
        if self.result is None or not job:
            return None
        try:
            return self.result.model_validate(job)
        except ValidationError:
            return None

    def summary(self, job: dict[str, Any]) -> list[str]:
        """Return the lines the CLI prints about the job's result.json figures."""
        return []
