"""Which Prefect API a gpuflow command talks to, and the temporary server it starts when
there is none.

In order: PREFECT_API_URL when set (checked for health first); else the local platform
when `gpuflow platform up` runs it and it answers; else a temporary server: one an earlier
command of this user started and kept (tasks/platform/kept_api.py: it stops by itself
after GPUFLOW_API_IDLE_S without a command), or a new one. gpuflow starts it in a session
of its own (so Ctrl-C reaches gpuflow, not the server, and the run's final state can still
be written), waits for as long as a cold start takes, and records it under
$GPUFLOW_HOME/servers for later commands and `gpuflow reap`. With GPUFLOW_API_IDLE_S=0 it
is stopped by PID when the command ends.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from gpuflow.tasks.errors import GpuflowError
from gpuflow.tasks.host import (
    OWN_SECRETS,
    StateFileError,
    alive,
    auth_string,
    env_number,
    gpuflow_home,
    open_private,
    private_dir,
    read_private,
    secure_home,
    stop_group,
    write_atomic,
)
from gpuflow.tasks.platform import kept_api, portguard
from gpuflow.tasks.platform import state as platform_state
from gpuflow.tasks.platform.server import sqlite_file

# A cold first start (no bytecode yet, a new SQLite database) took 34 s on a busy
# 2-core machine; Prefect's own ephemeral start gives up after 20 s.
STARTUP_FAILED = kept_api.STARTUP_FAILED


class ApiUnavailable(GpuflowError):
    """No Prefect API could be reached or started; the message names the cause and the fix."""


@dataclass
class Api:
    url: str
    kind: str  # "configured" (PREFECT_API_URL), "platform" or "temporary"
    ui: str | None = None
    server: dict[str, Any] | None = None  # the temporary server's record
    auth: str | None = None  # the server's auth string, sent by this process's clients
    trust: str | None = None  # the certificate a platform shared over TLS is trusted by

    def describe(self) -> str:
        if self.kind == "configured":
            return f"the Prefect API at {self.url} (PREFECT_API_URL)"
        if self.kind == "platform":
            return f"the local platform (UI {self.ui})"
        return f"a temporary Prefect API at {self.url} (runs are kept in {prefect_home()})"

    def run_link(self, flow_run_id: str) -> str | None:
        """Return the UI page of a flow run, when this API has a UI."""
        return f"{self.ui}/runs/flow-run/{flow_run_id}" if self.ui else None


def prefect_home() -> str:
    return kept_api.prefect_home(dict(os.environ))


DATABASE_URL_SETTINGS = (
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
    "PREFECT_API_DATABASE_CONNECTION_URL",
)


def own_prefect_home() -> Path:
    """Return PREFECT_HOME, made (or narrowed to) a folder this user alone may enter, once
    it and the SQLite database a temporary API would open are this user's own: a folder or
    database another user made (and so can read: Secret blocks and the key that decrypts
    them live in that database) is refused in one sentence before a server starts on it."""
    home = Path(prefect_home())
    fix = "point PREFECT_HOME at a folder of your own, or unset it (~/.prefect)"
    try:
        info = home.stat() if home.exists() else None
        if info is not None and not stat.S_ISDIR(info.st_mode):
            raise StateFileError(f"PREFECT_HOME {home} is not a folder; {fix}.")
        if info is not None and info.st_uid != os.geteuid():
            raise StateFileError(
                f"PREFECT_HOME {home} belongs to uid {info.st_uid}, not to you: that user could"
                f" read your Secret blocks in its database; {fix}."
            )
        private_dir(home)
        database = _sqlite_path(home)
        for path in (database, *(database.with_name(database.name + x) for x in ("-wal", "-shm"))):
            if not path.exists() and not path.is_symlink():
                continue
            found = path.lstat()
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
                raise StateFileError(
                    f"{path} is not a database file of yours (uid {found.st_uid}, mode"
                    f" {stat.filemode(found.st_mode)}): another user could read your Secret"
                    f" blocks in it; remove it, or {fix}."
                )  # one of yours wider than 0600: the server narrows it (narrow_database)
    except OSError as exc:
        raise StateFileError(
            f"PREFECT_HOME {home} cannot be used ({exc.strerror or exc}); {fix}."
        ) from None
    return home


def _sqlite_path(home: Path) -> Path:
    """Return the SQLite file a Prefect server started here would use (PREFECT_HOME's
    prefect.db unless a database URL names another)."""
    url = next((os.environ[k] for k in DATABASE_URL_SETTINGS if os.environ.get(k)), "")
    named = sqlite_file(url.replace("${PREFECT_HOME}", str(home)))
    return home / "prefect.db" if named is None else named


def servers_dir() -> Path:
    return gpuflow_home() / "servers"


def temporary_auth() -> str:
    """Return the auth string of this GPUFLOW_HOME's temporary APIs (made the first time)."""
    return auth_string(private_dir(servers_dir()) / "auth")


