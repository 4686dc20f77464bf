"""This host: gpuflow's state folder, whole-or-nothing writes, programs on PATH, reading a
child's output, and stopping a process group (SIGTERM, a grace, SIGKILL) without killing a
reused pid."""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

import psutil
from pydantic import BaseModel

from tasks.errors import InvalidSpec

STOP_GRACE_S = 30.0
# How long a child's pipes are still read after the child ended: what it wrote last is
# at most a pipe's buffer; a process it left behind that holds a pipe open is not waited on.
OUTPUT_DRAIN_S = 2.0


def gpuflow_home() -> Path:
    """Return gpuflow's state folder ($GPUFLOW_HOME, default ~/.gpuflow)."""
    return Path(os.environ.get("GPUFLOW_HOME") or Path.home() / ".gpuflow").expanduser().absolute()


def env_number(name: str, default: float, low: float, high: float) -> float:
    """Return the number in the environment variable `name` (`default` when unset); one
    sentence naming the variable when it is not a number from `low` to `high`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidSpec(
            f"{name}: {text[:40]!r} is not a number from {low:g} to {high:g}; unset it (the"
            f" default is {default:g}) or fix it."
        )
    return value


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


class OutputPump:
    """Reads a child's pipes (stdout, stderr) on one thread, in blocks, and hands each
    line to `on_line(stream, line)`. A job that starts a process in a session of its own
    hands that process its pipes: `finish()` reads what is left once the child ended, but
    never waits on a pipe longer than `drain_s`, so such a process can not hold the end of
    a run (teardown stops it)."""

    def __init__(
        self, streams: Mapping[str, IO[bytes]], on_line: Callable[[str, str], None]
    ) -> None:
        self._streams = dict(streams)
        self._on_line = on_line
        self._until: float | None = None
        self.held: list[str] = []  # the pipes still open when reading stopped
        self._thread = threading.Thread(target=self._pump, daemon=True, name="output")

    def start(self) -> OutputPump:
        self._thread.start()
        return self

    def finish(self, drain_s: float = OUTPUT_DRAIN_S) -> list[str]:
        """Read until every pipe is closed or `drain_s` has passed; return the pipes a
        process outside the child still held open."""
        self._until = time.monotonic() + drain_s
        self._thread.join()
        return self.held

    def _pump(self) -> None:
        selector = selectors.DefaultSelector()
        partial: dict[str, bytes] = {}
        for name, stream in self._streams.items():
            selector.register(stream.fileno(), selectors.EVENT_READ, name)
            partial[name] = b""
        try:
            while selector.get_map():
                if self._until is not None and time.monotonic() >= self._until:
                    break
                for key, _ in selector.select(timeout=0.1):
                    block = os.read(key.fd, 1 << 16)
                    if not block:
                        selector.unregister(key.fd)
                        continue
                    *lines, partial[key.data] = (partial[key.data] + block).split(b"\n")
                    for raw in lines:
                        self._on_line(key.data, raw.decode(errors="replace"))
        finally:
            self.held = sorted(key.data for key in selector.get_map().values())
            selector.close()
            for name, rest in partial.items():
                if rest:
                    self._on_line(name, rest.decode(errors="replace"))
            for stream in self._streams.values():
                stream.close()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While a job is being stopped after an interruption, a second SIGINT or SIGTERM is
    absorbed (with one line), so that the stop keeps the job's grace and runs once.
    Only the main thread handles signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def absorb(signum: int, frame: object) -> None:
        print(
            "[gpuflow] already stopping: the job gets its grace period, then teardown runs",
            file=sys.stderr,
            flush=True,
        )

    previous = {s: signal.signal(s, absorb) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
