"""The local backend on a fleet host, driven over SSH: a fleet's units keep every guarantee
of the local backend (their own process group and cgroup, CUDA_VISIBLE_DEVICES, a stop
with grace, strays stopped, the escape report) because it is the local backend that runs
them, on the host, under the host's own GPUFLOW_HOME.

    python -m gpuflow.tasks.backends.local.remote probe        the host, as JSON
    python -m gpuflow.tasks.backends.local.remote serve        one run's claim and units
    python -m gpuflow.tasks.backends.local.remote outputs NAME  a run's outputs, as a tar
    python -m gpuflow.tasks.backends.local.remote teardown NAME
    python -m gpuflow.tasks.backends.local.remote let-go NAME   what was kept of its outputs
    python -m gpuflow.tasks.backends.local.remote reap [--dry-run]
    python -m gpuflow.tasks.backends.local.remote status

`serve` reads JSON lines on its input and answers JSON lines on its output. Its first line
asks for GPUs (`resources`, `owner`, `lease_s`, `deadline_s`); the claim is the local
backend's (one file per GPU, made with O_EXCL: atomic against every other process on the
host, whoever started it). It answers `claimed` or `busy`, then takes `renew`, `run`,
`stop` and `teardown`. The claim is a lease: when no `renew` came for `lease_s` (the
orchestrator was killed, or the network between went), or `deadline_s` passed, it stops
the units with their grace, releases the GPUs and ends. A `serve` that is itself killed
leaves a record whose process is gone: the next `serve` on the host reaps it first.

A run that ends here without its orchestrator asking (a lapsed lease, a passed deadline, a
killed `serve`) has what its job wrote set aside before its workspace goes
(GPUFLOW_HOME/fleet/kept/NAME): `outputs NAME` still gives it, the orchestrator's reap
brings it back into the run's artifacts and `let-go NAME` (or `teardown NAME`) then
removes it; one nobody came for is removed by the host's reap after KEPT_DAYS.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import queue
import shutil
import signal
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuflow.tasks import containers, nvml
from gpuflow.tasks.backends.base import LogTail
from gpuflow.tasks.backends.local.backend import LocalBackend, LocalPlacement
from gpuflow.tasks.contract import RUN_LABEL, Cluster, StopReason, UnitEnd, WorkUnit
from gpuflow.tasks.errors import CapacityError, InvalidSpec, ProvisionError
from gpuflow.tasks.host import alive, gpuflow_home, make_dirs
from gpuflow.tasks.metrics.sampler import Sampler
from gpuflow.tasks.spec import Image, JobSpec, Limits, Resources

PYTHON = "{python}"  # a unit's command naming gpuflow's interpreter: the host's own
STAGED = "{staged}"  # a unit's command naming the files staged for it: the host's folder
NEEDED = ("pydantic", "psutil", "yaml")  # what gpuflow's code on a host imports
ASKED = "teardown asked for"
SERVED_LABEL = "gpuflow.io/served"  # on the runs a `serve` claimed (not this host's own runs)
KEPT_DAYS = 7  # how long a dead run's outputs wait here for its orchestrator's reap


class Emitter:
    """JSON lines on standard output, one writer at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, **message: Any) -> None:
        text = json.dumps(message, default=str)
        with self.lock, contextlib.suppress(OSError, ValueError):  # the reader went
            sys.stdout.write(text + "\n")
            sys.stdout.flush()


def probe() -> dict[str, Any]:
    """Return what this host is: its Python, GPUs (NVML), CPUs, memory and free disk."""
    status = nvml.query()
    home = gpuflow_home()
    home.mkdir(parents=True, exist_ok=True)
    disk = shutil.disk_usage(home)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "nvml": status.available,
        "nvml_reason": status.reason,
        "driver": status.driver_version,
        "gpus": [{"index": g.index, "product": g.product} for g in status.gpus],
        "cpus": os.cpu_count() or 1,
        "memory_gib": round(pages / 2**30, 1),
        "disk_free_gib": round(disk.free / 2**30, 1),
        "home": str(home),
    }


