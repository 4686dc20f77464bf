"""The local platform's PostgreSQL server (`gpuflow platform up --database postgresql`):
the server programs of the host's PostgreSQL (Debian's `postgresql` package), a data folder
made once with initdb, listening on 127.0.0.1 only (no Unix socket), a generated password,
started and stopped by PID like the platform's other processes.

PostgreSQL refuses to run as root: when gpuflow runs as root, the server runs as the host's
`postgres` account, and its data folder must be reachable by that account (a folder under
/root is not: the data then goes under /var/lib/gpuflow, one folder per GPUFLOW_HOME).
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from gpuflow.tasks.errors import GpuflowError, InvalidSpec
from gpuflow.tasks.host import alive, escalate, stop_group, write_atomic
from gpuflow.tasks.platform.state import platform_dir

USER, DATABASE = "gpuflow", "prefect"
SERVER_PROGRAMS = ("initdb", "postgres", "pg_isready", "createdb")
SHARED_ROOT = Path("/var/lib/gpuflow")


class DatabaseError(GpuflowError):
    """The platform's database could not be made or started; the message says why."""


def programs() -> Path:
    """Return the folder holding PostgreSQL's server programs: $GPUFLOW_POSTGRES_BIN when
    set, else initdb's folder on PATH, else Debian's /usr/lib/postgresql/<version>/bin (the
    newest)."""
    if named := os.environ.get("GPUFLOW_POSTGRES_BIN"):
        folder = Path(named)
        missing = [name for name in SERVER_PROGRAMS if not (folder / name).is_file()]
        if not folder.is_absolute() or missing:
            raise InvalidSpec(
                f"GPUFLOW_POSTGRES_BIN: {named!r} is not a folder holding PostgreSQL's server"
                f" programs ({', '.join(missing) or 'an absolute path'} missing); name the"
                " folder of initdb and postgres (Debian: /usr/lib/postgresql/<version>/bin),"
                " or unset it."
            )
        return folder
    found = shutil.which("initdb")
    if found:
        folder = Path(found).resolve().parent
        if all((folder / name).is_file() for name in SERVER_PROGRAMS):
            return folder
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for folder in reversed(versions):
        if all((folder / name).is_file() for name in SERVER_PROGRAMS):
            return folder
    raise InvalidSpec(
        "--database postgresql: PostgreSQL's server programs (initdb, postgres) are not"
        " installed on this host; install Debian's postgresql package (apt-get install"
        " postgresql), or leave --database at sqlite."
    )


def _account() -> pwd.struct_passwd | None:
    """Return the account the server runs as when gpuflow runs as root, else None."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise InvalidSpec(
            "--database postgresql: PostgreSQL refuses to run as root and this host has no"
            " `postgres` account; install Debian's postgresql package (it makes one), or run"
            " gpuflow as another user."
        ) from None


def _reachable(folder: Path, account: pwd.struct_passwd) -> bool:
    """Return True when `account` may enter every folder above `folder` (mode bits only)."""
    groups = {account.pw_gid} | {g.gr_gid for g in grp.getgrall() if account.pw_name in g.gr_mem}
    for parent in [folder, *folder.parents]:
        try:
            info = parent.stat()
        except FileNotFoundError:
            continue
        if info.st_uid == account.pw_uid:
            allowed = info.st_mode & stat.S_IXUSR
        elif info.st_gid in groups:
            allowed = info.st_mode & stat.S_IXGRP
        else:
            allowed = info.st_mode & stat.S_IXOTH
        if not allowed:
            return False
    return True


def data_folder() -> Path:
    """Return the data folder for this GPUFLOW_HOME's platform."""
    folder = platform_dir() / "postgres"
    account = _account()
    if account is None or _reachable(platform_dir(), account):
        return folder
    key = hashlib.sha256(str(platform_dir().resolve()).encode()).hexdigest()[:16]
    return SHARED_ROOT / key / "postgres"


def password_file() -> Path:
    return platform_dir() / "postgres.password"


def _password() -> str:
    path = password_file()
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    value = secrets.token_urlsafe(24)
    write_atomic(path, value + "\n")
    path.chmod(0o600)
    return value


def connection_url(port: int) -> str:
    """Return Prefect's database URL for the server on `port` (it holds the password: it
    goes only into the Prefect server's environment, never into state or logs)."""
    return f"postgresql+asyncpg://{USER}:{_password()}@127.0.0.1:{port}/{DATABASE}"


