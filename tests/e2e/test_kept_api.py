"""The temporary API kept for later commands (GPUFLOW_API_IDLE_S, default 600 s): the
first command starts it, two first commands at once share one, later commands use it and
say so on their first line, Ctrl-C reaches only the command, another GPUFLOW_HOME never
shares it, and nothing is left after its idle period, `gpuflow platform down`, or a
SIGKILL followed by `gpuflow reap`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from gpuflow.tasks.platform.api import auth_headers, health_error
from tests.e2e.helpers import nothing_left, process_gone
from tests.e2e.test_first_run import GPUFLOW, fresh_env, servers_of, start_run, wait_for

pytestmark = pytest.mark.e2e


def kept_env(tmp_path: Path, home: Path, **settings: str) -> dict[str, str]:
    env = fresh_env(tmp_path, home)
    env.pop("GPUFLOW_API_IDLE_S", None)  # the default a user gets
    return env | settings


def records(home: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (home / "servers").glob("*.json")]


def left_in(servers: Path) -> list[str]:
    """Return what a stopped temporary API left in `servers`, less the auth string's file
    (0600), which every later temporary API of that GPUFLOW_HOME uses."""
    assert (servers / "auth").stat().st_mode & 0o777 == 0o600
    return sorted(p.name for p in servers.iterdir() if p.name != "auth")


def first_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("[gpuflow]"))


def states(api: str, home: Path) -> list[str]:
    auth = (home / "servers" / "auth").read_text().strip()
    runs = httpx.post(
        f"{api}/flow_runs/filter", json={}, timeout=30, headers=auth_headers(auth)
    ).json()
    return sorted(run["state"]["type"] for run in runs)


def test_later_commands_share_the_kept_api_and_nothing_is_left(tmp_path, gpuflow_home):
    env = kept_env(tmp_path, gpuflow_home)
    # Two first commands at once: one starts the API, the other waits for it and uses it.
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    both = [start_run(tmp_path / name, "[echo, hi]", env) for name in ("a", "b")]
    outs = [proc.communicate(timeout=600)[0] for proc in both]
    assert [proc.returncode for proc in both] == [0, 0], outs
    firsts = sorted(first_line(out) for out in outs)
    assert firsts[0].startswith(
        "[gpuflow] starting a temporary Prefect API, kept for later commands until 600 s"
        " without one"
    ), firsts
    (record,) = records(gpuflow_home)
    assert firsts[1] == (
        f"[gpuflow] using the temporary Prefect API kept at {record['api']} (pid"
        f" {record['pid']}, started by an earlier command; it stops after 600 s without one)"
    )
    assert [p.pid for p in servers_of(tmp_path / "prefect-home")] == [record["pid"]]
    assert states(record["api"], gpuflow_home) == ["COMPLETED", "COMPLETED"]
    # `ls` and `logs` find the runs on the kept API, and start no other
    listed = subprocess.run([*GPUFLOW, "ls"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-3000:]
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert sorted(row[2] for row in rows) == ["Completed", "Completed"]
    assert f"using the temporary Prefect API kept at {record['api']}" in listed.stderr
    logs = subprocess.run(
        [*GPUFLOW, "logs", rows[0][0]], env=env, capture_output=True, text=True, timeout=120
    )
    assert logs.returncode == 0 and "hi" in logs.stdout.split(), logs.stderr[-3000:]

    # Ctrl-C to a later command's process group stops the command, not the kept API, and
    # the run is recorded Crashed through it.
    pidfile = tmp_path / "job.pid"
    command = f"[sh, -c, 'echo $$ > {pidfile}; exec sleep 300']"
    proc = start_run(tmp_path, command, env, start_new_session=True)
    wait_for(proc, lambda: pidfile.exists() and pidfile.read_text().strip())
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert first_line(out).startswith("[gpuflow] using the temporary Prefect API kept at")
    assert health_error(record["api"], timeout_s=10) is None
    assert states(record["api"], gpuflow_home) == ["COMPLETED", "COMPLETED", "CRASHED"]

    # Another GPUFLOW_HOME (the same PREFECT_HOME) never shares it; `platform down` there
    # stops its own server and leaves this one.
    other = tmp_path / "other-home"
    out = subprocess.run(
        [*GPUFLOW, "run", str(tmp_path / "a" / "job.yaml")],
        env=env | {"GPUFLOW_HOME": str(other)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert first_line(out.stderr).startswith("[gpuflow] starting a temporary Prefect API")
    (theirs,) = records(other)
    assert theirs["pid"] != record["pid"]
    down = subprocess.run(
        [*GPUFLOW, "platform", "down"],
        env=env | {"GPUFLOW_HOME": str(other)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"stopped the temporary Prefect API at {theirs['api']}" in down.stdout
    assert process_gone(theirs["pid"]) and not records(other)
    assert left_in(other / "servers") == []
    assert [p.pid for p in servers_of(tmp_path / "prefect-home")] == [record["pid"]]

    # A command killed by SIGKILL leaves its job and the kept API: `gpuflow reap` ends both.
    pidfile.unlink()
    proc = start_run(tmp_path, command, env)
    wait_for(proc, lambda: pidfile.exists() and pidfile.read_text().strip())
    job_pid = int(pidfile.read_text())
    proc.kill()
    proc.wait(timeout=30)
    out = subprocess.run([*GPUFLOW, "reap"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "1 leftover cluster(s), 1 temporary server(s), 1 flow run(s) marked Crashed" in out.stdout
    )
    assert process_gone(job_pid) and process_gone(record["pid"])
    assert servers_of(tmp_path / "prefect-home") == []
    assert left_in(gpuflow_home / "servers") == []
    assert nothing_left(gpuflow_home)


def test_a_kept_api_stops_by_itself_after_its_idle_period(tmp_path, gpuflow_home):
    env = kept_env(tmp_path, gpuflow_home, GPUFLOW_API_IDLE_S="3")
    job = tmp_path / "job.yaml"
    job.write_text("job: {kind: command, command: [echo, hi]}\n")
    out = subprocess.run(
        [*GPUFLOW, "run", str(job)], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kept for later commands until 3 s without one" in first_line(out.stderr)
    (record,) = records(gpuflow_home)
    deadline = time.monotonic() + 120
    while not process_gone(record["pid"]):  # a second or two after its idle period
        assert time.monotonic() < deadline, "the kept API never stopped"
        time.sleep(0.2)
    assert servers_of(tmp_path / "prefect-home") == []
    assert left_in(gpuflow_home / "servers") == []  # record, leases and log gone
    assert nothing_left(gpuflow_home)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_nobody_else_reaches_a_kept_api_its_secrets_or_its_database(tmp_path, monkeypatch):
    """A temporary API admits only its user: another local user (nobody) reads neither
    GPUFLOW_HOME nor the auth string, and the API answers them 401 (block secrets, the
    deployments) or 421 (a name rebound to 127.0.0.1). An older PREFECT_HOME whose database
    was 0644 is narrowed to this user's."""
    from gpuflow.tasks.platform import api
    from tests.e2e.helpers import SHUT_OUT, outsider, shared_folder, wider_than_private

    shared = shared_folder("gpuflow-kept-")
    home, prefect_home = shared / "gpuflow-home", shared / "prefect-home"
    prefect_home.mkdir(mode=0o755)
    (prefect_home / "prefect.db").touch(mode=0o644)  # as an older Prefect left it
    monkeypatch.setenv("GPUFLOW_HOME", str(home))
    monkeypatch.setenv("PREFECT_HOME", str(prefect_home))
    server = api.start_temporary(lambda _: None, keep_s=0)
    try:
        assert outsider(home, server.url, home / "servers" / "auth") == SHUT_OUT
        assert wider_than_private(home) == [] and wider_than_private(prefect_home) == []
        import psutil

        assert server.auth and server.auth not in " ".join(
            psutil.Process(server.server["pid"]).cmdline()
        )
        answer = httpx.post(
            f"{server.url}/flow_runs/filter", json={}, headers=auth_headers(server.auth)
        )
        assert answer.status_code == 200
    finally:
        api.stop_server(server.server)
        shutil.rmtree(shared)


