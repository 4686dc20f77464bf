"""The Prefect API killed (SIGKILL) while `gpuflow run` runs a job: a server of the test's
own, on a port and database of its own, stopped and started again at the boundary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest

from tests.conftest import free_port, subprocess_env
from tests.e2e.helpers import NOTHING_LEFT, leftovers

pytestmark = pytest.mark.e2e
GPUFLOW = [sys.executable, "-m", "gpuflow"]


class Server:
    """A Prefect API server (uvicorn, no UI) on `port`, keeping its runs in `db`."""

    def __init__(self, port: int, db: Path, log: Path) -> None:
        self.port, self.db, self.log = port, db, log
        self.url = f"http://127.0.0.1:{port}/api"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        import prefect

        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env |= {
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.db}",
            "PREFECT_UI_ENABLED": "0",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_HOME": str(self.db.parent / "prefect-home"),
        }
        argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent)]
        argv += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out)
        from gpuflow.tasks.platform.api import health_error

        deadline = time.monotonic() + 180
        while health_error(self.url, timeout_s=2):
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the test's Prefect server did not start"
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def state_of(self, run_id: str) -> str:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.url}), get_client(sync_client=True) as c:
            return c.read_flow_run(UUID(run_id)).state.type.value

    def ticks_logged(self, run_id: str) -> list[str]:
        """Return the job's `tick N` lines the API holds for the run, in time order."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.url}), get_client(sync_client=True) as c:
            logs = c.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)])),
                limit=200,
            )
        return [log.message for log in logs if log.message.startswith("tick ")]


@pytest.fixture
def server(tmp_path):
    server = Server(free_port(), tmp_path / "prefect.db", tmp_path / "server.log")
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.terminate()
        server.proc.wait(timeout=30)


def _start(tmp_path: Path, server: Server, gpuflow_home: Path, outage_s: int):
    ticks = tmp_path / "ticks"
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: outage\njob: {kind: command, command: [sh, -c,"
        f" 'for i in 1 2 3 4 5 6 7 8; do echo tick $i; echo $i >> {ticks}; sleep 1; done']}}\n"
    )
    env = subprocess_env(server.url, gpuflow_home) | {"GPUFLOW_API_OUTAGE_S": str(outage_s)}
    proc = subprocess.Popen(
        [*GPUFLOW, "run", str(job)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (ticks.exists() and len(ticks.read_text().split()) >= 2):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.1)
    (record,) = (gpuflow_home / "local" / "clusters").glob("*.json")
    return proc, record.stem.removeprefix("gpuflow-"), ticks, env


def test_an_api_back_within_the_bound_loses_nothing(tmp_path, server, gpuflow_home):
    """Killed at the job's second line, started again on the same port and database a few
    seconds later: the job runs to its end, the run completes in the API."""
    proc, run_id, ticks, _ = _start(tmp_path, server, gpuflow_home, outage_s=300)
    server.kill()
    time.sleep(3)
    server.start()
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    assert ticks.read_text().split() == [str(i) for i in range(1, 9)]
    assert "Traceback" not in out
    assert server.state_of(run_id) == "COMPLETED"
    assert server.ticks_logged(run_id) == [f"tick {i}" for i in range(1, 9)]  # none lost
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_an_api_that_stays_away_ends_the_run_cleanly_and_reap_marks_it(
    tmp_path, server, gpuflow_home
):
    """Killed at the job's second line and not back within GPUFLOW_API_OUTAGE_S: the job
    still runs to its end, the run is torn down, one sentence, exit 1; once the server is
    back, `gpuflow reap` marks the run Crashed."""
    proc, run_id, ticks, env = _start(tmp_path, server, gpuflow_home, outage_s=3)
    server.kill()
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    assert ticks.read_text().split() == [str(i) for i in range(1, 9)]  # the job ran on
    (sentence,) = [line for line in out.splitlines() if line.startswith("gpuflow:")]
    assert f"the Prefect API at {server.url} stopped answering" in sentence
    assert "did not come back within 3 s" in sentence and "`gpuflow reap`" in sentence
    assert "log lines kept" in sentence
    assert "Traceback" not in out and "Error logging to API" not in out
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    unreported = gpuflow_home / "unreported" / f"{run_id}.json"
    assert json.loads(unreported.read_text())["api_url"] == server.url
    server.start()
    assert server.state_of(run_id) == "RUNNING"
    reaped = subprocess.run(
        [*GPUFLOW, "reap"], env=env, capture_output=True, text=True, timeout=300
    )
    assert reaped.returncode == 0, reaped.stdout + reaped.stderr
    assert f"flow run {run_id} marked Crashed" in reaped.stdout
    assert f"flow run {run_id}: " in reaped.stdout and "delivered" in reaped.stdout
    assert server.state_of(run_id) == "CRASHED"
    # The lines the job printed while the API was away reached it once it was back.
    assert server.ticks_logged(run_id) == [f"tick {i}" for i in range(1, 9)]
    assert not unreported.exists()
    assert not list(unreported.parent.glob("*.logs.jsonl"))
