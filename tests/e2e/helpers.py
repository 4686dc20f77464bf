"""What the end-to-end tests check on the OS and in the Prefect API after a run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import psutil

from gpuflow.tasks.backends.local import gpu_slots
from gpuflow.tasks.platform.api import auth_headers

ROOT = Path(__file__).resolve().parents[2]


def leftovers(home: Path) -> dict[str, list[str]]:
    """Return whatever gpuflow state is left under `home`: workspaces, records, GPU claims."""

    def names(folder: Path) -> list[str]:
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    return {
        "workspaces": names(home / "workspaces"),
        "records": names(home / "local" / "clusters"),
        "gpu_claims": names(home / "local" / "gpus"),
        "in_flight": names(home / "inflight"),
    }


NOTHING_LEFT = {"workspaces": [], "records": [], "gpu_claims": [], "in_flight": []}


def nothing_left(home: Path) -> bool:
    return not any(leftovers(home).values())


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def gpu_slots_in_use() -> int | None:
    return gpu_slots.slots_in_use()


def flow_run(flow_run_id: UUID | str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(str(flow_run_id)))


def artifacts_of(flow_run_id: UUID | str) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))])),
            artifact_filter=ArtifactFilter(),
        )
    return {a.key: a for a in found}


def logs_of(flow_run_id: UUID | str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(str(flow_run_id))])),
            limit=200,
        )
    return [log.message for log in logs]


def task_runs_of(flow_run_id: UUID | str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))]))
        )


class Platform:
    def __init__(self, home: Path, port: int) -> None:
        self.home, self.port = home, port
        self.api, self.ui = f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env.update(GPUFLOW_HOME=str(home), PREFECT_API_URL=self.api)
        self.prefect_home = home.parent / f"{home.name}-prefect"  # its profiles.toml
        self.env.update(PREFECT_HOME=str(self.prefect_home))
        self.env.update(PREFECT_UI_URL=self.ui, PREFECT_SERVER_ANALYTICS_ENABLED="false")
        self.env.pop("CUDA_VISIBLE_DEVICES", None)

    @property
    def auth(self) -> str | None:
        """Return the platform's auth string (`platform up` makes it), or None before."""
        path = self.home / "platform" / "auth"
        return path.read_text().strip() if path.is_file() else None

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run a program as a user who exported what `platform up` says (URL, auth)."""
        env = {**self.env, "PREFECT_API_AUTH_STRING": self.auth} if self.auth else self.env
        return subprocess.run(
            list(argv), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )

    def as_user(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run `gpuflow ARGV` as the platform's user with no Prefect setting of their own:
        gpuflow finds the platform (its URL, auth string and certificate) by itself."""
        return subprocess.run(
            [sys.executable, "-m", "gpuflow", *argv],
            env={k: v for k, v in self.env.items() if not k.startswith("PREFECT_")},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def gpuflow(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-m", "gpuflow", *argv, timeout=timeout)

    def client(self):
        from prefect.client.orchestration import get_client

        class _Client:
            def __enter__(inner):
                inner.settings = self.settings()
                inner.settings.__enter__()
                inner.client = get_client(sync_client=True)
                return inner.client.__enter__()

            def __exit__(inner, *exc):
                inner.client.__exit__(*exc)
                inner.settings.__exit__(*exc)

        return _Client()

    def settings(self):
        """Return a settings context pointing Prefect at the platform, with its auth."""
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        return temporary_settings({PREFECT_API_URL: self.api, PREFECT_API_AUTH_STRING: self.auth})

    def final_state(self, flow_run_id: str, seconds: float):
        """Return the run's state once it is final, or the last one seen after `seconds`."""
        until, state = time.monotonic() + seconds, None
        while time.monotonic() < until:
            with self.client() as client:
                state = client.read_flow_run(UUID(str(flow_run_id))).state
            if state is not None and state.is_final():
                break
            time.sleep(0.5)
        return state

    def state(self) -> dict:
        return json.loads((self.home / "platform" / "state.json").read_text())

    def sql(self, query: str) -> list[str]:
        """Run `query` on the platform's PostgreSQL database (as its login, over TCP, the
        way the Prefect server connects); return the rows, fields joined by |."""
        from gpuflow.tasks.platform import postgres

        database = self.state()["database"]
        password = (self.home / "platform" / "postgres.password").read_text().strip()
        argv = [str(postgres.programs() / "psql"), "-h", "127.0.0.1", "-p", str(database["port"])]
        argv += ["-U", postgres.USER, "-d", postgres.DATABASE, "-A", "-t", "-c", query]
        done = subprocess.run(
            argv, env={**self.env, "PGPASSWORD": password}, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()


def purge_database(platform: Platform) -> None:
    """Remove a PostgreSQL data folder the platform kept outside its GPUFLOW_HOME (a root
    run with a home the postgres account cannot enter keeps it under /var/lib/gpuflow)."""
    from gpuflow.tasks.platform import postgres

    folder = postgres.SHARED_ROOT
    for data in folder.glob("*/postgres") if folder.is_dir() else []:
        marker = data.parent / "home"
        if marker.is_file() and marker.read_text().strip() == str(
            (platform.home / "platform").resolve()
        ):
            shutil.rmtree(data.parent, ignore_errors=True)


def events_named(name: str, resource_id: str, wait_s: float = 30.0) -> list[dict]:
    """Return the events called `name` about `resource_id` the Prefect server holds, once
    at least one has arrived (events travel through a background worker)."""
    import time

    import httpx
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

    EventsWorker.drain_all()
    body = {
        "filter": {
            "event": {"name": [name]},
            "any_resource": {"id": [resource_id]},
            "occurred": {"since": "2000-01-01T00:00:00Z"},
        },
        "limit": 50,
    }
    deadline = time.monotonic() + wait_s
    while True:
        answer = httpx.post(
            f"{PREFECT_API_URL.value()}/events/filter",
            json=body,
            timeout=10,
            headers=auth_headers(PREFECT_API_AUTH_STRING.value()),
        )
        answer.raise_for_status()
        found = answer.json()["events"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


# What another local user tries against a user's API and GPUFLOW_HOME: stdlib only, run
# as `nobody` by a test that runs as root (CI does); each probe's answer as one word.
OUTSIDER = r"""
import json, sys, urllib.error, urllib.request
home, api, secret_file = sys.argv[1:4]
found = {}
def answer(name, path, body=None, host=None, auth=None):
    request = urllib.request.Request(api + path, data=body, method="POST" if body else "GET")
    request.add_header("Content-Type", "application/json")
    if host:
        request.add_header("Host", host)
    if auth:
        request.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            found[name] = response.status
    except urllib.error.HTTPError as exc:
        found[name] = exc.code
for name, path in [("control", home + ".control"), ("home", home), ("secret", secret_file)]:
    try:
        __import__("os").listdir(path) if name == "home" else open(path).read()
        found[name] = "read"
    except PermissionError:
        found[name] = "denied"
answer("secrets", "/block_documents/filter", b'{"include_secrets": true}')
answer("deployments", "/deployments/filter", b"{}")
answer("guessed", "/deployments/filter", b"{}", auth="Basic Z3B1Zmxvdzp4")
answer("rebound", "/health", host="attacker.example")
print(json.dumps(found))
"""


def outsider(home: Path, api: str, secret_file: Path) -> dict:
    """Return what `nobody` got from `api`, GPUFLOW_HOME and the auth string's file. A
    world-readable control file beside the home must be readable to nobody, or the probe
    proves nothing (a parent folder nobody cannot enter)."""
    control = home.with_name(home.name + ".control")
    control.write_text("anyone may read this\n")
    control.chmod(0o644)
    done = subprocess.run(
        ["/usr/bin/python3", "-c", OUTSIDER, str(home), api, str(secret_file)],
        user=65534,
        group=65534,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


SHUT_OUT = {
    "control": "read",
    "home": "denied",
    "secret": "denied",
    "secrets": 401,
    "deployments": 401,
    "guessed": 401,
    "rebound": 421,
}


def shared_folder(prefix: str) -> Path:
    """Return a new folder under /tmp that every local user may enter (as a home's parent
    is on a shared machine): pytest's own base folder is 0700, which would hide a home from
    another user whatever its own modes."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    return folder


def wider_than_private(folder: Path) -> list[str]:
    """Return every file under `folder` that another user could read or enter (mode)."""
    wide = []
    for path in [folder, *folder.rglob("*")]:
        info = path.lstat()
        if not path.is_symlink() and info.st_mode & 0o077:
            wide.append(f"{path} {oct(info.st_mode & 0o777)}")
    return wide


# -- preempting a training at a known step ---------------------------------------------
#
# A preemption (a spot notice, Slurm's urgent job) takes seconds to reach a job; how many
# steps a training makes meanwhile depends on the machine's load. A test that holds the
# ranks (SIGSTOP) at a step, lets the preemption come and continues them (SIGCONT) once its
# SIGTERM waits for them, knows where they stop without giving them hundreds of steps to
# spare: the ranks then handle the SIGTERM as they would any other.

TRAINING_RANK = "gpuflow.tasks.training.entry"
TORCHRUN = "torch.distributed.run"


def training_ranks(under: Path) -> list[psutil.Process]:
    """Return the training ranks (torchrun's children) running in a working folder under
    `under`; not their data loaders, forked with the rank's command."""
    found = []
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        if TRAINING_RANK not in (proc.info["cmdline"] or []):
            continue
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            parent = psutil.Process(proc.info["ppid"]).cmdline()
            if TORCHRUN in parent and Path(proc.cwd()).is_relative_to(under):
                found.append(proc)
    return found


def hold_ranks_at(
    under: Path, step: int, ranks: int = 1, seconds: float = 240
) -> tuple[list[psutil.Process], int]:
    """Stop (SIGSTOP) the `ranks` training ranks under `under` once the first of them has
    logged `step` (its outputs/train_metrics.jsonl); return them, stopped, and the last
    step logged."""
    until = time.monotonic() + seconds
    while True:  # a rank that ends before the hold (an earlier run's, winding down): look again
        found: list[psutil.Process] = []
        while len(found) != ranks:
            assert time.monotonic() < until, f"{len(found)} training rank(s) found, not {ranks}"
            found = training_ranks(under)
            time.sleep(0.1)
        try:
            metrics = Path(found[0].cwd()) / "outputs" / "train_metrics.jsonl"
        except psutil.NoSuchProcess:
            continue
        while _last_step(metrics) < step and all(p.is_running() for p in found):
            assert time.monotonic() < until, f"the training did not reach step {step}"
            time.sleep(0.02)
        if all(p.is_running() for p in found):
            break
    for proc in found:
        proc.send_signal(signal.SIGSTOP)
    # stopped only once each has taken its SIGSTOP: a SIGTERM sent before that would be
    # handled first (lower signals go first) and never wait for release_when_signalled
    while not all((_status(p.pid) or {}).get("State", "T").startswith("T") for p in found):
        assert time.monotonic() < until, "the training ranks did not stop on SIGSTOP"
        time.sleep(0.005)
    return found, _last_step(metrics)


def release_when_signalled(held: list[psutil.Process], seconds: float = 240) -> None:
    """Continue (SIGCONT) each held rank once SIGTERM waits for it (the preemption reached
    it), or at once when something else continued it or it ended."""
    until, waiting = time.monotonic() + seconds, list(held)
    try:
        while waiting:
            if time.monotonic() > until:
                states = {p.pid: (_status(p.pid) or {}).get("State") for p in waiting}
                raise AssertionError(f"no SIGTERM reached the held training ranks: {states}")
            for proc in list(waiting):
                status = _status(proc.pid)
                if status is None or not status["State"].startswith("T"):
                    waiting.remove(proc)  # ended, or continued by its scheduler (Slurm does)
                elif _pending(status) & (1 << (signal.SIGTERM - 1)):
                    proc.send_signal(signal.SIGCONT)
                    waiting.remove(proc)
            time.sleep(0.02)
    finally:
        for proc in waiting:  # never leave a rank stopped
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)


def _last_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    for line in reversed(lines):
        with contextlib.suppress(ValueError, KeyError):
            return int(json.loads(line)["step"])
    return 0


def _status(pid: int) -> dict[str, str] | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _pending(status: dict[str, str]) -> int:
    """Return the signals waiting for the process (its threads' and its own), as a mask."""
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


@contextlib.contextmanager
def command_lines_seen() -> Iterator[set[str]]:
    """Yield a set that fills with every command line on this machine while the body runs
    (a secret must appear on none)."""
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for proc in psutil.process_iter(["cmdline"]):
                seen.add(" ".join(proc.info["cmdline"] or []))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join()


SQUAT = """
import socket, sys
port = int(sys.argv[1])
for address, family in (("127.0.0.1", socket.AF_INET), ("0.0.0.0", socket.AF_INET), ("::", socket.AF_INET6)):
    squatter = socket.socket(family)
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        squatter.bind((address, port))
        squatter.listen()
        print(f"took {address}:{port}")
    except OSError:
        pass
    squatter.close()
"""


def squatted(port: int) -> list[str]:
    """Return what `nobody` could bind and listen on of `port` (loopback, the wildcards):
    a squatter there would receive what gpuflow's clients send to the port."""
    done = subprocess.run(
        ["/usr/bin/python3", "-c", SQUAT, str(port)],
        user=65534, group=65534, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def gpuflow(capsys, *argv: str) -> tuple[int, str, str]:
    """`gpuflow ARGV` in this process (the test's Prefect API and GPUFLOW_HOME): its exit
    code, standard output and standard error."""
    from gpuflow.cli import main

    capsys.readouterr()
    code = main(list(argv))
    said = capsys.readouterr()
    return code, said.out, said.err
