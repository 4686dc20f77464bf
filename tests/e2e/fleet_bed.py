"""GPU servers for fleet tests (scripts/fleet-testbed.sh): brought up, described, saved as
a GpuFleet block, brought down."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

TESTBED = Path(__file__).resolve().parents[2] / "scripts" / "fleet-testbed.sh"


@contextlib.contextmanager
def fleet_bed(folder: Path, hosts: list[str]) -> Iterator[dict]:
    """Bring up hosts (NAME:GPUS[:PRODUCT][:nopython]) in `folder`; yield their description
    (hosts.json, the client key, the folder); bring them down, whatever happens."""
    env = {**os.environ, "FLEET_PYTHON": sys.executable}
    subprocess.run([str(TESTBED), "up", str(folder), *hosts], check=True, env=env)
    try:
        yield json.loads((folder / "hosts.json").read_text()) | {
            "key": (folder / "client_key").read_text(),
            "dir": folder,
        }
    finally:
        subprocess.run([str(TESTBED), "down", str(folder)], check=True)


def host_entry(bed: dict, host: str, **over) -> dict:
    """Return `host` of the bed as a GpuFleet host entry, with `over` on top."""
    found = next(h for h in bed["hosts"] if h["name"] == host)
    entry = {
        "name": host,
        "address": found["address"],
        "known_hosts": found["known_hosts"],
        "gpus": found["gpus"],
    }
    return entry | over


def save_fleet(bed: dict, name: str, hosts: list[dict], **over) -> None:
    """Save the bed's key as Secret block fleet-test-key and a GpuFleet `name` of `hosts`."""
    from prefect.blocks.system import Secret

    from gpuflow.blocks import GpuFleet

    Secret(value=bed["key"]).save("fleet-test-key", overwrite=True)
    GpuFleet(hosts=hosts, ssh_key="fleet-test-key", **over).save(name, overwrite=True)


def claims_on(bed: dict, host: str) -> list[str]:
    """Return the GPU claim files on `host` (its local backend's, under its GPUFLOW_HOME)."""
    folder = Path(bed["dir"]) / host / "gpuflow" / "local" / "gpus"
    return sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []


def records_on(bed: dict, host: str) -> list[str]:
    """Return the runs `host` still has a record of."""
    folder = Path(bed["dir"]) / host / "gpuflow" / "local" / "clusters"
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
