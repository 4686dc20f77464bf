"""A service's endpoint: HAProxy in front of its replicas, driven through its runtime API.

HAProxy speaks HTTP and WebSocket, spreads requests over servers in state `ready` only,
retries a request whose server went away on another (`retry-on`, `redispatch`), and lets
a server drain. Each replica is a slot of a `server-template` (r1..rN), pointed at the
replica's address and port and made ready through the runtime API socket, so nothing is
reloaded. A request that arrives with no server up waits in a Lua action of HAProxy's own
until one is, within a bound. Each request is logged on HAProxy's stdout as one line
(`gpuflow-request SERVER STATUS TOTAL_MS RESPONSE_MS`): the service counts requests and
latencies from them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gpuflow.tasks.contract import JobResult
from gpuflow.tasks.host import dies_with_parent

BACKEND = "replicas"
SOCKET = "admin.sock"
REQUEST_MARK = "gpuflow-request "
WAITING_MARK = "gpuflow-waiting"

# HAProxy's Lua: hold a request while its backend has no server up, checking every 50 ms,
# for at most `bound_ms`; say once on the log that a request waits (the service starts a
# replica on that line).
WAIT_LUA = f"""
core.register_action("gpuflow_wait", {{"http-req"}}, function(txn, backend, bound_ms)
  local proxy = core.backends[backend]
  local waited = 0
  if tonumber(proxy:get_stats()["act"]) > 0 then return end
  core.log(core.info, "{WAITING_MARK}")
  while waited < tonumber(bound_ms) do
    core.msleep(50)
    waited = waited + 50
    if tonumber(proxy:get_stats()["act"]) > 0 then return end
  end
end, 2)
"""


@dataclass(frozen=True)
class Endpoint:
    """What an endpoint is: where it listens, its replica slots, how long a request waits
    for a ready replica (`wait_s`) and for its answer, and the connections each replica
    takes at most (`per_server`; the rest wait in the endpoint's queue, up to `wait_s`)."""

    host: str
    port: int
    slots: int
    wait_s: float
    server_timeout_s: float
    per_server: int | None = None


def config(folder: Path, endpoint: Endpoint) -> str:
    """Return HAProxy's configuration for `endpoint`, its runtime socket and Lua file in
    `folder` (private to the run's user). The socket's path is relative, to the folder
    above `folder` where HAProxy starts: a workspace's full path can be longer than a
    socket's path may be."""
    host, port, wait_s = endpoint.host, endpoint.port, endpoint.wait_s
    slots, per_server = endpoint.slots, endpoint.per_server
    return f"""global
  stats socket unix@{folder.name}/{SOCKET} mode 600 level admin
  lua-load {folder / "wait.lua"}
  log stdout format raw local0
  maxconn 4096

defaults
  mode http
  log global
  log-format "{REQUEST_MARK}%s %ST %Tt %Tr"
  option dontlognull
  timeout connect 2s
  timeout client 120s
  timeout server {int(endpoint.server_timeout_s)}s
  timeout tunnel 1h
  timeout http-request 30s
  timeout queue {int(wait_s)}s
  retries 3
  option redispatch 1
  retry-on conn-failure empty-response response-timeout 503

frontend endpoint
  bind {host}:{port}
  http-request lua.gpuflow_wait {BACKEND} {int(wait_s * 1000)} if {{ nbsrv({BACKEND}) eq 0 }}
  default_backend {BACKEND}

backend {BACKEND}
  balance leastconn
  server-template r 1-{slots} 127.0.0.1:1 disabled{f" maxconn {per_server}" if per_server else ""}
"""


def write_files(folder: Path, endpoint: Endpoint) -> Path:
    """Write `endpoint`'s configuration and the Lua action into `folder`; return the
    configuration's path."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "wait.lua").write_text(WAIT_LUA)
    path = folder / "haproxy.cfg"
    path.write_text(config(folder, endpoint))
    return path


def command(config: Path) -> list[str]:
    """Return the command running HAProxy with `config`, in the folder above its own (the
    admin socket's path is relative to it, wherever the process starts: a service with a
    working folder starts its units there)."""
    return [
        shutil.which("haproxy") or "haproxy",
        "-db",
        "-C",
        str(config.parent.parent),
        "-f",
        str(config),
    ]


def run_here(
    config: Path,
    on_line: Callable[[str, str], None],
    cancelled: Callable[[], bool],
    ended: Callable[[], bool],
    deadline: float,
    grace_s: float = 10.0,
) -> JobResult:
    """Run HAProxy with `config` on this machine, in front of replicas elsewhere (a
    fleet's hosts), until it ends by itself, the run is `cancelled()`, the service has
    `ended()` or the wall-clock `deadline` passes; each line it writes goes to `on_line`. It dies with the thread that started it, so a
    SIGKILLed gpuflow leaves no endpoint behind."""
    began = datetime.now(UTC)
    proc = subprocess.Popen(
        command(config),
        cwd=config.parent.parent,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=dies_with_parent(),
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line("stdout", line.rstrip("\n"))

    reader = threading.Thread(target=read, name="endpoint-log", daemon=True)
    reader.start()
    was_cancelled = timed_out = False
    while proc.poll() is None:
        if cancelled():
            was_cancelled = True
            break
        if ended():
            break
        if time.time() >= deadline:
            timed_out = True
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)  # HAProxy's soft stop: ends once requests do
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(5.0)
    finished = datetime.now(UTC)
    code = proc.returncode
    return JobResult(
        exit_code=code if code >= 0 else None,
        signal=-code if code < 0 else None,
        started_at=began,
        ended_at=finished,
        duration_s=(finished - began).total_seconds(),
        timed_out=timed_out,
        cancelled=was_cancelled,
    )


def server(slot: int) -> str:
    """Return the HAProxy server name of replica slot `slot` (0-based)."""
    return f"r{slot + 1}"


class ProxyError(Exception):
    """The runtime API refused a command or could not be reached."""


class Runtime:
    """HAProxy's runtime API on its admin socket in `folder`: one command per connection,
    reached through a descriptor of the folder (a short path, however deep it is)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / SOCKET
        self._folder = os.open(folder, os.O_PATH | os.O_DIRECTORY)

    def close(self) -> None:
        os.close(self._folder)

    def ask(self, command: str, timeout_s: float = 5.0) -> str:
        """Return HAProxy's answer to `command`; ProxyError when the socket is away."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout_s)
                sock.connect(f"/proc/self/fd/{self._folder}/{SOCKET}")
                sock.sendall(command.encode() + b"\n")
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
        except OSError as exc:
            raise ProxyError(f"HAProxy's runtime API at {self.path}: {exc}") from None
        return b"".join(chunks).decode(errors="replace")

    def wait_up(self, timeout_s: float, alive: Callable[[], bool]) -> None:
        """Return once the socket answers; ProxyError after `timeout_s` or when `alive()`
        says HAProxy ended."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.ask("show info", 1.0)
                return
            except ProxyError:
                if time.monotonic() > deadline or not alive():
                    raise
                time.sleep(0.05)

    def point(self, slot: int, address: str, port: int) -> None:
        """Point replica slot `slot` at address:port (it stays out of rotation)."""
        said = self.ask(f"set server {BACKEND}/{server(slot)} addr {address} port {port}")
        if "changed" not in said and "no need" not in said:
            raise ProxyError(f"HAProxy refused the address of {server(slot)}: {said.strip()}")

    def state(self, slot: int, state: str) -> None:
        """Set slot `slot` to ready (gets requests), drain (finishes its own) or maint."""
        said = self.ask(f"set server {BACKEND}/{server(slot)} state {state}").strip()
        if said:
            raise ProxyError(f"HAProxy refused state {state} for {server(slot)}: {said}")

    def sessions(self, slot: int) -> int:
        """Return the requests slot `slot` is serving now."""
        return int(self.stats().get(server(slot), {}).get("scur") or 0)

    def queued(self) -> int:
        """Return the requests waiting in the endpoint's queue for a replica's slot."""
        lines = self.ask(f"show stat {BACKEND} 2 -1").splitlines()
        if not lines or not lines[0].startswith("# "):
            return 0
        fields = lines[0][2:].split(",")
        for line in lines[1:]:
            row = dict(zip(fields, line.split(","), strict=False))
            if row.get("pxname") == BACKEND and row.get("svname") == "BACKEND":
                return int(row.get("qcur") or 0)
        return 0

    def stats(self) -> dict[str, dict[str, str]]:
        """Return `show stat` of the replicas' backend: server name -> its fields."""
        lines = self.ask(f"show stat {BACKEND} 4 -1").splitlines()
        if not lines or not lines[0].startswith("# "):
            return {}
        fields = lines[0][2:].split(",")
        rows = {}
        for line in lines[1:]:
            values = line.split(",")
            if len(values) >= 2 and values[0] == BACKEND:
                rows[values[1]] = dict(zip(fields, values, strict=False))
        return rows


@dataclass(frozen=True)
class Request:
    """One request HAProxy logged: the server that answered (`<NOSRV>`: none), its HTTP
    status, its total time and the server's response time in ms (-1: no response)."""

    server: str
    status: int
    total_ms: int
    response_ms: int


def request_of(line: str) -> Request | None:
    """Return the request a HAProxy log line records, None for any other line."""
    if not line.startswith(REQUEST_MARK):
        return None
    words = line[len(REQUEST_MARK) :].split()
    if len(words) != 4:
        return None
    try:
        return Request(words[0], int(words[1]), int(words[2]), int(words[3]))
    except ValueError:
        return None
