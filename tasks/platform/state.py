"""The local platform's state file: what `gpuflow platform up` started, read by `down` and
by the choice of Prefect API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.host import alive, gpuflow_home


def platform_dir() -> Path:
    return gpuflow_home() / "platform"


def state_path() -> Path:
    return platform_dir() / "state.json"


def read_state() -> dict[str, Any] | None:
    try:
        return json.loads(state_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def running(entry: dict[str, Any]) -> bool:
    """Return True while the process `up` recorded still runs (not a reused PID)."""
    return alive(entry["pid"], entry["started"])