def auth_headers(auth: str | None) -> dict[str, str]:
    """Return the header a request to a server with `auth` carries."""
    if not auth:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}


def health_error(url: str, timeout_s: float = 10.0) -> str | None:
    """Return why `url`/health does not answer 200 (one phrase), or None when it does."""
    try:
        with urllib.request.urlopen(
            f"{url.rstrip('/')}/health", timeout=timeout_s, context=tls_for(url)
        ) as response:
            return None if response.status == 200 else f"it answered HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"it answered HTTP {exc.code}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError | socket.timeout):
            return f"it did not answer within {timeout_s:.0f} s"
        if isinstance(reason, ConnectionRefusedError):
            return "the connection was refused (no server listens there)"
        if isinstance(reason, socket.gaierror):
            return f"its host name does not resolve ({reason.strerror})"
        return str(getattr(reason, "strerror", None) or reason)
    except TimeoutError:
        return f"it did not answer within {timeout_s:.0f} s"
    except (OSError, ValueError) as exc:
        return str(exc)


def auth_refused(api: Api) -> str | None:
    """Return the sentence for a server that refuses this process's auth string (HTTP 401),
    or None when it lets it in."""
    request = urllib.request.Request(f"{api.url.rstrip('/')}/admin/version")
    for name, value in auth_headers(api.auth).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls_for(api.url)):
            return None
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            return None
    except (OSError, ValueError):
        return None  # not an answer about auth: the command meets it with its real cause
    given = "the auth string given is wrong" if api.auth else "it asks for an auth string"
    return (
        f"the Prefect API at {api.url} refuses gpuflow (HTTP 401: {given}); set"
        " PREFECT_API_AUTH_STRING to that server's (the local platform's is in"
        " $GPUFLOW_HOME/platform/auth)."
    )


def tls_for(url: str) -> ssl.SSLContext | None:
    """Return the TLS context to check `url`'s certificate with: the local platform's own
    (a generated one) for the platform's URL, else Prefect's PREFECT_API_SSL_CERT_FILE, else
    the system's default (None)."""
    if not url.startswith("https://"):
        return None
    trust = trust_for(url) or os.environ.get("PREFECT_API_SSL_CERT_FILE")
    return ssl.create_default_context(cafile=trust) if trust else None


def trust_for(url: str) -> str | None:
    """Return the certificate file the local platform is trusted by, when `url` is its."""
    state = platform_state.read_state()
    if state and url.rstrip("/").startswith(state["api"].rstrip("/").removesuffix("/api")):
        return platform_state.trust(state)
    return None


