"""The local platform on PostgreSQL for real: `gpuflow platform up --database postgresql`
starts the host's PostgreSQL server (Debian's package) for the platform, the Prefect server
keeps its runs and logs there (read back with psql, as the server's own login), the
password stays out of state, logs and the worker's environment, `down` stops it by PID and
the next `up` finds the runs again. Bad inputs are refused with one sentence and nothing
left running."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import psutil
import pytest

from tests.conftest import free_port
from tests.e2e.helpers import Platform, process_gone, purge_database

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    home = tmp_path_factory.mktemp("pg-home")
    platform = Platform(home, free_port())
    up = platform.gpuflow(
        "platform", "up", "--port", str(platform.port), "--database", "postgresql", timeout=300
    )
    assert up.returncode == 0, up.stdout + up.stderr
    platform.up_output = up.stdout
    yield platform
    platform.gpuflow("platform", "down", timeout=120)
    purge_database(platform)


def _job(tmp_path: Path, line: str) -> Path:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        json.dumps({"name": "on-postgres", "job": {"kind": "command", "command": ["echo", line]}})
    )
    return spec


def test_runs_and_logs_land_in_postgresql(platform, tmp_path):
    state = platform.state()
    database = state["database"]
    assert database["kind"] == "postgresql"
    assert f"started PostgreSQL {database['version']}" in platform.up_output
    assert "runs kept in PostgreSQL" in platform.up_output
    postgres = psutil.Process(state["processes"]["postgres"]["pid"])
    assert Path(postgres.exe()).name == "postgres"
    line = f"kept-in-postgres-{time.time_ns()}"
    run = platform.gpuflow("run", str(_job(tmp_path, line)), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    run_id = UUID(run.stdout.split("flow run: ")[1].split()[0].rsplit("/", 1)[1])
    rows = platform.sql(f"select name, state_type from flow_run where id = '{run_id}'")
    assert len(rows) == 1 and rows[0].endswith("|COMPLETED"), rows
    logged = platform.sql(f"select message from log where flow_run_id = '{run_id}'")
    assert line in logged, logged
    status = platform.gpuflow("platform", "status")
    assert status.returncode == 0, status.stdout
    assert f"postgres: pid {postgres.pid} running" in status.stdout
    assert "runs kept in PostgreSQL" in status.stdout


def test_a_job_that_prints_bytes_postgresql_refuses_still_ends_its_run(platform, tmp_path):
    """NUL, invalid UTF-8 and a terminal's escape sequence in a failing job's last lines
    (and in its result.json) are escaped before they reach the API: the run ends Failed,
    its log holds the lines, and gpuflow's own sentence carries no raw control byte."""
    spec = tmp_path / "job.yaml"
    script = (
        'printf "nul\\000here bad\\377utf8 \\033[2Jcleared\\n"; '
        'printf \'{"note": "a\\\\u0000b"}\' > "$GPUFLOW_OUTPUT_DIR/result.json"; exit 3'
    )
    spec.write_text(
        json.dumps({"name": "bytes", "job": {"kind": "command", "command": ["sh", "-c", script]}})
    )
    run = platform.gpuflow("run", str(spec), timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    said = run.stdout + run.stderr
    assert "\x00" not in said and "\x1b" not in said
    assert "gpuflow: failed: the job exited with code 3; last lines: nul\\x00here" in said
    [row] = platform.sql("select id, state_type from flow_run order by created desc limit 1")
    run_id, state = row.split("|")
    assert state == "FAILED", row
    logged = "\n".join(platform.sql(f"select message from log where flow_run_id = '{run_id}'"))
    assert "nul\\x00here bad\ufffdutf8 \\x1b[2Jcleared" in logged


def test_the_database_password_stays_out_of_state_logs_and_the_worker(platform):
    password = (platform.home / "platform" / "postgres.password").read_text().strip()
    assert len(password) >= 24
    assert (platform.home / "platform" / "postgres.password").stat().st_mode & 0o077 == 0
    files = [platform.home / "platform" / "state.json", *(platform.home / "platform").glob("*.log")]
    assert len(files) >= 4
    for path in files:
        assert password not in path.read_text(errors="replace"), path
    assert password not in platform.up_output
    processes = platform.state()["processes"]
    worker = psutil.Process(processes["worker"]["pid"])
    assert password not in json.dumps(worker.environ())
    server = psutil.Process(processes["server"]["pid"])
    assert password in server.environ()["PREFECT_API_DATABASE_CONNECTION_URL"]


def test_down_stops_postgresql_and_the_next_up_finds_the_runs(platform, tmp_path):
    run = platform.gpuflow("run", str(_job(tmp_path, "before-restart")), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    run_id = UUID(run.stdout.split("flow run: ")[1].split()[0].rsplit("/", 1)[1])
    processes = platform.state()["processes"]
    down = platform.gpuflow("platform", "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped: admitter, worker, server, postgres" in down.stdout
    assert "runs stay in PostgreSQL" in down.stdout
    for entry in processes.values():
        assert process_gone(entry["pid"]), entry
    up = platform.gpuflow(
        "platform", "up", "--port", str(platform.port), "--database", "postgresql", timeout=300
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert "a new data folder" not in up.stdout
    with platform.client() as client:
        again = client.read_flow_run(run_id)
    assert again.state.is_completed() and again.parameters["spec"]["name"] == "on-postgres"


def test_bad_database_inputs_are_one_sentence_and_start_nothing(tmp_path):
    platform = Platform(tmp_path / "home", free_port())

    def up(*extra: str, **env: str) -> subprocess.CompletedProcess:
        platform.env.update(env)
        return platform.gpuflow("platform", "up", "--port", str(platform.port), *extra, timeout=120)

    bad = up("--database", "mysql")
    assert bad.returncode == 2
    assert "argument --database: invalid choice: 'mysql'" in bad.stderr
    bad = up("--database", "postgresql", GPUFLOW_POSTGRES_BIN=str(tmp_path))
    assert bad.returncode == 2, bad.stdout + bad.stderr
    (line,) = [line for line in bad.stderr.splitlines() if line.strip()]
    assert "GPUFLOW_POSTGRES_BIN:" in line and "initdb, postgres" in line, line
    del platform.env["GPUFLOW_POSTGRES_BIN"]
    # A data folder PostgreSQL cannot start from: the server's own reason, nothing left.
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gpuflow.tasks.platform import postgres; print(postgres.data_folder())",
        ],
        env=platform.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    data = Path(where.stdout.strip())
    data.mkdir(parents=True)
    (data / "PG_VERSION").write_text("15\n")
    try:
        broken = up("--database", "postgresql")
        assert broken.returncode == 1, broken.stdout + broken.stderr
        (line,) = [line for line in broken.stderr.splitlines() if line.startswith("gpuflow:")]
        assert "PostgreSQL exited while starting; its log ends:" in line, line
        assert "Traceback" not in broken.stderr
        assert not (platform.home / "platform" / "state.json").exists()
        assert not [
            p for p in psutil.process_iter(["cmdline"]) if str(data) in (p.info["cmdline"] or [])
        ]
    finally:
        purge_database(platform)