class Served:
    """One run's claim on this host and the units it runs."""

    def __init__(self, emit: Emitter, header: dict[str, Any]) -> None:
        self.emit = emit
        self.lease_s = float(header["lease_s"])
        self.deadline = time.monotonic() + float(header.get("deadline_s") or 24 * 3600)
        self.grace_s = float(header.get("grace_s", 30.0))
        self.interval_s = float(header.get("interval_s", 1.0))
        self.backend = LocalBackend(slots=False)
        self.spec = JobSpec.model_construct(  # type: ignore[call-arg]
            name=str(header.get("job", "fleet")),
            resources=Resources.model_validate(header["resources"]),
            placement=LocalPlacement(),
            limits=Limits(),
            image=Image.model_validate(header["image"]) if header.get("image") else None,
        )
        login = header.get("registry_login") or {}
        self.login = (login.get("username"), login.get("password"))
        self.owner = {**dict(header["owner"]), SERVED_LABEL: "fleet"}
        self.counts = bool(header.get("counts", True))  # False: the fleet's scaler retiring it
        self.claimed_at = time.time()
        self.renewed = time.monotonic()
        self.units: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def claim(self) -> bool:
        """Reap what dead servers left here, then claim; say `claimed` or `busy`."""
        set_aside_orphans(self.backend, lambda _text: None)
        self.backend.reap(False, lambda _text: None, None)  # type: ignore[arg-type]
        try:
            self._pull()
            self.cluster = self.backend.provision(self.spec, self.owner)
        except CapacityError as exc:
            self._unmake()
            self.emit(busy=str(exc))
            return False
        except (ProvisionError, InvalidSpec, OSError) as exc:
            self._unmake()
            self.emit(error=str(exc))
            return False
        self.emit(
            claimed={
                "name": self.cluster.name,
                "workspace": self.cluster.workspace,
                "gpu_indices": self.cluster.gpu_indices,
                "gpu_products": self.cluster.gpu_products,
                "pid": os.getpid(),
            }
        )
        return True

    def _pull(self) -> None:
        """Pull the run's pinned image with this host's engine (the digest: what every
        host of the run runs), before anything is claimed."""
        image = self.spec.image
        if image is None:
            return
        try:
            engine = containers.find_engine()
        except InvalidSpec as exc:
            raise InvalidSpec(f"this host: {exc}") from None
        pinned = containers.pull(engine, image.pinned, lambda _line: None, self.login, image.pull)
        containers.check_architecture(pinned)

    def _unmake(self) -> None:
        """Remove what a claim that failed made (its record, its workspace)."""
        name = f"gpuflow-{self.owner[RUN_LABEL]}"
        record = self.backend._read_record(name)
        if record is not None:
            self.backend.teardown(record.cluster)

    def serve(self, messages: queue.Queue) -> str:
        """Take messages until teardown, the lease's lapse or the deadline; return why it
        ended."""
        while True:
            try:
                message = messages.get(timeout=0.2)
            except queue.Empty:
                message = None
            now = time.monotonic()
            if message is not None:
                op = message.get("op")
                if op == "renew":
                    self.renewed = now
                    self.emit(renewed=True)
                elif op == "run":
                    self.renewed = now
                    self._start(message)
                elif op == "stop":
                    self._stop(str(message["unit"]), float(message.get("grace_s", self.grace_s)))
                elif op == "teardown":
                    return self.down(ASKED)
            if now - self.renewed > self.lease_s:
                return self.down(
                    f"the lease lapsed: no renewal for {self.lease_s:.0f} s (the orchestrator"
                    " is gone, or the network to it)"
                )
            if now > self.deadline:
                return self.down("the run's deadline passed")

    def _start(self, message: dict[str, Any]) -> None:
        unit = WorkUnit.model_validate(message["unit"])
        name = str(message["id"])
        held = self.cluster.gpu_indices
        staged = str(gpuflow_home() / "fleet" / "staged")
        if unit.gpus is not None and any(not 0 <= i < len(held) for i in unit.gpus):
            self.emit(end=name, error=f"unit {unit.name} asks for GPUs {unit.gpus} of {len(held)}")
            return
        unit = unit.model_copy(
            update={
                "command": [
                    sys.executable if c == PYTHON else c.replace(STAGED, staged)
                    for c in unit.command
                ],
                # the run counts its GPUs 0..n-1 on every node; here they are the claim's
                "gpus": None if unit.gpus is None else [held[i] for i in unit.gpus],
            }
        )
        stopping = threading.Event()
        with self.lock:
            self.units[name] = {"stop": stopping, "grace_s": self.grace_s}
        threading.Thread(
            target=self._follow,
            args=(name, unit, dict(message.get("env", {})), stopping),
            name=f"unit-{name}",
            daemon=True,
        ).start()

    def _follow(
        self, name: str, unit: WorkUnit, env: dict[str, str], stopping: threading.Event
    ) -> None:
        tail = LogTail(lambda stream, text: self.emit(unit=name, stream=stream, line=text))
        gpus = self.cluster.gpu_indices if unit.gpus is None else unit.gpus
        end: UnitEnd | None = None
        try:
            handle = self.backend.start(self.cluster, unit, env, 0.0, tail)
        except (InvalidSpec, ProvisionError, OSError) as exc:
            self.emit(end=name, error=str(exc))
            return
        sample = lambda sample: self.emit(unit=name, sample=sample)  # noqa: E731
        samples = Path(self.cluster.workspace) / f".gpuflow-samples-{name}.jsonl"
        with Sampler(samples, gpus, self.interval_s, on_sample=sample):
            while end is None:
                end = handle.poll()
                if end is None and stopping.is_set():
                    end = handle.stop(StopReason.CANCELLED, self.units[name]["grace_s"])
                    break
                handle.wait(0.2)
        end = handle.finish(end)
        assert end is not None
        with self.lock:
            self.units.pop(name, None)
        self.emit(end=name, result=end.model_dump(mode="json"))

    def _stop(self, name: str, grace_s: float) -> None:
        with self.lock:
            found = self.units.get(name)
            if found is not None:
                found["grace_s"] = grace_s
                found["stop"].set()

    def down(self, why: str) -> str:
        """Stop every unit (SIGTERM, the grace, SIGKILL), release the GPUs, remove the
        workspace; say `down` with the teardown report."""
        with self.lock:
            names = list(self.units)
        for name in names:
            self._stop(name, self.grace_s)
        until = time.monotonic() + self.grace_s + 10
        while self.units and time.monotonic() < until:
            time.sleep(0.1)
        if why != ASKED:  # its orchestrator may never come for them: kept for its reap
            set_aside(self.cluster)
        report = self.backend.teardown(self.cluster)
        if self.counts:
            _used(len(self.cluster.gpu_indices), self.claimed_at)
        self.emit(down=why, report=report.model_dump(mode="json"))
        return why