def configured_url() -> str | None:
    """Return PREFECT_API_URL from the environment or the active Prefect profile."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def choose(say: Callable[[str], None], temporary: bool = True) -> Api:
    """Return the API to use (see the module's docstring); start a temporary one if needed
    and allowed. Raises ApiUnavailable with the real cause. The port of a server gpuflow
    started (the platform's, a temporary API) is held by this process from here on, so no
    other user can take it to receive the auth string (tasks/platform/portguard.py)."""
    api = _choose(say, temporary)
    if api.kind in ("platform", "temporary"):
        try:
            portguard.hold(api.url)
        except portguard.PortTaken as exc:
            raise ApiUnavailable(f"{exc.strerror}.") from None
    return api


def loopback_temporary(url: str) -> bool:
    """Return True when `url` is on loopback and not the local platform's: a temporary API
    (they keep their runs in PREFECT_HOME's database, whichever of them serves it)."""
    state = platform_state.read_state()
    if state and url.rstrip("/") == state["api"].rstrip("/"):
        return False
    return portguard.loopback(url) is not None


def hold_if_ours(url: str | None) -> None:
    """Hold `url`'s port when it is the local platform's (a flow run its worker started):
    never raises; another program on the port is said in the log."""
    state = platform_state.read_state()
    if not url or not state or url.rstrip("/") != state["api"].rstrip("/"):
        return
    try:
        portguard.hold(url)
    except portguard.PortTaken as exc:
        logging.getLogger("gpuflow").warning("%s", exc.strerror)


def _choose(say: Callable[[str], None], temporary: bool) -> Api:
    url = configured_url()
    if url:
        problem = health_error(url)
        if problem:
            raise ApiUnavailable(
                f"the Prefect API at {url} (PREFECT_API_URL) is unreachable: {problem}; start"
                " that server, or unset PREFECT_API_URL to use the local platform or a"
                " temporary API."
            )
        from prefect.settings import PREFECT_UI_URL

        api = Api(url, "configured", ui=PREFECT_UI_URL.value() or None, auth=auth_for(url))
        state = platform_state.read_state()
        if state and url.rstrip("/") == state["api"].rstrip("/"):  # its profile, say
            api = Api(
                url, "platform", ui=state["ui"], auth=api.auth, trust=platform_state.trust(state)
            )
        if refused := auth_refused(api):
            raise ApiUnavailable(refused)
        if elsewhere := platform_elsewhere(url):
            say(elsewhere)
        return api
    state = platform_state.read_state()
    if state and all(platform_state.running(p) for p in state["processes"].values()):
        problem = health_error(state["api"], timeout_s=5)
        if problem is None:
            return Api(
                state["api"],
                "platform",
                ui=state["ui"],
                auth=platform_state.auth(),
                trust=platform_state.trust(state),
            )
        say(
            f"the local platform's server does not answer ({problem});"
            " `gpuflow platform down && gpuflow platform up` restarts it"
        )
    if not temporary:
        raise ApiUnavailable(
            "this needs a lasting Prefect server (deployments live there), and neither"
            " PREFECT_API_URL is set nor the local platform running; set PREFECT_API_URL or"
            " run `gpuflow platform up`."
        )
    servers = servers_dir()
    with kept_api.starting(servers):
        records = [r for r in _records() if r.get("idle_s")]
        try:
            record = kept_api.find(servers, records, lambda url: health_error(url, 3) is None)
        except OSError as exc:  # the lease on a kept server could not be written
            raise _home_cannot_hold("this command's lease on the kept API", exc) from None
        if record is not None:
            say(
                f"using the temporary Prefect API kept at {record['api']} (pid {record['pid']},"
                f" started by an earlier command; it stops after {record['idle_s']:.0f} s"
                " without one)"
            )
            return Api(record["api"], "temporary", server=record, auth=temporary_auth())
        return start_temporary(say)


def platform_elsewhere(url: str | None, in_a_flow: bool = False) -> str | None:
    """Return the sentence that says a running local platform is not the API `url` (what
    PREFECT_API_URL names; None: Prefect's ephemeral API), and how to use it; None when no
    platform runs, or it is `url`. `in_a_flow`: the API is a user's flow's own."""
    state = platform_state.read_state()
    if not state or not all(platform_state.running(p) for p in state["processes"].values()):
        return None
    if url is not None and url.rstrip("/") == state["api"].rstrip("/"):
        return None
    if in_a_flow:
        where = url or "Prefect's ephemeral API"
        return (
            f"the local platform runs (UI {state['ui']}), but this flow runs on"
            f" {where}: its jobs are recorded there,"
            " not in the platform; run the flow with PREFECT_PROFILE=gpuflow (or make that"
            " profile the active one: `gpuflow platform up --use`) to record them there"
        )
    if "PREFECT_API_URL" in os.environ:
        source = "the environment's PREFECT_API_URL"
        fix = "unset PREFECT_API_URL"
    else:
        from prefect.context import get_settings_context

        source = f"the active Prefect profile {get_settings_context().profile.name!r}"
        fix = "run `prefect profile use gpuflow` (or `gpuflow platform up --use`)"
    return (
        f"the local platform runs (UI {state['ui']}), but {source} names {url}: what this"
        f" command makes is recorded there, not in the platform; {fix} to use the platform"
    )


def auth_for(url: str) -> str | None:
    """Return the auth string to send to the API at `url`: the local platform's or this
    GPUFLOW_HOME's temporary API's when `url` is one of theirs (PREFECT_API_URL may name the
    platform, as `gpuflow platform up` says), else Prefect's own setting (None when unset).
    A server's string is never sent to another server."""
    from prefect.settings import PREFECT_API_AUTH_STRING

    wanted = url.rstrip("/")
    state = platform_state.read_state()
    if state and wanted == state["api"].rstrip("/"):
        return platform_state.auth()
    if any(wanted == record["api"].rstrip("/") for record in _records()):
        return temporary_auth()
    given = PREFECT_API_AUTH_STRING.value()
    return given if given and given not in OWN_SECRETS else None


@contextlib.contextmanager
def talking_to(url: str) -> Iterator[None]:
    """Point Prefect's settings in this thread at `url`, with that server's auth string
    (and no other server's) and, for the local platform shared over TLS, its certificate."""
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_SSL_CERT_FILE,
        PREFECT_API_URL,
        temporary_settings,
    )

    auth = auth_for(url)
    trust = trust_for(url)
    if auth:
        settings: dict[Any, Any] = {PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: auth}
        if trust:
            settings[PREFECT_API_SSL_CERT_FILE] = trust
        with temporary_settings(settings):
            yield
    else:
        with temporary_settings({PREFECT_API_URL: url}, restore_defaults={PREFECT_API_AUTH_STRING}):
            yield


def start_timeout_s() -> float:
    """Return how long a Prefect server gpuflow starts (a temporary API, the platform's) may
    take to answer (GPUFLOW_API_START_TIMEOUT_S)."""
    return env_number("GPUFLOW_API_START_TIMEOUT_S", 240.0, 1.0, 3600.0)


def start_temporary(
    say: Callable[[str], None], timeout_s: float | None = None, keep_s: float | None = None
) -> Api:
    """Start Prefect's API server (no UI) on a free loopback port and wait until it answers;
    it is kept `keep_s` after its last command (default GPUFLOW_API_IDLE_S; 0: it stops
    with this one). A kept server carries this command's lease once it answers."""
    timeout_s = start_timeout_s() if timeout_s is None else timeout_s
    keep_s = kept_api.idle_s() if keep_s is None else keep_s
    secure_home()
    own_prefect_home()
    servers = private_dir(servers_dir())
    auth_file = servers / "auth"
    auth = auth_string(auth_file)
    started = time.monotonic()
    kept = f", kept for later commands until {keep_s:.0f} s without one" if keep_s else ""
    say(
        f"starting a temporary Prefect API{kept} (`gpuflow platform up` keeps one running,"
        " with a UI)"
    )
    fingerprint = kept_api.fingerprint()
    for _ in range(5):
        port = _free_port()
        log = servers / f"server-{port}.log"
        # No signal between starting the server and recording it: then an interruption
        # (handled below) always knows what to stop.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        proc = None
        try:
            proc = _spawn_server(port, log, auth_file, servers, keep_s, blocked)
            record = _record_started(proc, port, log, keep_s, fingerprint, servers)
        except BaseException as exc:
            if proc is not None:  # started, but not recorded (a full disk): stopped here
                _stop_unrecorded(proc, servers, log)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if isinstance(exc, OSError):
                raise _home_cannot_hold("the temporary API's record", exc) from None
            raise
        api = Api(record["api"], "temporary", server=record, auth=auth)
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a pending signal lands here
            code = _wait_until_healthy(proc, record["api"], started + timeout_s)
        except BaseException:
            stop_server(record)
            raise
        if code is None:
            say(f"temporary Prefect API ready in {time.monotonic() - started:.1f} s")
            return api
        text = log.read_text(errors="replace")
        stop_server(record, keep_log=True)
        if code == STARTUP_FAILED and "address already in use" in text.lower():
            log.unlink(missing_ok=True)
            continue  # another program took the port between our probe and its bind
        if code == -1:
            raise ApiUnavailable(
                f"the temporary Prefect API did not answer within {timeout_s:.0f} s (the"
                " machine may be busy); set GPUFLOW_API_START_TIMEOUT_S higher, or start one"
                " with `gpuflow platform up`."
            )
        raise ApiUnavailable(
            f"the temporary Prefect API could not start: {startup_error(text)} (its database"
            f" is under PREFECT_HOME={prefect_home()}); see {log}."
        )
    raise ApiUnavailable(
        "the temporary Prefect API found no free port on 127.0.0.1 in 5 tries; stop what"
        " holds them, or start one with `gpuflow platform up`."
    )


def _spawn_server(
    port: int, log: Path, auth_file: Path, servers: Path, keep_s: float, mask: Any
) -> subprocess.Popen:
    """Start gpuflow's API server process on `port` (no UI), its output in `log`; the
    child gets the signal `mask` this process had before it blocked its own."""
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": prefect_home(),
    }
    argv = [sys.executable, "-m", "gpuflow.tasks.platform.server", "--port", str(port)]
    argv += ["--auth-file", str(auth_file), "--servers", str(servers)]
    argv += ["--idle-s", str(keep_s), "--log", str(log)]
    with open_private(log, append=False) as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Not in the folder the command was started in: a kept server outlives it,
            # and must not hold it (a job's workspace, a mount to unmount).
            cwd="/",
            start_new_session=True,
            # The child would inherit the blocked mask, and never see its SIGTERM.
            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, mask),
        )


