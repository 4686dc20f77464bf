"""This host: gpuflow's state folder, whole-or-nothing writes, programs on PATH, reading a
child's output, and stopping a process group (SIGTERM, a grace, SIGKILL) without killing a
reused pid."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import selectors
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import psutil
from pydantic import BaseModel

from gpuflow.tasks.errors import GpuflowError, InvalidSpec

STOP_GRACE_S = 30.0
# How long a child's pipes are still read after the child ended: what it wrote last is
# at most a pipe's buffer; a process it left behind that holds a pipe open is not waited on.
OUTPUT_DRAIN_S = 2.0


def gpuflow_home() -> Path:
    """Return gpuflow's state folder ($GPUFLOW_HOME, default ~/.gpuflow)."""
    return Path(os.environ.get("GPUFLOW_HOME") or Path.home() / ".gpuflow").expanduser().absolute()


# Secrets gpuflow itself put into this process's environment (a server's auth string for
# Prefect's clients): a job started from here never inherits them.
OWN_SECRETS: set[str] = set()


# Prefect's credentials: the key to every block and run of the API. A job never gets them
# (the platform's worker hands them to the flow runs it starts, and so to their jobs).
API_CREDENTIALS = frozenset({"PREFECT_API_AUTH_STRING", "PREFECT_API_KEY"})


def job_environ() -> dict[str, str]:
    """Return this process's environment as a job inherits it: without the secrets gpuflow
    put there for itself, and without the Prefect API's credentials."""
    return {
        k: v for k, v in os.environ.items() if v not in OWN_SECRETS and k not in API_CREDENTIALS
    }


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


def same_process(pid: int, started: float) -> bool:
    """Return True when `pid` exists (a zombie too) and is the process created at `started`."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.NoSuchProcess:
        return False


def alive(pid: int, started: float | None) -> bool:
    """Return True when `pid` runs and, given its create time `started`, is that process.
    A zombie (ended, its parent has not collected it) does not run."""
    try:
        proc = psutil.Process(pid)
        same = started is None or abs(proc.create_time() - started) < 1.0
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all, readable by this user alone (0600): a temporary
    sibling named after this process (`.NAME.PID.tmp`, so sweep_partial_writes can tell a
    dead writer's), then a rename."""
    make_dirs(path.parent, private=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: never through a link someone left there
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "w") as out:
            out.write(text)
        tmp.replace(path)
    except BaseException as exc:  # a full disk: no half-written sibling stays behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(exc.errno, path.parent, len(text.encode())) from None
        raise


class NoSpace(GpuflowError, OSError):
    """A disk gpuflow writes to is full (or its quota spent): one sentence naming the folder
    and what the write needed; still an OSError to every `except OSError`."""

    def __init__(self, code: int, folder: Path, needed: int) -> None:
        super().__init__(code, os.strerror(code))
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = 0
        spent = "its quota is spent" if code == errno.EDQUOT else f"{free:,} bytes free"
        self.sentence = (
            f"the disk of {folder} is full ({spent}; gpuflow needed {needed:,} bytes to write"
            " its record there); free space on it, or point GPUFLOW_HOME at a disk with room"
        )

    def __str__(self) -> str:
        return self.sentence

    def __reduce__(self) -> Any:  # pickled into a Prefect state: the sentence stays
        return (_no_space, (self.errno, self.sentence))


def _no_space(code: int, sentence: str) -> NoSpace:
    made = NoSpace.__new__(NoSpace)
    OSError.__init__(made, code, os.strerror(code))
    made.sentence = sentence
    return made


class StateFileError(GpuflowError):
    """One of gpuflow's own state files is not a plain file this user owns."""


