"""MPI jobs with Debian's Open MPI on this machine: the MD workload on 1 and 2 ranks, a
build step with inputs and uploaded outputs, a failing rank named with its code, nothing
left behind, bad inputs refused before anything starts."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.e2e.helpers import artifacts_of, logs_of, nothing_left

pytestmark = pytest.mark.e2e
if shutil.which("mpirun") is None:
    if os.environ.get("CI"):
        raise RuntimeError("mpirun is not installed; the test command installs openmpi-bin")
    pytest.skip("mpirun is not installed (scripts/test.sh installs it)", allow_module_level=True)

# 1 and 2 ranks sum the forces in a different order, so energies part at rounding level and
# the gap grows with the chaos of the fluid; over 200 steps it stays far below this.
RANKS_AGREE_REL = 1e-9


def hpc_spec(name: str = "hpc-test", **job) -> dict:
    return {
        "name": name,
        "job": {"kind": "hpc", **job},
        "metrics": {"plot": False, "interval_s": 0.5},
    }


def run_hpc(spec: dict):
    from gpuflow.flows.hpc import hpc

    return hpc(spec, return_state=True)


def launch(tmp_path: Path, name: str, **job) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the launcher as the backend would, without Prefect; return it and its workspace."""
    from gpuflow.tasks.hpc.model import HpcJob

    workspace = tmp_path / name
    (workspace / "outputs").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env |= {"GPUFLOW_WORKSPACE": str(workspace), "GPUFLOW_OUTPUT_DIR": str(workspace / "outputs")}
    command = [sys.executable, "-m", "gpuflow.tasks.hpc.launch", "--job-json"]
    done = subprocess.run(
        [*command, HpcJob(kind="hpc", **job).model_dump_json()],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, workspace


def thermo(workspace: Path) -> list[dict[str, float]]:
    lines = (workspace / "outputs" / "thermo.csv").read_text().splitlines()
    header = lines[0].split(",")
    return [dict(zip(header, map(float, line.split(",")), strict=True)) for line in lines[1:]]


def marked(marker: str) -> list[psutil.Process]:
    """Return live processes whose command line carries `marker`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
            found.append(proc)
    return found


def marker_for(tmp_path: Path) -> str:
    """Return a comment that marks this test's processes only: tmp_path's full path, since
    each xdist worker numbers its folders from 0 and two tests may share a folder name."""
    return f"# marker {tmp_path}"


def ranks_of(gpuflow_home: Path) -> list[psutil.Process]:
    """Return this test's live rank wrappers (gpuflow.tasks.hpc.rank --status-dir names its
    workspace) and whatever else names it; other tests' MPI jobs may run beside it."""
    return marked(str(gpuflow_home))


def test_md_on_two_ranks_gives_the_energies_of_one(tmp_path):
    md = {"atoms": 2048, "steps": 200, "thermo_every": 20}
    one, ws1 = launch(tmp_path, "one", ranks=1, md=md)
    two, ws2 = launch(tmp_path, "two", ranks=2, md=md)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    rows1, rows2 = thermo(ws1), thermo(ws2)
    assert [r["step"] for r in rows1] == [r["step"] for r in rows2] == list(range(0, 201, 20))
    for a, b in zip(rows1, rows2, strict=True):
        for key in ("total_per_atom", "potential_per_atom", "temperature", "pressure"):
            assert b[key] == pytest.approx(a[key], rel=RANKS_AGREE_REL), (a["step"], key)
    result = json.loads((ws2 / "outputs" / "result.json").read_text())
    assert result["ranks"] == 2 and result["atoms"] == 2048 and result["device"] == "cpu"
    statuses = [json.loads(p.read_text()) for p in sorted((ws2 / "ranks").glob("rank-*.json"))]
    assert [(s["rank"], s["exit_code"]) for s in statuses] == [(0, 0), (1, 0)]
    assert statuses[0]["pid"] != statuses[1]["pid"]
    assert "localhost slots=" in (ws2 / "hostfile").read_text()


def test_oversubscribe_runs_more_ranks_than_slots(tmp_path):
    code = (
        "import os, pathlib\n"
        "rank = os.environ['OMPI_COMM_WORLD_RANK']\n"
        "pathlib.Path(os.environ['GPUFLOW_OUTPUT_DIR'], f'rank-{rank}').write_text(rank)\n"
    )
    program = [sys.executable, "-c", code]
    refused, _ = launch(tmp_path, "refused", ranks=3, slots=2, program=program)
    assert refused.returncode != 0  # mpirun itself refuses: the spec check is not the only guard
    done, workspace = launch(
        tmp_path, "over", ranks=3, slots=2, oversubscribe=True, program=program
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (workspace / "outputs").iterdir()) == [
        "rank-0",
        "rank-1",
        "rank-2",
    ]