def _record_started(
    proc: subprocess.Popen, port: int, log: Path, keep_s: float, fingerprint: str, servers: Path
) -> dict[str, Any]:
    """Write the record of the server just started (what reap, `platform down` and later
    commands find it by) and, when it is kept, this command's lease on it."""
    record = {
        "pid": proc.pid,
        "started": psutil.Process(proc.pid).create_time(),
        "owner_pid": os.getpid(),
        "owner_started": psutil.Process().create_time(),
        "api": f"http://127.0.0.1:{port}/api",
        "log": str(log),
        "prefect_home": prefect_home(),
        "idle_s": keep_s,
        "fingerprint": fingerprint,
    }
    write_atomic(servers / f"{proc.pid}.json", json.dumps(record))
    if keep_s:
        kept_api.take_lease(servers, record)
    return record


def _stop_unrecorded(proc: subprocess.Popen, servers: Path, log: Path) -> None:
    """Stop a temporary server whose record could not be written, and forget it."""
    stop_group(proc.pid, None, grace_s=5.0)
    proc.wait()
    (servers / f"{proc.pid}.json").unlink(missing_ok=True)
    shutil.rmtree(kept_api.leases_of(servers, proc.pid), ignore_errors=True)
    log.unlink(missing_ok=True)  # it said nothing worth keeping: it never served


