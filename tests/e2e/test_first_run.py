"""A newcomer's first run: no PREFECT_API_URL, an empty PREFECT_HOME, no bytecode cache, a
busy machine. gpuflow starts its own temporary Prefect API, waits as long as a cold start
takes, and leaves no server behind, however the command ends."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import psutil
import pytest

from tests.e2e.helpers import logs_of, nothing_left, squatted

pytestmark = pytest.mark.e2e
GPUFLOW = [sys.executable, "-m", "gpuflow"]


def fresh_env(tmp_path: Path, home: Path) -> dict[str, str]:
    """A new user's environment: no Prefect settings, empty PREFECT_HOME and bytecode cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        GPUFLOW_HOME=str(home),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PYTHONPYCACHEPREFIX=str(tmp_path / "pycache"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    return env


def servers_of(prefect_home: Path) -> list[psutil.Process]:
    """Return the Prefect servers running on the database under `prefect_home`."""
    found = []
    for proc in psutil.process_iter():
        try:
            program = " ".join(proc.cmdline())
            if "gpuflow.tasks.platform.server" in program and proc.environ().get(
                "PREFECT_HOME"
            ) == str(prefect_home):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def start_run(tmp_path: Path, command: str, env: dict[str, str], **popen) -> subprocess.Popen:
    """Start `gpuflow run` on a command job (`command` in YAML flow style)."""
    job = tmp_path / "job.yaml"
    job.write_text(f"job: {{kind: command, command: {command}}}\n")
    return subprocess.Popen(
        [*GPUFLOW, "run", str(job)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def wait_for(proc: subprocess.Popen, ready, seconds: float = 300) -> None:
    """Return once `ready()` is true; fail if gpuflow exits or the time runs out first."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "gpuflow never got there"
        time.sleep(0.05)


def flow_run_states(env: dict[str, str], monkeypatch) -> list[tuple[str, str]]:
    """Return (state type, message) of every flow run in the database under env's
    PREFECT_HOME, read through a new temporary API on it."""
    import httpx

    from gpuflow.tasks.platform import api

    monkeypatch.setenv("PREFECT_HOME", env["PREFECT_HOME"])
    server = api.start_temporary(lambda _: None)
    try:
        runs = httpx.post(
            f"{server.url}/flow_runs/filter",
            json={},
            timeout=30,
            headers=api.auth_headers(server.auth),
        ).json()
    finally:
        api.stop_server(server.server)
    return [(run["state"]["type"], run["state"]["message"]) for run in runs]


@pytest.fixture
def busy_core():
    """Another program keeping one core busy, as on a developer's machine; stopped by PID."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def test_cold_first_demo_succeeds_and_leaves_no_server(tmp_path, gpuflow_home, busy_core):
    env = fresh_env(tmp_path, gpuflow_home)
    out = subprocess.run([*GPUFLOW, "demo"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "smoke: completed" in out.stdout and "TFLOP/s on" in out.stdout
    assert "[gpuflow] starting a temporary Prefect API" in out.stderr
    assert "[gpuflow] temporary Prefect API ready in" in out.stderr
    assert "Logging error" not in out.stderr and "Traceback" not in out.stderr
    assert "Starting temporary server" not in out.stderr  # Prefect never starts its own
    assert servers_of(tmp_path / "prefect-home") == []
    assert not any((gpuflow_home / "servers").glob("*.json"))
    assert nothing_left(gpuflow_home)


def test_chatty_job_reaches_console_and_api_whole_and_in_order(tmp_path, prefect_api, gpuflow_home):
    from tests.conftest import subprocess_env

    lines = 30_000
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: chatty\njob: {kind: command, command: [sh, -c,"
        f" 'seq 1 {lines}; echo done-on-stderr >&2']}}\n"
    )
    out = subprocess.run(
        [*GPUFLOW, "run", str(job)],
        env=subprocess_env(prefect_api, gpuflow_home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "Logging error" not in console and "Starting temporary server" not in console
    assert numbers_in(console) == lines
    assert "[stderr] done-on-stderr" in console
    (artifacts,) = gpuflow_home.joinpath("runs").iterdir()
    run_id = re.search(r'flow_run_id="([0-9a-f-]{36})"', (artifacts / "metrics.prom").read_text())
    assert numbers_in("\n".join(all_logs(UUID(run_id.group(1))))) == lines


def numbers_in(text: str) -> int:
    """Return how many of 1, 2, 3, ... appear in order as lines (or record tails) of `text`."""
    want = 1
    for line in text.splitlines():
        if line.rsplit(" - ", 1)[-1].strip() == str(want):
            want += 1
    return want - 1


def all_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    logs_of(flow_run_id)  # flushes this process's handler; the logs are the run's own
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                sort=LogSort.TIMESTAMP_ASC,
                offset=len(messages),
                limit=200,
            )
            messages += [log.message for log in page]
            if len(page) < 200:
                return messages


def test_sigterm_while_the_temporary_api_starts_leaves_nothing(tmp_path, gpuflow_home):
    env = fresh_env(tmp_path, gpuflow_home)
    proc = start_run(tmp_path, "[echo, hi]", env)
    wait_for(proc, lambda: list((gpuflow_home / "servers").glob("*.json")))
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-2000:]
    assert "Traceback" not in out
    assert [line for line in out.splitlines() if line.startswith("gpuflow:")] == [
        "gpuflow: stopped by SIGTERM: the job (if one ran) was stopped and torn down, and its"
        " flow run marked Crashed."
    ]
    assert servers_of(tmp_path / "prefect-home") == []
    assert not any((gpuflow_home / "servers").glob("*.json"))


def test_ctrl_c_to_the_process_group_stops_the_job_and_records_the_crash(
    tmp_path, gpuflow_home, monkeypatch
):
    """What a terminal's Ctrl-C does: SIGINT to every process in the foreground group. The
    temporary API is in a session of its own, so it outlives the signal long enough to
    record the run as Crashed."""

    env = fresh_env(tmp_path, gpuflow_home)
    pidfile = tmp_path / "job.pid"
    command = f"[sh, -c, 'echo $$ > {pidfile}; exec sleep 300']"
    # In a process group of its own, as a shell starts a foreground job.
    proc = start_run(tmp_path, command, env, start_new_session=True)
    wait_for(proc, lambda: pidfile.exists() and pidfile.read_text().strip())
    job_pid = int(pidfile.read_text())
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "gpuflow: stopped by SIGINT (Ctrl-C)" in out and "Traceback" not in out
    assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == "zombie"
    assert servers_of(tmp_path / "prefect-home") == []
    assert nothing_left(gpuflow_home)
    assert [state for state, _ in flow_run_states(env, monkeypatch)] == ["CRASHED"]


def test_the_temporary_api_stops_on_sigterm_not_sigkill(tmp_path, gpuflow_home, monkeypatch):
    """It is started with SIGINT and SIGTERM blocked in gpuflow (so that no signal lands
    between starting and recording it); the server itself must not inherit that mask, or
    it ignores SIGTERM and dies by SIGKILL, its last writes lost."""
    from gpuflow.tasks.platform import api

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    server = api.start_temporary(lambda _: None)
    proc = psutil.Process(server.server["pid"])
    assert api.stop_server(server.server)
    assert proc.wait(timeout=30) != -signal.SIGKILL
    assert servers_of(tmp_path / "prefect-home") == []


def test_reap_keeps_what_a_killed_runs_job_wrote_and_finds_a_run_killed_before_provision(
    tmp_path, gpuflow_home, monkeypatch
):
    """Two runs SIGKILLed: one whose job wrote 2,000 outputs and one still waiting for the
    GPU the first holds (its provision not done: no GPU, no job). `gpuflow cancel` ends the second at once
    (its gpuflow is gone: nothing would answer); `gpuflow reap` keeps the first's outputs
    in its artifacts before its workspace goes and marks it Crashed; no record or
    workspace of theirs is left."""
    from tests.conftest import FAKES

    env = fresh_env(tmp_path, gpuflow_home)
    env.update(PYTHONPATH=str(FAKES), FAKE_NVML_GPUS="1")
    pidfile = tmp_path / "job.pid"
    writes = "cd $GPUFLOW_OUTPUT_DIR && seq -f f%04g.txt 1 2000 | xargs touch && echo done > last"
    first = tmp_path / "first.yaml"
    first.write_text(
        "name: first\nresources: {gpus: 1}\njob: {kind: command, command: [sh, -c,"
        f" '{writes}; echo $$ > {pidfile}; exec sleep 300']}}\n"
    )
    second = tmp_path / "second.yaml"
    second.write_text(
        "name: second\nresources: {gpus: 1}\nplacement: {gpu_wait: 900}\n"
        "job: {kind: command, command: [echo, never]}\n"
    )
    runs = [subprocess.Popen([*GPUFLOW, "run", str(first)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)]  # fmt: skip
    wait_for(runs[0], lambda: pidfile.exists() and pidfile.read_text().strip())
    runs.append(subprocess.Popen([*GPUFLOW, "run", str(second)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    in_flight = gpuflow_home / "inflight"
    wait_for(runs[1], lambda: len(list(in_flight.glob("*.json"))) == 2)
    # the temporary API dies under them: its port stays theirs (they send it the auth
    # string), no other local user can take it
    records = [json.loads(p.read_text()) for p in (gpuflow_home / "servers").glob("*.json")]
    assert records
    for record in records:
        os.kill(record["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    for record in records:
        while (
            psutil.pid_exists(record["pid"]) and psutil.Process(record["pid"]).status() != "zombie"
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert squatted(int(record["api"].rsplit(":", 1)[1].split("/")[0])) == []
    for proc in runs:
        proc.kill()
        proc.wait(timeout=30)
    # a cancel of the run whose gpuflow died before provision ends it at once
    cancel = [*GPUFLOW, "cancel", "second"]
    out = subprocess.run(cancel, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert re.search(
        r"is cancelled: its gpuflow \(pid \d+\) had died, so what it left was", out.stdout
    )
    out = subprocess.run([*GPUFLOW, "reap"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "1 flow run(s) marked Crashed" in out.stdout, out.stdout
    assert "the job's outputs were kept: 2001 file(s) in" in out.stdout, out.stdout
    (kept,) = (gpuflow_home / "runs").glob("first-*")
    assert len(list((kept / "outputs").iterdir())) == 2001
    assert (kept / "outputs" / "last").read_text() == "done\n"
    assert nothing_left(gpuflow_home)
    assert servers_of(tmp_path / "prefect-home") == []  # none left by the commands or reap
    states = flow_run_states(env, monkeypatch)
    assert sorted(s for s, _ in states) == ["CANCELLED", "CRASHED"], states


def test_reap_after_sigkill_stops_the_temporary_api_and_marks_the_run_crashed(
    tmp_path, gpuflow_home, monkeypatch
):
    """SIGKILL leaves the job, the temporary API (its own session) and a Running flow run;
    `gpuflow reap` ends all three, the run's state written through that very server."""

    env = fresh_env(tmp_path, gpuflow_home)
    pidfile = tmp_path / "job.pid"
    proc = start_run(tmp_path, f"[sh, -c, 'echo $$ > {pidfile}; exec sleep 300']", env)
    wait_for(proc, lambda: pidfile.exists() and pidfile.read_text().strip())
    job_pid = int(pidfile.read_text())
    (record,) = [json.loads(p.read_text()) for p in (gpuflow_home / "servers").glob("*.json")]
    proc.kill()
    proc.wait(timeout=30)
    assert psutil.pid_exists(job_pid) and psutil.pid_exists(record["pid"])  # both left behind
    out = subprocess.run([*GPUFLOW, "reap"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "1 leftover cluster(s), 1 temporary server(s), 1 flow run(s) marked Crashed" in out.stdout
    )
    assert not psutil.pid_exists(job_pid) or psutil.Process(job_pid).status() == "zombie"
    assert servers_of(tmp_path / "prefect-home") == []
    assert nothing_left(gpuflow_home)
    assert flow_run_states(env, monkeypatch) == [
        ("CRASHED", "its gpuflow process was killed; `gpuflow reap` tore down what it left")
    ]
