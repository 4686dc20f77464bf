"""A backend written outside gpuflow's package, as a new backend would be: units run as
processes on this machine under the name `toy`, with state on disk so that teardown and
its reaper work from any process. Importing this module registers it."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

import psutil
from pydantic import BaseModel

from gpuflow.tasks.backends.base import LogTail, ProcessGroupUnit, UnitBackend
from gpuflow.tasks.backends.registry import register
from gpuflow.tasks.contract import (
    OWNER_LABEL,
    RUN_LABEL,
    Capabilities,
    Cluster,
    Needs,
    Offer,
    ReapReport,
    RunStates,
    TeardownReport,
    UnitEnd,
    WorkUnit,
    state_of,
    unit_env,
)
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import (
    Orchestrator,
    alive,
    gpuflow_home,
    stop_group,
    this_process,
    write_atomic,
)
from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.spec import JobSpec, Placement


class ToyState(BaseModel):
    orchestrator: Orchestrator
    groups: dict[str, float] = {}  # process group -> its leader's start time


class ToyBackend(UnitBackend):
    name = "toy"
    capabilities = Capabilities(runs_here=True, where="this machine, as toy processes")

    @classmethod
    def at(cls, placement: Placement | None = None) -> ToyBackend:
        return cls()

    @classmethod
    def of(cls, cluster: Cluster) -> ToyBackend:
        return cls()

    def __init__(self) -> None:
        self.home = gpuflow_home() / "toy"

    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec and prices as they are: this backend reads its block itself."""
        return spec, prices

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        if spec.resources.gpus and not spec.resources.allow_cpu:
            raise InvalidSpec("resources.gpus: the toy backend has no GPUs; set allow_cpu: true")

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        return [Offer(where="this machine, as toy processes", gpus_free=0)]

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        name = f"toy-{owner[RUN_LABEL]}"
        record = self._read(name)
        if record is not None:
            return record.model_copy(update={"adopted": True})
        cluster = Cluster(
            backend=self.name,
            name=name,
            owner=dict(owner),
            hostname="localhost",
            workspace=str(self.home / "workspaces" / name),
            created_at=datetime.now(UTC),
            capabilities=self.capabilities,
            state=ToyState(orchestrator=this_process()).model_dump(),
        )
        (Path(cluster.workspace) / "outputs").mkdir(parents=True, exist_ok=True)
        self._write(cluster)
        return cluster

    def start(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        tail: LogTail,
    ) -> ToyUnit:
        variables = {**os.environ, **env, **unit.env}
        variables |= unit_env(unit.node, cluster.nodes, cluster.workspace, [])
        proc = subprocess.Popen(
            unit.command,
            cwd=cluster.workspace,
            env=variables,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        state = state_of(cluster, ToyState)
        state.groups[str(proc.pid)] = _started(proc.pid)
        self._write(cluster.model_copy(update={"state": state.model_dump()}))
        return ToyUnit(proc, tail)

    def teardown(self, cluster: Cluster) -> TeardownReport:
        record = self._read(cluster.name)
        report = TeardownReport(name=cluster.name, already_gone=record is None)
        if record is not None:
            for pgid, started in state_of(record, ToyState).groups.items():
                if alive(int(pgid), started):
                    report.killed_processes += stop_group(int(pgid), started, grace_s=5)
        shutil.rmtree(Path(cluster.workspace), ignore_errors=True)
        self._path(cluster.name).unlink(missing_ok=True)
        report.removed_workspace = True
        return report

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        found = [self._read(p.stem) for p in sorted((self.home / "clusters").glob("*.json"))]
        return [
            c
            for c in found
            if c is not None and all(c.owner.get(k) == v for k, v in selector.items())
        ]

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        done = ReapReport(counts={"clusters": 0})
        for cluster in self.list_owned({OWNER_LABEL: "gpuflow"}):
            state = runs.state(cluster.owner.get(RUN_LABEL, ""), None)
            if state == "running" and not state_of(cluster, ToyState).orchestrator.dead_here():
                continue
            say(f"{'would reap' if dry_run else 'reaping'} {cluster.name}")
            done.counts["clusters"] += 1
            if not dry_run:
                self.teardown(cluster)
                done.crashed.append((cluster.owner.get(RUN_LABEL, ""), None))
        return done

    def _path(self, name: str) -> Path:
        return self.home / "clusters" / f"{name}.json"

    def _read(self, name: str) -> Cluster | None:
        try:
            return Cluster.model_validate_json(self._path(name).read_text())
        except FileNotFoundError:
            return None

    def _write(self, cluster: Cluster) -> None:
        write_atomic(self._path(cluster.name), cluster.model_dump_json(exclude={"adopted"}))


class ToyUnit(ProcessGroupUnit):
    """A toy unit: its process group, and a thread reading its output into the tail."""

    def __init__(self, proc: subprocess.Popen, tail: LogTail) -> None:
        super().__init__(proc)
        self.reader = threading.Thread(target=self._read, args=(tail,), daemon=True)
        self.reader.start()

    def _read(self, tail: LogTail) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            tail("stdout", line.rstrip("\n"))

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        self.reader.join(timeout=30)
        return end


def _started(pid: int) -> float:
    return psutil.Process(pid).create_time()


register(ToyBackend)