def _usage_path() -> Path:
    return gpuflow_home() / "fleet" / "usage.jsonl"


def _used(gpus: int, since: float) -> None:
    """Add a claim that ended to this host's usage (what an elastic fleet's idle time and
    idle cost are counted from)."""
    path = _usage_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"gpus": gpus, "from": since, "to": time.time()})
    with path.open("a") as out:
        out.write(line + "\n")


def usage() -> dict[str, float]:
    """Return the GPU-seconds claims held on this host, and when the last one ended."""
    used, last = 0.0, 0.0
    path = _usage_path()
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                used += record["gpus"] * (record["to"] - record["from"])
                last = max(last, record["to"])
    return {"used_gpu_s": used, "last_release": last}


def serve() -> int:
    emit = Emitter()
    header = json.loads(sys.stdin.readline() or "{}")
    if not header:
        emit(error="serve: no request on standard input")
        return 2
    served = Served(emit, header)
    if not served.claim():
        return 0
    messages: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            with contextlib.suppress(ValueError):
                messages.put(json.loads(line))
        # the orchestrator's end of the connection closed: the lease decides what follows

    threading.Thread(target=read, name="requests", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: messages.put({"op": "teardown"}))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the session ending is not the lease's end
    served.serve(messages)
    return 0


def _record(name: str) -> Any:
    backend = LocalBackend(slots=False)
    return backend, backend._read_record(name)


def kept_dir() -> Path:
    return gpuflow_home() / "fleet" / "kept"


def kept_of(name: str) -> Path:
    """Return where the outputs of the run `name` are kept here (a name that is not one
    gpuflow makes is refused: it never reaches outside the kept folder)."""
    if not name.replace("-", "").replace("_", "").isalnum():
        raise InvalidSpec(f"{name!r} is not the name of a run gpuflow made")
    return kept_dir() / name