def _as_account(account: pwd.struct_passwd | None) -> dict[str, Any]:
    if account is None:
        return {}
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _initdb(bin_dir: Path, data: Path, account: pwd.struct_passwd | None, log: Path) -> None:
    """Make the data folder once: a cluster whose only login is `gpuflow`, with a password,
    over TCP on 127.0.0.1."""
    data.mkdir(parents=True, exist_ok=True)
    if account is not None:
        os.chown(data, account.pw_uid, account.pw_gid)
    data.chmod(0o700)
    # initdb reads the password from a file the server's account can open (a pipe made
    # by root is not one), next to the data folder, removed right after.
    pwfile = data.parent / f".{data.name}.password"
    pwfile.unlink(missing_ok=True)
    descriptor = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(_password() + "\n")
    if account is not None:
        os.chown(pwfile, account.pw_uid, account.pw_gid)
    argv = [str(bin_dir / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}"]
    argv += ["--auth=scram-sha-256", "-E", "UTF8", "--locale=C"]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, cwd="/", timeout=300, **_as_account(account)
        )
    finally:
        pwfile.unlink(missing_ok=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise DatabaseError(
            f"PostgreSQL's initdb could not make {data}: {_last_line(done.stderr)} (see {log})"
        )


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def start(say=print) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the platform's PostgreSQL server (making its data folder the first time);
    return its process entry and the database's description for the state file."""
    bin_dir = programs()
    account = _account()
    data = data_folder()
    log = platform_dir() / "postgres.log"
    fresh = not (data / "PG_VERSION").is_file()
    if SHARED_ROOT in data.parents:  # which GPUFLOW_HOME this folder belongs to
        data.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(data.parent / "home", f"{platform_dir().resolve()}\n")
    if fresh:
        _initdb(bin_dir, data, account, platform_dir() / "initdb.log")
    port = _free_port()
    argv = [str(bin_dir / "postgres"), "-D", str(data), "-p", str(port)]
    argv += ["-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="]
    argv += ["-c", "max_connections=200"]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
            **_as_account(account),
        )
    entry = {"pid": proc.pid, "started": psutil.Process(proc.pid).create_time(), "log": str(log)}
    try:
        _wait_ready(bin_dir, port, entry, 60)
        _create_database(bin_dir, port, account)
    except BaseException:
        stop(entry)
        raise
    version = (data / "PG_VERSION").read_text().strip()
    say(
        f"started PostgreSQL {version} (pid {proc.pid}) on 127.0.0.1:{port}"
        f"{', a new data folder' if fresh else ''}: {data}; log {log}"
    )
    return entry, {"kind": "postgresql", "port": port, "data": str(data), "version": version}


def _wait_ready(bin_dir: Path, port: int, entry: dict[str, Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(entry["pid"], entry["started"]) or _zombie(entry["pid"]):
            raise DatabaseError(
                "PostgreSQL exited while starting; its log ends:"
                f" {_last_line(Path(entry['log']).read_text(errors='replace'))}"
                f" (see {entry['log']})"
            )
        done = subprocess.run(
            [str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-t", "2"],
            capture_output=True,
            timeout=30,
        )
        if done.returncode == 0:
            return
        time.sleep(0.2)
    raise DatabaseError(
        f"PostgreSQL did not accept connections on 127.0.0.1:{port} within {timeout_s:.0f} s;"
        f" see {entry['log']}"
    )


def _create_database(bin_dir: Path, port: int, account: pwd.struct_passwd | None) -> None:
    env = {"PATH": os.environ.get("PATH", ""), "PGPASSWORD": _password()}
    done = subprocess.run(
        [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, DATABASE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0 and "already exists" not in done.stderr:
        raise DatabaseError(
            f"could not create the database {DATABASE!r}: {_last_line(done.stderr)}"
        )


def stop(entry: dict[str, Any], grace_s: float = 30.0) -> None:
    """Stop the server by PID: a fast shutdown (SIGINT: clients are cut, the data is
    written), then its whole process group after `grace_s`."""
    pid, started = entry["pid"], entry["started"]
    if not alive(pid, started):
        return

    def interrupt() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)

    escalate(
        interrupt,
        lambda: _stopped(stop_group(pid, started, grace_s=5.0)),
        lambda: alive(pid, started) and not _zombie(pid),
        grace_s,
    )


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _stopped(_killed: int) -> None:
    """What `escalate` calls to force a stop: `stop_group`, its count dropped."""
