"""Prefect's API server as gpuflow runs it, for the local platform and the temporary API:
only its user gets in, and no web page drives it.

- Authentication: Prefect's own basic-auth string (PREFECT_SERVER_API_AUTH_STRING), made
  per platform or per GPUFLOW_HOME's temporary API, kept in a 0600 file that only this
  user can read. The program reads it from that file (never from its argv, which every
  local user sees in `ps`); every request without it gets 401 (Prefect's /health and
  /ready excepted), and websockets are refused without it too.
- A Host check against DNS rebinding: a page whose name resolves to 127.0.0.1 sends its
  own name as Host; only IP literals, `localhost` and the names the platform was given
  get through (421 otherwise).
- CORS only for the server's own origin (PREFECT_SERVER_CORS_ALLOWED_ORIGINS), so another
  page's script cannot read the answers.
- umask 077: the database, its journal and the logs the server writes are 0600.

- TLS 1.3 only, with --tls-cert and --tls-key (a platform shared with `--listen`).

- Users (the platform's, with --users): tasks/platform/access.py lets each in by its role.

Run as `python -m gpuflow.tasks.platform.server --port PORT --auth-file FILE [--ui]
[--users FILE] [--idle-s S]`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpuflow.tasks.host import read_private
from gpuflow.tasks.loading import loading
from gpuflow.tasks.platform import kept_api
from gpuflow.tasks.platform.tls import server_context

STARTUP_FAILED = kept_api.STARTUP_FAILED
LOCAL_NAMES = ("localhost",)


def host_allowed(host_header: str, names: frozenset[str]) -> bool:
    """Return True when a request's Host header names this server by an address (an IP
    literal, which a rebinding page cannot send: its own origin is a name), `localhost`, or
    one of `names` the server was told it is reached by."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:4200
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host in LOCAL_NAMES or host in names


class HostCheck:
    """ASGI middleware: a request (or websocket) whose Host this server does not answer to
    is refused before Prefect sees it."""

    def __init__(self, app: Any, names: frozenset[str]) -> None:
        self.app, self.names = app, names

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            host = headers.get(b"host", b"").decode("latin-1")
            if not host_allowed(host, self.names):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b'{"detail": "this server does not answer to that Host"}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 421,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def create_app() -> Any:
    """Return Prefect's server app (API, and the UI when enabled) behind the Host check and,
    on the platform, the front that lets its users in by their roles."""
    names = frozenset(n for n in os.environ.get("GPUFLOW_SERVER_NAMES", "").split(",") if n)
    final = os.environ.get("PREFECT__SERVER_FINAL") == "1"
    with loading():  # Prefect's server and its routes: about a fifth of its start-up less
        from prefect.server.api.server import create_app as prefect_app

        app: Any = prefect_app(final=final)
    users = os.environ.get("GPUFLOW_SERVER_USERS")
    if users:
        from gpuflow.tasks.platform.access import Front
        from gpuflow.tasks.platform.users import UserBook

        app = Front(app, os.environ["PREFECT_SERVER_API_AUTH_STRING"], UserBook(Path(users)))
    return HostCheck(app, names)


def sqlite_file(url: str) -> Path | None:
    """Return the file of a SQLite database URL (None for another database)."""
    if not url.startswith("sqlite") or ":///" not in url:
        return None
    return Path(url.split(":///", 1)[1].split("?", 1)[0])