def set_aside(cluster: Cluster) -> Path | None:
    """Move what `cluster`'s job wrote out of its workspace, before the workspace goes,
    into the kept folder (a rename: no copy); return where, or None when it wrote nothing."""
    outputs = Path(cluster.workspace) / "outputs"
    if outputs.is_symlink() or not outputs.is_dir() or not any(outputs.iterdir()):
        return None
    kept = kept_of(cluster.name)
    make_dirs(kept.parent)
    shutil.rmtree(kept, ignore_errors=True)  # an older run of the same name: let go
    shutil.move(outputs, kept)
    return kept


def set_aside_orphans(backend: LocalBackend, say: Callable[[str], None]) -> None:
    """Set aside the outputs of every run a `serve` here claimed and that `serve` died (its
    reap follows), and remove kept outputs nobody came for in KEPT_DAYS."""
    for cluster in backend.list_owned({SERVED_LABEL: "fleet"}):
        owner = backend.record_of(cluster)
        if owner.orchestrator_pid and alive(owner.orchestrator_pid, owner.orchestrator_started):
            continue
        kept = set_aside(cluster)
        if kept is not None:
            say(f"kept the outputs of {cluster.name} in {kept} for its orchestrator's reap")
    folder = kept_dir()
    for kept in folder.iterdir() if folder.is_dir() else []:
        with contextlib.suppress(OSError):
            if time.time() - kept.lstat().st_mtime > KEPT_DAYS * 86400:
                shutil.rmtree(kept)
                say(f"removed {kept}: no orchestrator came for it in {KEPT_DAYS} days")


def outputs(name: str) -> int:
    """Write the run's outputs folder on this host (or what was kept of it) to standard
    output as a tar."""
    _, record = _record(name)
    kept = kept_of(name)
    if record is None and not kept.is_dir():
        print(f"no run {name} on this host", file=sys.stderr)
        return 1
    folder = kept if record is None else Path(record.cluster.workspace) / "outputs"
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        if folder.is_dir():
            tar.add(folder, arcname=".")
    sys.stdout.buffer.write(data.getvalue())
    return 0


def teardown(name: str) -> int:
    """Stop the run's server here (its units and claim with it) and tear down what is left,
    what was kept of its outputs too."""
    backend, record = _record(name)
    shutil.rmtree(kept_of(name), ignore_errors=True)
    if record is None:
        print(json.dumps({"already_gone": True}))
        return 0
    if record.orchestrator_pid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(record.orchestrator_pid, signal.SIGKILL)
    report = backend.teardown(record.cluster)
    print(report.model_dump_json())
    return 0


def reap(dry_run: bool) -> int:
    """Tear down runs whose server here died; print what was (or would be) reaped."""
    said: list[str] = []
    backend = LocalBackend(slots=False)
    if not dry_run:
        set_aside_orphans(backend, said.append)
    report = backend.reap(dry_run, said.append, None)  # type: ignore[arg-type]
    print(json.dumps({"said": said, "counts": report.counts}))
    return 0


def status() -> int:
    """Print the runs that hold GPUs here, with their server's process."""
    backend = LocalBackend(slots=False)
    runs = []
    for cluster in backend.list_owned({}):
        record = backend.record_of(cluster)
        runs.append(
            {
                "name": cluster.name,
                "gpus": cluster.gpu_indices,
                "server_alive": bool(
                    record.orchestrator_pid
                    and alive(record.orchestrator_pid, record.orchestrator_started)
                ),
                "units": len(record.jobs),
            }
        )
    print(json.dumps({"host": probe(), "runs": runs, "usage": usage()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuflow.tasks.backends.local.remote")
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("probe")
    verbs.add_parser("serve")
    verbs.add_parser("status")
    verbs.add_parser("outputs").add_argument("name")
    verbs.add_parser("teardown").add_argument("name")
    verbs.add_parser("let-go").add_argument("name")
    verbs.add_parser("reap").add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.verb == "probe":
        print(json.dumps(probe()))
        return 0
    if args.verb == "serve":
        return serve()
    if args.verb == "outputs":
        return outputs(args.name)
    if args.verb == "teardown":
        return teardown(args.name)
    if args.verb == "let-go":
        shutil.rmtree(kept_of(args.name), ignore_errors=True)
        print(json.dumps({"let_go": args.name}))
        return 0
    if args.verb == "reap":
        return reap(args.dry_run)
    return status()


if __name__ == "__main__":
    sys.exit(main())
