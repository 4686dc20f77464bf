"""A temporary Prefect API kept for the commands that follow.

The first command that finds no API configured and no platform running starts Prefect's
server (gpuflow.tasks.platform.api.start_temporary) as gpuflow.tasks.platform.server's program: uvicorn, no
UI, its auth string from $GPUFLOW_HOME/servers/auth, in a session of its own, and a thread that stops it once no gpuflow command has held it for
GPUFLOW_API_IDLE_S (default 600 s; 0: the server stops with the command that started it).
Later commands of the same user, with the same GPUFLOW_HOME, PREFECT_HOME, Python and
Prefect server settings (the record's `fingerprint`), find it through its record under
$GPUFLOW_HOME/servers and its health check, and wait once instead of every time.

Every command that uses it holds a lease, a file naming the command's pid, for as long as
it runs. A command killed by SIGKILL leaves a lease whose process is gone: that counts as
released, and `gpuflow reap` stops a kept server that only such leases name.

Stopping without a race: the idle server removes its record first, then reads the leases
once more; a command takes its lease first, then checks that the record is still there.
Either the server sees the lease (and puts its record back) or the command sees no
record (and starts a server of its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from gpuflow.tasks.host import StateFileError, alive, env_number, read_private, write_atomic

IDLE_S = 600.0
STARTUP_FAILED = 3  # uvicorn's exit code when it cannot bind or the app fails to start
# Prefect settings that change what the server is (its database, its behaviour); the
# client-side ones (PREFECT_API_URL, logging) do not.
SERVER_SETTINGS = ("PREFECT_HOME", "PREFECT_SERVER_", "PREFECT_API_DATABASE_")


def idle_s() -> float:
    """Return how long a temporary API is kept after its last command (GPUFLOW_API_IDLE_S)."""
    return env_number("GPUFLOW_API_IDLE_S", IDLE_S, 0.0, 7 * 86400.0)


def fingerprint(environ: dict[str, str] | None = None) -> str:
    """Return what a command's server must share with it to be used: this user, this
    Python (and so this Prefect), the Prefect server settings and PREFECT_HOME."""
    environ = dict(os.environ if environ is None else environ)
    environ["PREFECT_HOME"] = prefect_home(environ)
    settings = sorted((k, v) for k, v in environ.items() if k.startswith(SERVER_SETTINGS))
    text = json.dumps([os.geteuid(), sys.executable, settings])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def prefect_home(environ: dict[str, str]) -> str:
    """Return the absolute PREFECT_HOME of `environ` (the server runs in / and outlives the
    folder a command was started in)."""
    home = environ.get("PREFECT_HOME") or str(Path.home() / ".prefect")
    return str(Path(home).expanduser().absolute())


def leases_of(servers: Path, pid: int) -> Path:
    return servers / f"{pid}.leases"


@contextlib.contextmanager
def starting(servers: Path) -> Iterator[None]:
    """Hold the lock on `servers` while a command looks for a kept server or starts one:
    two first commands at once share one server."""
    servers.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(servers, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def take_lease(servers: Path, record: dict[str, Any]) -> Path:
    """Record that this process uses the server of `record`; return the lease."""
    lease = leases_of(servers, record["pid"]) / str(os.getpid())
    me = psutil.Process()
    write_atomic(lease, json.dumps({"pid": me.pid, "started": me.create_time()}))
    return lease


def release(servers: Path, record: dict[str, Any]) -> None:
    """This process no longer uses the server of `record`."""
    (leases_of(servers, record["pid"]) / str(os.getpid())).unlink(missing_ok=True)


def leases(folder: Path) -> tuple[int, int]:
    """Return how many leases in `folder` name a running command, and how many a gone one."""
    live = gone = 0
    for path in folder.glob("[0-9]*") if folder.is_dir() else []:
        try:
            holder = json.loads(read_private(path, limit=4096))
            pid, started = int(holder["pid"]), float(holder["started"])
        except (OSError, ValueError, TypeError, KeyError, StateFileError):
            # being written, half-written by a killed command, or not a lease at all (a
            # FIFO, a link): not a holder, and never waited on
            continue
        if alive(pid, started):
            live += 1
        else:
            gone += 1
    return live, gone


def find(servers: Path, records: list[dict[str, Any]], healthy: Any) -> dict[str, Any] | None:
    """Return the record of a kept server this command may use, with this command's lease
    taken on it, or None. `healthy(url)` says whether a server answers."""
    mine = fingerprint()
    kept = [r for r in records if r.get("idle_s") and r.get("fingerprint") == mine]
    for record in sorted(kept, key=lambda r: -r["started"]):
        if not alive(record["pid"], record["started"]):
            continue
        take_lease(servers, record)
        if (servers / f"{record['pid']}.json").is_file() and healthy(record["api"]):
            return record
        release(servers, record)
    return None


def forgotten(servers: Path, record: dict[str, Any]) -> bool:
    """Return True when `record`'s kept server is used by no running command and a killed
    command used it last (what `gpuflow reap` stops)."""
    live, gone = leases(leases_of(servers, record["pid"]))
    return live == 0 and gone > 0


def stop_when_idle(server: Any, servers: Path, idle_for_s: float, stopped: list[bool]) -> None:
    record_path = servers / f"{os.getpid()}.json"
    folder = leases_of(servers, os.getpid())
    last_used = time.monotonic()
    while not server.should_exit:
        time.sleep(1.0)
        if leases(folder)[0]:
            last_used = time.monotonic()
            continue
        if time.monotonic() - last_used < idle_for_s:
            continue
        try:
            text = read_private(record_path)
        except (OSError, StateFileError):
            text = ""
        record_path.unlink(missing_ok=True)
        if leases(folder)[0]:  # a command took a lease meanwhile: it uses this server
            if text:
                write_atomic(record_path, text)
            last_used = time.monotonic()
            continue
        shutil.rmtree(folder, ignore_errors=True)
        stopped.append(True)
        server.should_exit = True
        return
