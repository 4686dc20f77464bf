"""Cgroups of its own for each job, where this machine lets gpuflow make them: one cgroup
v2 and, on a host with cgroup v1 hierarchies (v1 or hybrid), one in each of those that
only count or freeze processes (pids, freezer): a job that leaves one is still in another.

Whatever a job does to its session, process group or environment, its processes stay in
its cgroups, so teardown finds them all; only a process running as root can move itself
out of every one (ESCAPE says so in the teardown report). Where cgroups cannot be made
(no mount, no permission), `create` returns none and the local backend falls back to
process groups, the environment and the working directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from gpuflow.tasks.host import escalate


def _mount() -> Path | None:
    """Return where the cgroup2 hierarchy is mounted, or None."""
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return Path(fields[1])
    return None


def _own() -> str:
    """Return this process's cgroup2 path ("/..." from the "0::" line)."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as lines:
        for line in lines:
            if line.startswith("0::"):
                return line[3:].strip()
    return "/"


def _parent() -> Path | None:
    """Return the folder job cgroups are made in: beside this process's own cgroup (a
    cgroup that holds processes cannot have children with processes once controllers are
    on, cgroup v2's "no internal processes" rule), or None without a cgroup2 mount."""
    mount = _mount()
    if mount is None:
        return None
    own = mount / _own().lstrip("/")
    return own.parent if own != mount else mount


# The v1 hierarchies a job is tracked in: joining them limits nothing.
V1_TRACKERS = ("pids", "freezer")
ESCAPE = "a job running as root can still move itself out of every cgroup it was put in"


def _parents() -> list[Path]:
    """Return the folders job cgroups are made in: beside this process's cgroup v2 (first),
    and this process's place in each v1 tracking hierarchy there is (a hybrid host has
    both; a process root moves out of one is still in the others)."""
    parent = _parent()
    found = [_v1(controller) for controller in V1_TRACKERS]
    v1 = [mount / own.lstrip("/") for mount, own in filter(None, found)]
    return ([parent] if parent is not None else []) + v1


def is_v2(path: str | Path) -> bool:
    """Return True for a cgroup of the v2 hierarchy (only it has cgroup.controllers)."""
    return (Path(path) / "cgroup.controllers").exists()


def create(name: str) -> list[Path]:
    """Return the cgroups named `name` this job is tracked in (made if missing): its cgroup
    v2 first where there is one, then one per v1 tracking hierarchy; none when this
    machine does not allow it."""
    made = [_make(parent / name, {}) for parent in _parents() if parent.is_dir()]
    return [path for path in made if path is not None]


def _make(path: Path, settings: dict[str, str]) -> Path | None:
    """Make the cgroup at `path` with `settings` (file -> value; a file this kernel lacks
    is skipped) and return it, or None (removed again) when this process may not use it."""
    try:
        path.mkdir(exist_ok=True)
        for file, value in settings.items():
            with contextlib.suppress(FileNotFoundError):
                (path / file).write_text(value)
        if not os.access(path / "cgroup.procs", os.W_OK):
            raise PermissionError(path)
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        return None
    return path


def _v1(controller: str) -> tuple[Path, str] | None:
    """Return where cgroup v1's `controller` hierarchy is mounted and this process's place
    in it, or None (a pure cgroup v2 machine, or none)."""
    mount = None
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 3 and fields[2] == "cgroup" and controller in fields[3].split(","):
                mount = Path(fields[1])
    if mount is None:
        return None
    own = "/"
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as lines:
        for line in lines:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3 and controller in parts[1].split(","):
                own = parts[2]
    return mount, own


def limit_memory(name: str, v2_cgroup: str | None, limit_bytes: int) -> str | None:
    """Hold a job to `limit_bytes` of memory (no swap beyond it) and return the cgroup
    whose events count its out-of-memory kills: the job's v2 cgroup where its hierarchy
    has the memory controller, else a v1 memory cgroup named `name` (the job joins it
    too); None where neither can be made."""
    if v2_cgroup and (Path(v2_cgroup) / "memory.max").exists():
        try:
            (Path(v2_cgroup) / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (Path(v2_cgroup) / "memory.swap.max").write_text("0")
            return v2_cgroup
        except OSError:
            return None
    found = _v1("memory")
    if found is None:
        return None
    mount, own = found
    if not (mount / own.lstrip("/")).is_dir():
        return None
    settings = {"memory.limit_in_bytes": str(limit_bytes), "memory.swappiness": "0"}
    path = _make(mount / own.lstrip("/") / name, settings)
    if path is not None and not (path / "memory.limit_in_bytes").is_file():
        path.rmdir()  # no such limit here: a cgroup that would not hold the job
        return None
    return str(path) if path else None


def memory_events(path: str | Path | None) -> dict[str, int]:
    """Return a cgroup's memory event counts (v2 memory.events, v1 memory.oom_control):
    `oom_kill` is how many of its processes the out-of-memory killer ended."""
    if not path:
        return {}
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (Path(path) / name).read_text()
        except OSError:
            continue
        events = {}
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                events[key] = int(value)
        return events
    return {}


def join(path: str) -> None:
    """Move the calling process into the cgroup at `path` (for a child, before exec)."""
    with open(Path(path) / "cgroup.procs", "w") as procs:
        procs.write("0")


def members(path: str | Path) -> list[int]:
    """Return the processes in the cgroup (none when it is gone)."""
    try:
        return [int(pid) for pid in (Path(path) / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def stop(paths: str | Path | list[str] | list[Path], grace_s: float) -> int:
    """SIGTERM every process in the cgroups (one job's, in several hierarchies: a process
    still in any of them is found), SIGKILL what is left after `grace_s`, remove the
    cgroups; return how many processes there were. Idempotent."""
    groups = [Path(p) for p in (paths if isinstance(paths, list) else [paths])]

    def all_members() -> set[int]:
        return {pid for path in groups for pid in members(path)}

    found = all_members()

    def signal_members(number: int) -> None:
        for pid in all_members():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, number)

    def kill() -> None:
        for path in groups:
            if (path / "cgroup.kill").exists():  # every member at once, forks included
                with contextlib.suppress(OSError):
                    (path / "cgroup.kill").write_text("1")
        signal_members(signal.SIGKILL)

    escalate(lambda: signal_members(signal.SIGTERM), kill, lambda: bool(all_members()), grace_s)
    # A process that has exited but not yet been reaped keeps a cgroup busy for a moment.
    deadline = time.monotonic() + 5
    for path in groups:
        while path.exists():
            try:
                path.rmdir()
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    return len(found)


def sweep_empty(prefix: str = "gpuflow-", min_age_s: float = 60.0) -> list[str]:
    """Remove empty job cgroups (named `prefix`...) older than `min_age_s` that a killed
    process left; a cgroup with a process in it cannot be removed, so none is disturbed."""
    swept: list[str] = []
    for path in (path for parent in _parents() for path in parent.glob(f"{prefix}*")):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > min_age_s and not members(path):
                path.rmdir()
                swept.append(str(path))
    return swept