def read_private(path: Path, limit: int = 1 << 20) -> str:
    """Return the text of one of gpuflow's own state files. A FIFO, a device, a link or a
    folder where the file should be is refused in one sentence (opened without blocking,
    its type checked before a byte is read), and so is a file over `limit` bytes;
    FileNotFoundError when there is none."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateFileError(
                f"{path} is a symbolic link, not gpuflow's own file; remove it (gpuflow makes"
                " it anew)."
            ) from None
        raise
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise StateFileError(
            f"{path} is not a regular file (a FIFO, device or folder stands there);"
            " remove it (gpuflow makes it anew)."
        )
    with os.fdopen(descriptor, "rb") as handle:
        if info.st_uid != os.geteuid():
            raise StateFileError(
                f"{path} belongs to uid {info.st_uid}, not to you; remove it (gpuflow makes"
                " it anew)."
            )
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise StateFileError(f"{path} is over {limit} bytes: not gpuflow's; remove it.")
    return data.decode("utf-8", errors="replace")


def read_state_json(path: Path) -> dict | None:
    """Return the JSON object in one of gpuflow's state files; None when there is none, or
    it is half-written or not an object; StateFileError (one sentence) when something other
    than a plain file of this user's stands there."""
    try:
        found = json.loads(read_private(path))
    except (FileNotFoundError, ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None


def state_records(
    folder: Path, pattern: str = "*.json", skipped: Callable[[str], None] | None = None
) -> Iterator[tuple[Path, dict]]:
    """Yield each of gpuflow's state files in `folder` matching `pattern` with its JSON
    object, in name order; one that is half-written is passed over, and one that is not a
    plain file of this user's (a FIFO, a device, a link planted there) is passed over and
    named to `skipped` (else to stderr), so it stops no reader of the others."""
    for path in sorted(folder.glob(pattern)) if folder.is_dir() else []:
        try:
            found = read_state_json(path)
        except (StateFileError, OSError) as exc:
            said = f"passed over {path}: {exc}" if isinstance(exc, StateFileError) else str(exc)
            (skipped or (lambda text: print(f"gpuflow: {text}", file=sys.stderr)))(said)
            continue
        if found is not None:
            yield path, found


def make_dirs(path: Path, private: bool | None = None) -> Path:
    """Make `path` and its missing parents, and return it. Private (0700, each folder made,
    not only the last: Path.mkdir gives parents the default mode) when `private` is True,
    or when None and `path` lies in GPUFLOW_HOME; else with the user's umask."""
    if private is None:
        private = path.absolute().is_relative_to(gpuflow_home())
    if not private:
        path.mkdir(parents=True, exist_ok=True)
        return path
    missing = []
    for folder in [path, *path.parents]:
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            folder.mkdir(mode=0o700)
    return path


def private_dir(path: Path) -> Path:
    """Make `path` (and missing parents) a folder this user alone may enter (0700), and
    return it. One that exists with wider modes is narrowed; one that is not this user's
    (or not a folder) is refused in one sentence."""
    if not path.is_symlink() and not path.exists():
        make_dirs(path, private=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise StateFileError(f"{path} is not a folder; remove it or point GPUFLOW_HOME elsewhere.")
    if info.st_uid != os.geteuid():
        raise StateFileError(
            f"{path} belongs to uid {info.st_uid}, not to you: another user could read your"
            " runs and secrets there; point GPUFLOW_HOME at a folder of your own."
        )
    if info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def secure_home() -> Path:
    """Return GPUFLOW_HOME, made (or narrowed to) a folder this user alone may enter: it
    holds runs, logs, keys and outputs. One sentence when it cannot be used."""
    home = gpuflow_home()
    try:
        return private_dir(home)
    except OSError as exc:
        raise StateFileError(
            f"GPUFLOW_HOME {home} cannot be used ({exc.strerror or exc}); free space there,"
            " make it writable, or point GPUFLOW_HOME at another folder."
        ) from None


def open_private(path: Path, append: bool = True) -> IO[bytes]:
    """Open a log file of gpuflow's for writing, 0600 (created so, never through a link)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if append else os.O_TRUNC
    descriptor = os.open(path, flags, 0o600)
    return os.fdopen(descriptor, "ab" if append else "wb")


def auth_string(path: Path) -> str:
    """Return the Prefect API auth string kept in `path` (0600), made the first time: a
    user name and 32 random bytes, `gpuflow:<token>`."""
    with contextlib.suppress(FileNotFoundError):
        text = read_private(path).strip()
        if text:
            return text
    import secrets

    write_atomic(path, f"gpuflow:{secrets.token_urlsafe(32)}\n")
    return read_private(path).strip()


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
    if started is not None and not same_process(pgid, started):
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
        self, streams: Mapping[str, IO[bytes] | None], on_line: Callable[[str, str], None]
    ) -> None:
        self._streams = {name: s for name, s in streams.items() if s is not None}
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
def _stop_signals_to(handler: Callable[[int, object], None]) -> Iterator[bool]:
    """Send SIGINT and SIGTERM to `handler` while the body runs, then put the handlers back;
    yield whether it could (only the main thread handles signals; elsewhere: nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield True
    finally:
        for signum, former in previous.items():
            signal.signal(signum, former)


@contextlib.contextmanager
def signals_held(what: str) -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the body runs (work that must not be cut short); the
    first that arrived meanwhile is delivered, to the handler it would have met, once the
    body has ended."""
    arrived: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if not arrived:
            print(f"[gpuflow] stopping once {what} is done", file=sys.stderr, flush=True)
        arrived.append(signum)

    try:
        with _stop_signals_to(hold):
            yield
    finally:
        if arrived:
            signal.raise_signal(arrived[0])


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While a job is being stopped after an interruption, a second SIGINT or SIGTERM is
    absorbed (with one line), so that the stop keeps the job's grace and runs once."""

    def absorb(signum: int, frame: object) -> None:
        print(
            "[gpuflow] already stopping: the job gets its grace period, then teardown runs",
            file=sys.stderr,
            flush=True,
        )

    with _stop_signals_to(absorb):
        yield


def dies_with_parent(sig: int = 15) -> Callable[[], None]:
    """Return a preexec_fn for subprocess.Popen: the child gets `sig` (SIGTERM) when the
    thread that started it ends, the whole process SIGKILLed included (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return lambda: None
    return lambda: prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