def test_fifos_where_gpuflow_keeps_its_records_hang_no_command(tmp_path, gpuflow_home):
    """A FIFO where a kept API's record or a command's lease should be (anyone who can
    write to GPUFLOW_HOME could leave one) is never opened for reading: `run`, `reap` and
    `platform down` go on, and the run still gets its API."""
    servers = gpuflow_home / "servers"
    (servers / "4243.leases").mkdir(parents=True)
    os.mkfifo(servers / "4242.json")
    os.mkfifo(servers / "4243.leases" / "777")
    planted = ["local/clusters/gpuflow-evil.json", "local/gpus/0.json", "unreported/x.json"]
    planted += ["fleet/clusters/gpuflow-evil.json"]
    for where in planted:
        (gpuflow_home / where).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(gpuflow_home / where)
    env = kept_env(tmp_path, gpuflow_home, GPUFLOW_API_IDLE_S="0")
    for argv in (["reap"], ["platform", "down"]):
        done = subprocess.run(
            [*GPUFLOW, *argv], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        if argv == ["reap"]:  # named, and the rest reaped
            assert f"passed over {gpuflow_home}/local/clusters/gpuflow-evil.json" in done.stderr
    proc = start_run(tmp_path, "[echo, past-the-fifos]", env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "past-the-fifos" in out, out[-3000:]
