"""A test cluster whose `up` fails part-way stops what it had started before it says so:
nothing it started is left running (bench/k8s_scale.py once left five daemons behind)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def running_in(folder: Path) -> list[str]:
    """Return the command lines of processes that name `folder` (the daemons of a test
    cluster all take paths inside it)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(folder).encode() in arg for arg in argv):
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


def test_a_kubernetes_test_cluster_that_fails_part_way_stops_what_it_started(tmp_path):
    """KWOK's stages missing (its module cache is elsewhere) after etcd, the API server, the
    controller manager and the scheduler started: up fails naming why, and all four are
    stopped by then."""
    folder = tmp_path / "cluster"
    env = dict(os.environ, GOMODCACHE=str(tmp_path / "no-modules"))
    script = ROOT / "scripts" / "k8s-testbed.sh"
    done = subprocess.run(
        ["bash", str(script), "up", "--dir", str(folder), "--no-mpi-operator"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert done.returncode != 0
    assert "KWOK's stages are not in" in done.stderr, done.stderr
    assert "kube-apiserver up" in done.stderr  # it failed part-way, not at the start
    assert "up failed part-way: stopping what it started" in done.stderr
    for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
        assert f"stopped {name}" in done.stderr, done.stderr
    assert list((folder / "pids").iterdir()) == []
    assert running_in(folder) == []


def test_a_slurm_test_cluster_that_fails_part_way_stops_what_it_started(tmp_path):
    """A munged that never makes its socket (the first daemon): up fails naming what did
    not happen, and that munged is stopped by then."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root (the test command runs as root in CI)")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "munged").write_text("#!/bin/sh\nwhile :; do sleep 0.2; done\n")  # keeps its argv
    (fake / "munged").chmod(0o755)
    folder = tmp_path / "cluster"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm-testbed.sh"), "up", "--dir", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode != 0
    assert "munged's socket did not happen" in done.stderr, done.stderr
    assert "up failed part-way: stopping what it started" in done.stderr
    assert list((folder / "pids").iterdir()) == []
    assert running_in(folder) == []