def _home_cannot_hold(what: str, exc: OSError) -> StateFileError:
    """The sentence for a GPUFLOW_HOME that cannot take a write (full, read-only)."""
    return StateFileError(
        f"GPUFLOW_HOME {gpuflow_home()} cannot hold {what} ({exc.strerror or exc}); free"
        " space there, or point GPUFLOW_HOME at another folder."
    )


def _wait_until_healthy(proc: subprocess.Popen, url: str, deadline: float) -> int | None:
    """Return None once `url` answers, the server's exit code if it died, -1 on timeout."""
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return code
        if health_error(url, timeout_s=2) is None:
            return None
        time.sleep(0.2)
    return -1


def stop_server(record: dict[str, Any], keep_log: bool = False) -> bool:
    """Stop a temporary server by PID (not a reused PID) and forget it (its log too, unless
    `keep_log`: a failed start names it); True if it ran."""
    was_running = alive(record["pid"], record["started"])
    if was_running:
        stop_group(record["pid"], record["started"], grace_s=10.0)
    (servers_dir() / f"{record['pid']}.json").unlink(missing_ok=True)
    shutil.rmtree(kept_api.leases_of(servers_dir(), record["pid"]), ignore_errors=True)
    if not keep_log:
        Path(record["log"]).unlink(missing_ok=True)
    return was_running


