"""This host: gpuflow's state folder, whole-or-nothing writes, programs on PATH, and
stopping a process group (SIGTERM, a grace, SIGKILL) without killing a reused pid."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from pydantic import BaseModel

STOP_GRACE_S = 30.0


def gpuflow_home() -> Path:
    """Return gpuflow's state folder ($GPUFLOW_HOME, default ~/.gpuflow)."""
    return Path(os.environ.get("GPUFLOW_HOME", Path.home() / ".gpuflow"))


def resolve_program(program: str, path: str | None = None) -> str | None:
    """Return the absolute path of `program` (a name on PATH or a path), or None."""
    if "/" in program:
        candidate = Path(program).expanduser().absolute()
        return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None
    return shutil.which(program, path=path)


def alive(pid: int, started: float | None) -> bool:
    """Return True when `pid` runs and, given its create time `started`, is that process."""
    try:
        proc = psutil.Process(pid)
        return started is None or abs(proc.create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False


def write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary sibling named after this process
    (`.NAME.PID.tmp`, so sweep_partial_writes can tell a dead writer's), then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def sweep_partial_writes(folder: Path) -> list[Path]:
    """Remove write_atomic's temporary files in `folder` whose writer no longer runs."""
    swept = []
    for path in folder.glob(".*.tmp") if folder.is_dir() else ():
        pid = path.name.rsplit(".", 2)[-2]
        if not pid.isdigit() or not psutil.pid_exists(int(pid)):
            path.unlink(missing_ok=True)
            swept.append(path)
    return swept


def escalate(
    term: Callable[[], None],
    kill: Callable[[], None],
    running: Callable[[], bool],
    grace_s: float,
    kill_wait_s: float = 5.0,
) -> None:
    """Stop something the way every gpuflow job is stopped: `term()` (SIGTERM), up to
    `grace_s` for it to save its state and exit, then `kill()` (SIGKILL) if it still
    `running()`, and up to `kill_wait_s` for that to take. Polls: the caller may still
    reap its own child and read its exit status."""
    term()
    _wait_while(running, grace_s)
    if running():
        kill()
        _wait_while(running, kill_wait_s)


def _wait_while(running: Callable[[], bool], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_group(pgid: int, started: float | None, grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM the process group, wait up to `grace_s`, then SIGKILL; return how many died."""
    members = [p for p in psutil.process_iter() if _pgid(p.pid) == pgid]
    if started is not None and not alive(pgid, started):
        return 0  # the pid was reused by something else: not ours to kill

    def signal_group(number: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, number)

    escalate(
        lambda: signal_group(signal.SIGTERM),
        lambda: signal_group(signal.SIGKILL),
        lambda: _running(members),
        grace_s,
    )
    return len(members)


def _running(members: list[psutil.Process]) -> bool:
    for proc in members:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def start_time(proc: psutil.Process) -> float:
    """Return when `proc` started on time.time()'s clock. psutil counts from the boot time
    the kernel gives in whole seconds, so its create_time may read up to a second early;
    /proc/uptime, where there is one, gives the boot time to a hundredth of a second."""
    return proc.create_time() + _boot_correction()


def _boot_correction() -> float:
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, (time.time() - uptime) - psutil.boot_time())


class Orchestrator(BaseModel):
    """The gpuflow process that runs a run, as a reaper identifies it: host, pid, start time."""

    host: str = ""
    pid: int = 0
    started: float | None = None

    def dead_here(self) -> bool:
        """Return True when it ran on this host and no longer runs."""
        return self.host == socket.gethostname() and not alive(self.pid, self.started)


def this_process() -> Orchestrator:
    """Return this process as an Orchestrator."""
    return Orchestrator(
        host=socket.gethostname(), pid=os.getpid(), started=psutil.Process().create_time()
    )
