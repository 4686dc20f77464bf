"""The Slurm test cluster (scripts/slurm-testbed.sh) gives what the Slurm backend relies on:
three nodes of GPUs declared as gres in their partitions, each step handed the indices of
its own GPUs, and preemption by the urgent partition that signals and requeues."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def run_slurm(*argv: str, timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def wait_until(what: str, check: Callable[[], bool], limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not so after {limit_s:.0f} s"
        time.sleep(0.3)


def state_of(job_id: str) -> str:
    """Return the job's state in squeue; "" once Slurm no longer knows it."""
    argv = ["squeue", "-h", "-j", job_id, "-o", "%T"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0 and "Invalid job id" in done.stderr:
        return ""
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def gone(job_id: str) -> bool:
    return state_of(job_id) in ("", "CANCELLED", "COMPLETED", "FAILED")


def test_three_nodes_carry_their_gpus_in_their_partitions(slurm):
    rows = {
        tuple(line.split())
        for line in run_slurm("sinfo", "-h", "-N", "-o", "%N %P %G %t").splitlines()
    }
    assert rows == {
        ("g1", "gpu*", "gpu:h100:4", "idle"),
        ("g2", "gpu*", "gpu:h100:4", "idle"),
        ("l1", "l4", "gpu:l4:2", "idle"),
        ("g1", "urgent", "gpu:h100:4", "idle"),
        ("g2", "urgent", "gpu:h100:4", "idle"),
        ("l1", "urgent", "gpu:l4:2", "idle"),
    }


def test_each_step_is_handed_the_indices_of_its_own_gpus(slurm, tmp_path):
    """CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS name the GPUs Slurm gave the step on each
    node (the gres files are character devices); a second job on a node gets the others."""
    show = 'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES $SLURM_STEP_GPUS"'
    both = run_slurm("srun", "-p", "gpu", "-N2", "--gres=gpu:h100:2", "bash", "-c", show)
    assert sorted(both.split("\n")[:2]) == ["g1 0,1 0,1", "g2 0,1 0,1"]
    holder = run_slurm(
        "sbatch", "--parsable", "-w", "g1", "--gres=gpu:h100:2", "-o", str(tmp_path / "holder.out"),
        "--wrap", "sleep 120",
    ).strip()  # fmt: skip
    try:
        wait_until("the first job runs", lambda: state_of(holder) == "RUNNING")
        second = run_slurm("srun", "-w", "g1", "--gres=gpu:h100:2", "bash", "-c", show).strip()
        assert second == "g1 2,3 2,3"
    finally:
        run_slurm("scancel", holder)
    wait_until("the first job is gone", lambda: gone(holder))


def test_an_urgent_job_preempts_a_gpu_job_which_gets_sigterm_and_is_requeued(slurm, tmp_path):
    script = tmp_path / "unit.sh"
    script.write_text(
        "#!/bin/bash\n"
        "trap 'echo terminated; exit 75' TERM\n"
        'echo "started ${SLURM_RESTART_COUNT:-0}"\n'
        # wait again if the sleep's end reaches bash before bash's own SIGTERM: only the
        # trap ends the script
        "while :; do sleep 300 & wait; done\n"
    )
    out = tmp_path / "unit-%j.out"
    job = run_slurm(
        "sbatch", "--parsable", "-p", "gpu", "-N2", "--gres=gpu:h100:4", "--requeue",
        "-o", str(out), str(script),
    ).strip()  # fmt: skip
    printed = Path(str(out).replace("%j", job))
    urgent = None
    try:
        wait_until("the job starts", lambda: printed.is_file() and "started" in printed.read_text())
        urgent = run_slurm(
            "sbatch",
            "--parsable",
            "-p",
            "urgent",
            "-N1",
            "--gres=gpu:h100:4",
            "--output=/dev/null",  # not slurm-<id>.out in the working folder
            "--wrap",
            "sleep 120",
        ).strip()
        wait_until("the urgent job runs", lambda: state_of(urgent) == "RUNNING")
        assert "terminated" in printed.read_text()  # its SIGTERM, within the partition's grace
        assert state_of(job) == "PENDING"  # requeued
        assert "Restarts=1" in run_slurm("scontrol", "show", "job", job)
    finally:
        run_slurm("scancel", *(j for j in (job, urgent) if j))
    wait_until("both jobs are gone", lambda: gone(job) and gone(urgent or job))


def test_down_cancels_jobs_and_leaves_no_process_of_the_cluster(tmp_path):
    """A cluster stopped with a job still running: its job is cancelled and nothing it
    started (slurmstepd, the job's processes) outlives the daemons."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root")
    script = Path(__file__).resolve().parents[2] / "scripts" / "slurm-testbed.sh"
    folder = tmp_path / "cluster"
    subprocess.run(["bash", str(script), "up", "--dir", str(folder)], check=True, timeout=300)
    conf = f"SLURM_CONF={folder.resolve() / 'slurm.conf'}"
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    try:
        subprocess.run(
            ["sbatch", "-o", "/dev/null", "--wrap", "sleep 600"], env=env, check=True, timeout=60
        )
        wait_until(
            "the job runs",
            lambda: (
                "RUNNING"
                in subprocess.run(
                    ["squeue", "-h", "-o", "%T"], env=env, capture_output=True, text=True
                ).stdout
            ),
        )
    finally:
        subprocess.run(["bash", str(script), "down", "--dir", str(folder)], check=True, timeout=120)

    def of_the_cluster() -> list[int]:
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                text = environ.read_bytes().decode(errors="replace")
                state = (environ.parent / "stat").read_text().split(") ")[1][0]
            except OSError:
                continue
            if conf in text.split("\0") and state != "Z":  # zombies are already gone
                found.append(int(environ.parent.name))
        return found

    assert of_the_cluster() == []