def startup_error(log_text: str) -> str:
    """Return the exception a server's log ends with ("Type: message"), or its last line."""
    lines = [line.strip() for line in log_text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*: ", line)]
    found = errors[-1] if errors else (lines[-1] if lines else "it printed nothing")
    return found.split(" (Background on this error")[0][:300]


def _records() -> list[dict[str, Any]]:
    """Return the records of the temporary servers under $GPUFLOW_HOME/servers."""
    found = []
    for path in sorted(servers_dir().glob("*.json")):
        try:
            record = json.loads(read_private(path, limit=65536))
            int(record["pid"]), float(record["started"])
        except FileNotFoundError:
            continue  # a kept server that stopped meanwhile
        except (OSError, ValueError, TypeError, KeyError, StateFileError):
            # half-written by a process that died, or not a record at all (a FIFO, a link)
            path.unlink(missing_ok=True)
            continue
        found.append(record)
    return found


def leftover_servers() -> list[dict[str, Any]]:
    """Return records of temporary servers a killed gpuflow left: one that stops with its
    command, whose command is gone; a kept one that only killed commands used last."""
    servers = servers_dir()
    return [
        record
        for record in _records()
        if (
            kept_api.forgotten(servers, record)
            if record.get("idle_s")
            else not alive(record["owner_pid"], record["owner_started"])
        )
    ]


def stop_kept(say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Stop the kept temporary servers of this GPUFLOW_HOME that no command uses now (one in
    use stops by itself once idle: its command would fail); return the records of all the
    kept servers found running."""
    servers, found = servers_dir(), []
    for record in _records():
        if not record.get("idle_s") or not alive(record["pid"], record["started"]):
            continue
        found.append(record)
        live, _ = kept_api.leases(kept_api.leases_of(servers, record["pid"]))
        if live:
            say(
                f"the temporary Prefect API at {record['api']} is in use by {live} command(s);"
                " it stops by itself once they end"
            )
            continue
        stop_server(record)
        say(f"stopped the temporary Prefect API at {record['api']} (pid {record['pid']})")
    return found


@contextlib.contextmanager
def using(api: Api) -> Iterator[Api]:
    """Point Prefect at `api` for the body, in every thread (a settings context would reach
    only this one, and Prefect's workers in other threads would start an ephemeral server
    of their own); after the body send the logs and events still queued, stop the
    temporary server if this process started one, and put the settings back."""
    import prefect.context
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_SSL_CERT_FILE,
        PREFECT_API_URL,
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        PREFECT_UI_URL,
        temporary_settings,
    )

    # A temporary API serves no UI: no "View at" link to a page that is not there.
    updates = {
        "PREFECT_API_URL": api.url,
        "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
        "PREFECT_UI_URL": api.ui or "",
    }
    if api.auth:  # Prefect's clients in every thread send it; jobs never get it (host.py)
        updates["PREFECT_API_AUTH_STRING"] = api.auth
        OWN_SECRETS.add(api.auth)
    if api.trust:  # a platform shared over TLS, with the certificate generated for it
        updates["PREFECT_API_SSL_CERT_FILE"] = api.trust
    before = {name: os.environ.get(name) for name in updates}
    prior_global = prefect.context.GLOBAL_SETTINGS_CONTEXT
    os.environ.update(updates)
    prefect.context.refresh_global_settings_context()  # what other threads see
    try:
        settings: dict[Any, Any] = {
            PREFECT_API_URL: api.url,
            PREFECT_SERVER_ALLOW_EPHEMERAL_MODE: False,
            PREFECT_UI_URL: api.ui or "",
        }
        if api.auth:
            settings[PREFECT_API_AUTH_STRING] = api.auth
        if api.trust:
            settings[PREFECT_API_SSL_CERT_FILE] = api.trust
        with temporary_settings(settings):  # what this thread sees, whatever its context
            try:
                yield api
            finally:
                flush_prefect()
    finally:
        done_with(api)
        for name, value in before.items():  # as it was, for a caller that goes on
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        prefect.context.GLOBAL_SETTINGS_CONTEXT = prior_global


def done_with(api: Api) -> None:
    """End this process's use of `api`: a kept temporary server loses this command's lease
    (it stops by itself once idle), one kept for no later command stops now."""
    if api.server is not None and api.server.get("idle_s"):
        kept_api.release(servers_dir(), api.server)
    elif api.server is not None:
        stop_server(api.server)


def flush_prefect(timeout_s: float = 30.0) -> None:
    """Block until Prefect's log and event workers have sent what they hold."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