def narrow_database() -> None:
    """Make the server's SQLite database, its journal files and their folder this user's
    alone (an older one, or one Prefect made, may be 0644: it holds the key that decrypts
    the blocks' secrets). A database of another user's is left as it is."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    database = sqlite_file(PREFECT_API_DATABASE_CONNECTION_URL.value() or "")
    if database is None:
        return
    for path, mode in [(database.parent, 0o700)] + [
        (database.with_name(database.name + suffix), 0o600) for suffix in ("", "-wal", "-shm")
    ]:
        with contextlib.suppress(OSError):
            info = path.lstat()
            mine = info.st_uid == os.geteuid() and not stat.S_ISLNK(info.st_mode)
            if mine and info.st_mode & 0o077:
                path.chmod(mode)


def serve(argv: list[str]) -> int:
    """Run Prefect's API server on HOST:PORT until SIGTERM, or until it has been idle for
    --idle-s (then remove its record and log); return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m gpuflow.tasks.platform.server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--auth-file", type=Path, required=True)
    parser.add_argument("--ui", action="store_true")
    parser.add_argument("--name", action="append", default=[], help="a Host name it answers to")
    parser.add_argument("--tls-cert", help="serve TLS 1.3 only, with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--users", type=Path, help="the platform's user book (users.json)")
    parser.add_argument("--servers", type=Path)
    parser.add_argument("--idle-s", type=float, default=0.0)
    parser.add_argument("--log", type=Path)
    args = parser.parse_args(argv)
    os.umask(0o077)
    scheme = "https" if args.tls_cert else "http"
    hosts = [args.host, "127.0.0.1", "localhost", *args.name]
    origins = [
        f"{scheme}://{f'[{h}]' if ':' in h else h}:{args.port}"
        for h in dict.fromkeys(hosts)
        if h not in ("0.0.0.0", "::")
    ]
    os.environ.update(
        PREFECT_SERVER_API_AUTH_STRING=read_private(args.auth_file).strip(),
        PREFECT_SERVER_CORS_ALLOWED_ORIGINS=",".join(origins),
        PREFECT_SERVER_UI_ENABLED="true" if args.ui else "false",
        GPUFLOW_SERVER_NAMES=",".join(args.name),
        GPUFLOW_SERVER_USERS=str(args.users or ""),
        PREFECT__SERVER_FINAL="1",
    )
    narrow_database()
    import uvicorn

    config = uvicorn.Config(
        "gpuflow.tasks.platform.server:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        log_level="error",
        lifespan="on",
        # Stopping must not wait for keep-alive connections the commands still hold.
        timeout_graceful_shutdown=2,
    )
    if args.tls_cert:
        config.ssl_certfile, config.ssl_keyfile = args.tls_cert, args.tls_key
        config.load()
        config.ssl = server_context(args.tls_cert, args.tls_key)  # TLS 1.3 only
    server = uvicorn.Server(config)
    try:  # its port shared with this user's clients only (tasks/platform/portguard.py)
        bound = _bind(args.host, args.port)
    except OSError as exc:
        print(f"could not bind {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return STARTUP_FAILED
    stopped: list[bool] = []
    if args.idle_s > 0 and args.servers:
        threading.Thread(
            target=kept_api.stop_when_idle,
            args=(server, args.servers, args.idle_s, stopped),
            daemon=True,
            name="idle-stop",
        ).start()
    _collect_once_started(server)
    server.run(sockets=[bound])
    if stopped:
        if args.log:
            args.log.unlink(missing_ok=True)
        return 0
    return 0 if server.started else STARTUP_FAILED


def _bind(host: str, port: int) -> Any:
    """Return the server's socket on host:port, bound with SO_REUSEPORT: this user's
    clients hold the same port (portguard), so no other user can take it when it stops."""
    import socket

    from gpuflow.tasks.platform.portguard import reusable_socket

    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    bound = reusable_socket(str(address[0]) if family == socket.AF_INET6 else host, server=True)
    if family == socket.AF_INET6:
        bound.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    bound.bind(address)
    return bound


def _collect_once_started(server: Any) -> None:
    """Start the server without collecting garbage: its modules, routes and the database's
    first queries make long-lived objects only; once it answers (or in 120 s at most)
    they are frozen and collection is on again."""
    gc.disable()

    def on_again() -> None:
        for _ in range(2400):
            if server.started or server.should_exit:
                break
            time.sleep(0.05)
        gc.freeze()
        gc.enable()

    threading.Thread(target=on_again, daemon=True, name="gc-after-start").start()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
