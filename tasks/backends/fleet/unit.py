"""A unit on a fleet host, as follow_unit sees it through the host program, and the calls this machine makes to a host (its wheel installed once, its JSON answers, its status)."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuflow.tasks.backends.base import LogTail, join_samples
from gpuflow.tasks.backends.fleet import hosts as fleet_hosts
from gpuflow.tasks.backends.fleet.session import HostSession, UnitWatch
from gpuflow.tasks.backends.fleet.state import secret_text
from gpuflow.tasks.contract import (
    Cluster,
    StopReason,
    UnitEnd,
)
from gpuflow.tasks.errors import (
    InvalidSpec,
    ProvisionError,
)
from gpuflow.tasks.metrics.sampler import SAMPLES

if TYPE_CHECKING:
    from gpuflow.blocks.gpu_fleet import FleetHost, GpuFleet


class SampleWriter:
    """A unit's samples from its host, written here as they come (NODE_SAMPLES)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def __call__(self, sample: dict) -> None:
        with self.lock, contextlib.suppress(OSError), open(self.path, "a") as out:
            out.write(json.dumps(sample) + "\n")


class FleetUnit:
    """A unit on a fleet host, as follow_unit sees it."""

    every_s = 0.2

    def __init__(
        self,
        session: HostSession,
        unit_id: str,
        watch: UnitWatch,
        cluster: Cluster,
        tail: LogTail,
        samples: Path,
    ) -> None:
        self.session, self.unit_id, self.watch, self.cluster = (
            session,
            unit_id,
            watch,
            cluster,
        )
        self.tail, self.samples = tail, samples

    def poll(self) -> UnitEnd | None:
        return self.watch.end

    def wait(self, seconds: float) -> None:
        self.watch.changed.wait(seconds)

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd | None:
        self.session.stop(self.unit_id, grace_s)
        return None

    def interrupt(self, grace_s: float) -> None:
        self.session.stop(self.unit_id, grace_s)
        self.watch.changed.wait(grace_s + 5)

    def unconfirmed(self) -> UnitEnd:
        return UnitEnd(signal=9, tail=[f"{self.session.ssh} never confirmed the unit's end"])

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        """Add the unit's samples from its host to the run's, and bring its outputs back
        from the host (a lost host has none to give)."""
        self.session.units.pop(self.unit_id, None)
        if self.samples.is_file():  # kept: a service's scaler may still be reading it
            join_samples(Path(self.cluster.workspace) / SAMPLES, self.samples.read_bytes())
        if self.session.lost is not None:
            self.tail.note(self.session.lost)  # why it was preempted, in the run's log
        if end is None or self.session.lost is not None:
            return end
        remote = str(self.session.claimed.get("name", ""))
        done = self.session.ssh.run(self.session.command_for(["outputs", remote]), timeout_s=300)
        if done.returncode == 0 and done.stdout:
            untar(done.stdout, Path(self.cluster.workspace) / "outputs")
        return end


def untar(data: bytes, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")  # no links out, no devices, no absolute paths


_INSTALLED: dict[tuple[str, str], str] = {}


_INSTALLED_LOCK = threading.Lock()


def installed_wheel(fleet: GpuFleet, host: FleetHost, ssh: Any) -> str:
    """Return the SHA of this gpuflow's wheel, put on `host` once per process."""
    _, _, sha = fleet_hosts.this_wheel()
    key = (host.label, sha)
    with _INSTALLED_LOCK:
        if key in _INSTALLED:
            return sha
    fleet_hosts.install(ssh, host)
    with _INSTALLED_LOCK:
        _INSTALLED[key] = sha
    return sha


def remote_json(fleet: GpuFleet, host: FleetHost, argv: list[str]) -> dict[str, Any]:
    """Run gpuflow's host program on `host` with `argv`; return the JSON it printed."""
    ssh = fleet_hosts.target(fleet, host, secret_text)
    try:
        sha = installed_wheel(fleet, host, ssh)
        done = ssh.run(fleet_hosts.gpuflow_command(host, sha, argv))
        if done.returncode == fleet_hosts.SSH_FAILED:
            raise ProvisionError(ssh.failure(done.stderr.decode(errors="replace")))
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise ProvisionError(f"{ssh}: {said[-1] if said else f'exit {done.returncode}'}")
        return fleet_hosts.json_answer(done.stdout)
    finally:
        ssh.close()


def host_status(fleet: GpuFleet, host: FleetHost) -> dict[str, Any]:
    """Return what `host` says now: its GPUs, the runs holding them, and how many are free
    (`error`: why it could not be asked)."""
    try:
        said = remote_json(fleet, host, ["status"])
    except (InvalidSpec, ProvisionError, TimeoutError) as exc:
        return {"error": str(exc)}
    probe = said.get("host", {})
    gpus = len(probe.get("gpus", []))
    runs = said.get("runs", [])
    held = sum(len(run.get("gpus", [])) for run in runs)
    return {
        "gpus": gpus,
        "free": max(0, gpus - held),
        "runs": runs,
        "probe": probe,
        "usage": said.get("usage", {}),
    }
