"""The local platform's state file: what `gpuflow platform up` started, read by `down` and
by the choice of Prefect API; and the platform's auth string, which every client of its
server sends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuflow.tasks.host import StateFileError, alive, auth_string, gpuflow_home, read_private


def platform_dir() -> Path:
    return gpuflow_home() / "platform"


def state_path() -> Path:
    return platform_dir() / "state.json"


def auth_path() -> Path:
    """Return the file holding the platform's auth string (0600, made by `platform up`)."""
    return platform_dir() / "auth"


def users_path() -> Path:
    """Return the platform's user book (tasks/platform/users.py)."""
    return platform_dir() / "users.json"


def auth() -> str:
    """Return the platform's auth string (`user:token`, as Prefect's PREFECT_API_AUTH_STRING
    takes it), made the first time."""
    return auth_string(auth_path())


def trust(state: dict[str, Any]) -> str | None:
    """Return the certificate file this host's clients trust the platform by (a platform
    shared over TLS with a self-signed certificate), or None."""
    return (state.get("listening") or {}).get("trust")


def read_state() -> dict[str, Any] | None:
    """Return what `platform up` recorded, or None when nothing is (or the file is not the
    platform's: a FIFO or a link there is never read)."""
    try:
        state = json.loads(read_private(state_path()))
    except (FileNotFoundError, json.JSONDecodeError, StateFileError):
        return None
    return state if isinstance(state, dict) and "processes" in state else None


def half_started(state: dict[str, Any]) -> str | None:
    """Return why a recorded platform is not whole (its `up` ended, by a SIGKILL or a
    reboot, before its worker started: it would take runs and never start them), or None
    when it is whole or its `up` still runs."""
    if state.get("up_seconds") is not None:  # written once the workers run
        return None
    starter = state.get("starter")
    if isinstance(starter, dict) and running(starter):
        return None
    pid = starter.get("pid") if isinstance(starter, dict) else "?"
    return (
        f"half started: its `gpuflow platform up` (pid {pid}) ended before its worker started,"
        " so submitted runs would wait for ever; `gpuflow platform up` starts it again"
    )


def running(entry: dict[str, Any]) -> bool:
    """Return True while the process `up` recorded still runs (not a reused PID)."""
    return alive(entry["pid"], entry["started"])