def test_build_step_inputs_and_uploaded_outputs(prefect_api, tmp_path, gpuflow_home):
    source = tmp_path / "source"
    (source / "src").mkdir(parents=True)
    (source / "build.sh").write_text(
        "set -e\necho compiling sim\ncp src/sim.in sim\nchmod +x sim\n"
    )
    (source / "src" / "sim.in").write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            echo "rank $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE threads $OMP_NUM_THREADS" \
                > "$GPUFLOW_OUTPUT_DIR/rank-$OMPI_COMM_WORLD_RANK.txt"
            echo "gpus [$CUDA_VISIBLE_DEVICES]" >> "$GPUFLOW_OUTPUT_DIR/rank-$OMPI_COMM_WORLD_RANK.txt"
            """
        )
    )
    out = tmp_path / "results"
    spec = hpc_spec(
        ranks=2,
        inputs=[f"file://{source}"],
        build=["sh", "build.sh"],
        program=["./sim"],
        output=f"file://{out}",
    )
    state = run_hpc(spec)
    assert state.is_completed(), state.message
    result = state.result()
    assert sorted(p.name for p in out.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert (out / "rank-1.txt").read_text().splitlines() == ["rank 1 of 2 threads 1", "gpus []"]
    logs = logs_of(result.flow_run_id)
    assert any("build| compiling sim" in line for line in logs)
    assert any("inputs: 2 file(s) fetched" in line for line in logs)
    assert any("outputs: 2 file(s) to" in line for line in logs)
    assert "gpuflow-summary" in artifacts_of(result.flow_run_id)
    assert nothing_left(gpuflow_home)


def test_build_failure_shows_its_last_lines_and_mpirun_never_starts(
    prefect_api, tmp_path, gpuflow_home
):
    build = "echo compiling; echo 'sim.c:3: error: expected ; before }' >&2; exit 2"
    spec = hpc_spec(build=["sh", "-c", build], program=["./sim"], ranks=2)
    state = run_hpc(spec)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "job.build: `sh -c echo compiling;" in message
    assert "failed (exit 2); last lines: compiling | sim.c:3: error: expected ; before }" in message
    assert not any("mpirun:" in line for line in logs_of(state.state_details.flow_run_id))
    assert nothing_left(gpuflow_home)


FAILING = {
    "exit 3": (
        "import os, sys, time\n"
        "if os.environ['OMPI_COMM_WORLD_RANK'] == '1': sys.exit(3)\n"
        "time.sleep(120)\n",
        "exited with code 3",
    ),
    "MPI_Abort 5": (
        "from mpi4py import MPI\n"
        "comm = MPI.COMM_WORLD\n"
        "if comm.rank == 1: comm.Abort(5)\n"
        "comm.Barrier()\n",
        "exited with code 5",
    ),
    "abort()": (
        "import os, time\n"
        "if os.environ['OMPI_COMM_WORLD_RANK'] == '1': os.abort()\n"
        "time.sleep(120)\n",
        "was killed by signal 6 (SIGABRT)",
    ),
}


@pytest.mark.parametrize("case", list(FAILING))
def test_a_failing_rank_is_named_and_no_mpi_process_is_left(
    prefect_api, tmp_path, gpuflow_home, case
):
    code, how = FAILING[case]
    marker = marker_for(tmp_path)
    spec = hpc_spec(ranks=2, program=[sys.executable, "-c", f"{code}{marker}\n"])
    state = run_hpc(spec)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert f"MPI rank 1 of 2 on {socket.gethostname()} {how}" in message, message
    assert marked(marker) == [] and ranks_of(gpuflow_home) == []
    assert nothing_left(gpuflow_home)


def test_a_job_past_its_time_limit_is_stopped_with_every_rank(prefect_api, tmp_path, gpuflow_home):
    marker = marker_for(tmp_path)
    spec = hpc_spec(
        ranks=2, program=[sys.executable, "-c", f"import time; time.sleep(120){marker}"]
    )
    spec["limits"] = {"max_duration": "4s", "stop_grace_s": 2}
    state = run_hpc(spec)
    assert state.is_failed()
    assert "ran past limits.max_duration" in str(state.result(raise_on_failure=False))
    assert marked(marker) == [] and ranks_of(gpuflow_home) == []
    assert nothing_left(gpuflow_home)


def test_inputs_and_outputs_on_s3_keep_the_secret_out_of_logs(
    prefect_api, s3_server, aws_block, tmp_path, gpuflow_home
):
    from gpuflow.tasks.storage import store_for

    store = store_for(s3_server.url("hpc/in/params.txt"), s3_server.settings())
    store.write_bytes(s3_server.url("hpc/in/params.txt"), b"atoms 500\n")
    code = (
        "import os, pathlib\n"
        "text = pathlib.Path('params.txt').read_text()\n"
        "out = pathlib.Path(os.environ['GPUFLOW_OUTPUT_DIR'])\n"
        "(out / f\"echo-{os.environ['OMPI_COMM_WORLD_RANK']}.txt\").write_text(text)\n"
    )
    spec = hpc_spec(
        ranks=2,
        inputs=[s3_server.url("hpc/in")],
        program=[sys.executable, "-c", code],
        output=s3_server.url("hpc/out"),
    )
    spec["storage"] = {"aws_credentials": aws_block}
    state = run_hpc(spec)
    assert state.is_completed(), state.message
    listed = sorted(o.url for o in store.list(s3_server.url("hpc/out")))
    assert listed == [s3_server.url(f"hpc/out/echo-{r}.txt") for r in (0, 1)]
    assert store.read_bytes(s3_server.url("hpc/out/echo-1.txt")) == b"atoms 500\n"
    secret = s3_server.settings().secret_access_key.get_secret_value()
    assert not any(secret in line for line in logs_of(state.result().flow_run_id))


BAD = [
    (["--ranks", "0"], "job.ranks must be at least 1 (got 0)"),
    (
        ["--ranks", "3", "--slots", "2"],
        "job.ranks: 3 ranks do not fit in 2 slot(s); lower job.ranks, add slots or hosts, or"
        " set job.oversubscribe: true",
    ),
    (
        ["--ranks", "1", "--gpus-per-rank", "2", "--gpus", "1"],
        "job.gpus_per_rank: 1 rank(s) x 2 GPU(s) on localhost need 2 GPUs but it has 1",
    ),
    (
        ["--ranks", "2", "--gpus-per-rank", "1"],
        "job.gpus_per_rank: 1 GPU(s) per rank but resources.gpus is 0; set resources.gpus to 2",
    ),
    (["--", "no-such-simulator", "--steps", "5"], "job.program: 'no-such-simulator' was not found"),
    (["--", "/opt/none/sim"], "job.program: '/opt/none/sim' does not exist"),
    (["--density", "3"], "job.md.density: 3.0 is outside the fluid and solid range"),
    (["--temperature", "50"], "job.md.temperature: 50.0 is outside (0, 10.0]"),
    (["--temperature", "-1"], "job.md.temperature: -1.0 is outside"),
    (["--density", "0"], "job.md.density: 0.0 is outside the fluid and solid range"),
    (["--atoms", "100"], "job.md.atoms: the box (4.91 sigma) is too small for cutoff 2.5"),
    (["--mpirun", "/opt/none/mpirun"], "job.mpirun: '/opt/none/mpirun' was not found"),
    (["--input", "file:///opt/none/inputs"], "job.inputs: file:///opt/none/inputs does not exist"),
]


@pytest.mark.parametrize(("args", "sentence"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_refused_before_anything_starts(args, sentence, capsys, gpuflow_home):
    from gpuflow.cli import main

    assert main(["hpc", "--slots", "4", *args] if "--slots" not in args else ["hpc", *args]) == 2
    err = capsys.readouterr().err
    assert sentence in err and "Traceback" not in err, err
    assert err.count("\n") == 1  # one sentence on one line
    assert nothing_left(gpuflow_home)


def test_md_through_the_flow_reports_speed_drift_and_ranks(prefect_api, tmp_path, gpuflow_home):
    spec = hpc_spec(ranks=2, md={"atoms": 500, "steps": 100, "thermo_every": 10})
    state = run_hpc(spec)
    assert state.is_completed(), state.message
    result = state.result()
    job = result.metrics.job
    assert job["ranks"] == 2 and job["atoms"] == 500 and job["steps"] == 100
    assert job["atom_steps_per_s"] > 0 and abs(job["energy_drift_per_atom"]) < 1e-3
    artifacts = artifacts_of(result.flow_run_id)
    table = artifacts["gpuflow-preflight"].data
    table = json.loads(table) if isinstance(table, str) else table
    preflight = {row["check"]: row for row in table}
    assert "Open MPI" in preflight["mpi"]["message"] and preflight["md"]["level"] == "pass"
    summary = artifacts["gpuflow-summary"].data
    assert "atom-steps/s" in summary and "2 rank(s) on" in summary and "0 failed" in summary
    assert (Path(result.artifacts_dir) / "energy.png").stat().st_size > 0
    assert len(thermo(Path(result.artifacts_dir))) == 11
    assert nothing_left(gpuflow_home)


def test_the_hpc_command_runs_a_program_and_says_so(prefect_api, tmp_path, gpuflow_home):
    from tests.conftest import subprocess_env

    env = subprocess_env(prefect_api, gpuflow_home)
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow", "hpc", "--ranks", "2", "--atoms", "500", "--steps", "50"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "md: 500 atoms x 50 steps on 2 rank(s) (cpu)" in done.stdout
    assert "hpc: completed" in done.stdout
