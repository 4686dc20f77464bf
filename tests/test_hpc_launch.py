"""The HPC launcher's pure parts: which rank failed first, the sentence, hosts, programs."""

from __future__ import annotations

import json
import os
import sys

import pytest

from gpuflow.tasks.hpc.launch import (
    JobError,
    describe,
    first_failure,
    hosts_for,
    program_argv,
    resolve,
)
from gpuflow.tasks.hpc.model import HpcJob


def write(folder, **ranks):
    folder.mkdir(exist_ok=True)
    for rank, record in ranks.items():
        (folder / f"rank-{rank[1:]}.json").write_text(json.dumps(record))


def test_the_first_rank_to_fail_is_named_not_the_ones_mpirun_stopped(tmp_path):
    write(
        tmp_path,
        r0={"rank": 0, "host": "a", "exit_code": None, "signal": 15, "ended": 12.5},
        r1={"rank": 1, "host": "b", "exit_code": 3, "signal": None, "ended": 12.0},
        r2={"rank": 2, "host": "b", "exit_code": 0, "signal": None, "ended": 11.0},
    )
    (tmp_path / "rank-3.json").write_text("{not json")  # a rank killed mid-write
    record = first_failure(tmp_path)
    assert record["rank"] == 1
    assert describe(record, 4) == (
        "MPI rank 1 of 4 on b exited with code 3; mpirun stopped the other ranks."
        " See that rank's lines in the log."
    )
    assert "was killed by signal 11 (SIGSEGV)" in describe({**record, "signal": 11}, 4)


def test_no_failure_when_every_rank_exited_0(tmp_path):
    write(tmp_path, r0={"rank": 0, "host": "a", "exit_code": 0, "signal": None, "ended": 1})
    assert first_failure(tmp_path) is None
    assert first_failure(tmp_path / "none") is None


@pytest.mark.parametrize(
    ("job", "gpus", "slots", "host_gpus"),
    [
        ({"slots": 3}, 0, 3, 0),
        ({"gpus_per_rank": 2, "ranks": 2}, 4, 2, 4),
        ({}, 0, os.cpu_count() or 1, 0),
    ],
)
def test_hosts_default_to_this_one(job, gpus, slots, host_gpus):
    [host] = hosts_for(HpcJob(program=["x"], **job), gpus)
    assert (host.name, host.slots, host.gpus) == ("localhost", slots, host_gpus)


def test_md_runs_under_mpi4pys_runner():
    argv = program_argv(HpcJob(md={"atoms": 500}))
    assert argv[:5] == [sys.executable, "-m", "mpi4py", "-m", "gpuflow.tasks.hpc.md_run"]
    assert json.loads(argv[-1])["atoms"] == 500


def test_resolve_programs(tmp_path):
    (tmp_path / "sim").write_text("#!/bin/sh\n")
    with pytest.raises(JobError, match=r"not found in the workspace .* or is not executable"):
        resolve("./sim", tmp_path)
    (tmp_path / "sim").chmod(0o755)
    assert resolve("./sim", tmp_path) == str(tmp_path / "sim")
    assert resolve("sh", tmp_path).endswith("/sh")
    with pytest.raises(JobError, match="'no-such-tool' was not found on PATH"):
        resolve("no-such-tool", tmp_path)


@pytest.mark.parametrize(("visible", "owned"), [("4,5,6,7", "6,7"), (None, "2,3"), ("", "")])
def test_the_rank_wrapper_gives_each_local_rank_its_gpus(tmp_path, visible, owned):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env |= {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    per_rank = "0" if visible == "" else "2"
    code = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES']); sys.exit(4)"
    args = ["--status-dir", str(tmp_path), "--gpus-per-rank", per_rank]
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow.tasks.hpc.rank", *args, "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 4 and done.stdout.strip() == owned
    record = json.loads((tmp_path / "rank-5.json").read_text())
    assert (record["rank"], record["exit_code"], record["signal"]) == (5, 4, None)


def test_the_example_specs_load():
    from pathlib import Path

    from gpuflow.tasks.spec import load_spec

    examples = Path(__file__).resolve().parent.parent / "examples"
    md = load_spec(examples / "hpc-md.yaml")
    assert md.job.md.atoms == 4000 and md.job.ranks == 2
    program = load_spec(examples / "hpc-program.yaml")
    assert program.job.program == ["./simulate", "--steps", "10000"]
    assert program.job.build == ["make", "-j4"]
