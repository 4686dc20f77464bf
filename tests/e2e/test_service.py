"""Services on this machine end to end: replicas behind HAProxy scaled on request rate
(a real load generator, wrk) and on GPU utilisation (fake NVML), to zero and back on a
request, a killed replica replaced with no failed request, and a killed orchestrator's
service reaped. Every test ends with nothing left: no process, no port, no workspace."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

import psutil
import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.spec import load_spec
from tests.conftest import free_port, subprocess_env
from tests.e2e.helpers import NOTHING_LEFT, artifacts_of, events_named, leftovers, logs_of

pytestmark = pytest.mark.e2e
SERVE = str(Path(__file__).resolve().parents[1] / "fixtures" / "service" / "serve.py")
GPUFLOW = [sys.executable, "-m", "gpuflow"]


def replica_pids(home: Path) -> list[int]:
    """Return the replicas running now of the services whose GPUFLOW_HOME is `home` (the
    test's own: other tests may serve beside it), found by their working folder."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if SERVE not in cmdline or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if Path(proc.cwd()).is_relative_to(home):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def endpoint_pids(port: int) -> list[int]:
    """Return the HAProxy processes serving `port`."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["name"] == "haproxy" and proc.info["status"] != psutil.STATUS_ZOMBIE:
            try:
                if any(c.laddr.port == port for c in proc.net_connections("tcp")):
                    found.append(proc.pid)
            except psutil.Error:
                continue
    return found


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:.0f} s"
        time.sleep(0.1)


def events_until(name: str, run_id: str, condition, seconds: float = 60) -> list[dict]:
    """Return the service's events called `name` once `condition(payloads)` holds (events
    reach the server through a background worker, each in its own time)."""
    deadline = time.monotonic() + seconds
    while True:
        found = events_named(name, f"gpuflow.service.{run_id}")
        payloads = [event["payload"] for event in found]
        if condition(payloads):
            return payloads
        assert time.monotonic() < deadline, f"{name}: {payloads}"
        time.sleep(0.5)


def ask(port: int, path: str = "/", timeout: float = 60) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
        return answer.status, answer.read().decode()


def service_spec(port: int, **job) -> dict:
    scaling = job.pop("scaling", {})
    return {
        "name": job.pop("name", "svc"),
        "job": {
            "kind": "service",
            "command": [sys.executable, SERVE],
            "port": port,
            "ready": {"path": "/health", "period_s": 0.2},
            "scaling": {"window_s": 2, "down_after_s": 2, **scaling},
            **job,
        },
        "env": {"SERVE_DELAY_MS": "20"},
        "resources": {"gpus": 1},
        "metrics": {"interval_s": 0.2},
        "limits": {"max_duration": "15m", "stop_grace_s": 5},
    }


class Served:
    """A service run in a thread of this process: its port, flow run and final state."""

    def __init__(self, raw: dict, home: Path) -> None:
        self.raw, self.home = raw, home
        self.port = raw["job"]["port"]
        self.state = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.state = gpu_pipeline(load_spec(self.raw), return_state=True)

    @property
    def run_id(self) -> str:
        (record,) = [
            *(self.home / "local" / "clusters").glob("*.json"),
            *(self.home / "fleet" / "clusters").glob("*.json"),  # a fleet's run, recorded here
        ]
        return record.stem.removeprefix("gpuflow-")

    def cancel(self):
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        run_id = self.run_id
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(UUID(run_id), Cancelling(), force=True)
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "the service did not end when cancelled"
        return run_id

    def result(self) -> dict:
        [path] = (self.home / "runs").glob("*/outputs/result.json")
        return json.loads(path.read_text())


@contextmanager
def serving(raw: dict, home: Path) -> Iterator[Served]:
    served = Served(raw, home)
    served.thread.start()
    try:
        wait_for(lambda: endpoint_pids(served.port), 120, "the endpoint listening")
        yield served
    finally:
        if served.thread.is_alive():
            served.cancel()
    assert served.state is not None and served.state.is_cancelled(), served.state
    wait_for(lambda: not replica_pids(home) and not endpoint_pids(served.port), 30, "all stopped")
    assert leftovers(home) == NOTHING_LEFT


def test_request_rate_scales_one_to_four_replicas_and_back(prefect_api, gpuflow_home, fake_nvml):
    """wrk's bounded load on loopback: 1 -> 4 replicas, every answer 2xx; when it stops,
    back to replicas.min; each decision an event and a row of the run's artifacts."""
    fake_nvml.config["gpus"] = 4
    port = free_port()
    raw = service_spec(port, replicas={"min": 1, "max": 4}, scaling={"rps": 15})
    with serving(raw, gpuflow_home) as served:
        wait_for(lambda: len(replica_pids(gpuflow_home)) == 1, 60, "the first replica")
        assert ask(port)[0] == 200
        load = subprocess.Popen(
            ["wrk", "-t2", "-c8", "-d120s", f"http://127.0.0.1:{port}/"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: len(replica_pids(gpuflow_home)) == 4, 100, "four replicas under load")
        finally:
            load.send_signal(signal.SIGINT)
            said, _ = load.communicate(timeout=30)
        assert re.search(r"(\d+) requests in", said), said
        assert "Non-2xx" not in said and "Socket errors" not in said, said
        wait_for(lambda: len(replica_pids(gpuflow_home)) == 1, 60, "back to one replica")
        run_id = served.cancel()
    result = served.result()
    assert result["most_replicas"] == 4 and result["errors"] == 0
    assert result["requests"] >= int(re.search(r"(\d+) requests in", said).group(1))
    assert result["p50_ms"] is not None and result["p95_ms"] >= result["p50_ms"]
    assert len(result["replicas"]) >= 4 and all(r["gpus"] for r in result["replicas"])
    assert result["gpu_seconds"] > 0
    assert any(r["ended"] == "scaled down" for r in result["replicas"])
    scaled = events_until(
        "gpuflow.service.scaled", run_id, lambda found: any(e["to"] == 1 < e["from"] for e in found)
    )
    ups = [e for e in scaled if e["to"] > e["from"] > 0]
    assert ups and all("requests/s" in up["why"] for up in ups), scaled
    found = artifacts_of(run_id)
    assert "service-svc-scaling" in found
    # the summary (the UI's) has the service's own figures, and says it was cancelled
    summary = found["gpuflow-summary"].data
    assert summary.startswith("# svc: cancelled"), summary[:200]
    assert (
        f"- **{result['requests']} requests** (0 errors), p50 {result['p50_ms']:g} ms," in summary
    )
    assert f"up to 4 replica(s), {result['gpu_seconds']:g} GPU-seconds" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| replica-")]
    assert len(rows) == len(result["replicas"]) and any("scaled down" in row for row in rows)


def test_gpu_utilisation_step_scales_replicas(prefect_api, gpuflow_home, fake_nvml):
    """The replicas' GPUs go from 30 % to 95 % busy (a target of 60 %): up to max; to
    20 %: back down to min."""
    fake_nvml.config["gpus"] = 3
    fake_nvml.config["util"] = 30
    port = free_port()
    raw = service_spec(port, replicas={"min": 1, "max": 3}, scaling={"gpu_util": 60})
    with serving(raw, gpuflow_home) as served:
        wait_for(lambda: len(replica_pids(gpuflow_home)) == 1, 60, "the first replica")
        fake_nvml.config["util"] = 95
        wait_for(lambda: len(replica_pids(gpuflow_home)) == 3, 60, "three replicas on busy GPUs")
        fake_nvml.config["util"] = 20
        wait_for(lambda: len(replica_pids(gpuflow_home)) == 1, 60, "one replica on idle GPUs")
        run_id = served.cancel()
    scaled = events_until(
        "gpuflow.service.scaled", run_id, lambda found: any(e["to"] == 3 for e in found)
    )
    ups = [e for e in scaled if e["to"] > e["from"] > 0]
    assert ups and all("% busy" in up["why"] and "target of 60 %" in up["why"] for up in ups)
    assert all(up["gpu_util"] > 60 for up in ups), ups
    assert served.result()["most_replicas"] == 3


def test_scale_to_zero_then_a_request_waits_for_its_cold_start(
    prefect_api, gpuflow_home, fake_nvml
):
    port = free_port()
    raw = service_spec(
        port, replicas={"min": 0, "max": 1}, scaling={"to_zero_after_s": 2}, name="cold"
    )
    raw["env"]["SERVE_START_S"] = "1.5"  # a slow start, that the request waits for
    with serving(raw, gpuflow_home) as served:
        assert replica_pids(gpuflow_home) == []  # no request yet: nothing runs
        began = time.monotonic()
        assert ask(port) == (200, "replica-1")
        assert time.monotonic() - began >= 1.5
        wait_for(lambda: not replica_pids(gpuflow_home), 60, "scaled to zero")
        assert ask(port) == (200, "replica-2")  # a second cold start
        served.cancel()
    result = served.result()
    assert len(result["cold_start_s"]) == 2 and min(result["cold_start_s"]) >= 1.5
    assert result["errors"] == 0 and result["requests"] == 2


def test_a_killed_replica_is_replaced_and_no_request_fails(prefect_api, gpuflow_home, fake_nvml):
    port = free_port()
    raw = service_spec(port, replicas={"min": 2, "max": 2}, name="sturdy")
    answers: list[int] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            try:
                answers.append(ask(port, timeout=30)[0])
            except OSError:
                answers.append(0)

    with serving(raw, gpuflow_home) as served:
        wait_for(lambda: len(replica_pids(gpuflow_home)) == 2, 60, "two replicas")
        asker = threading.Thread(target=keep_asking)
        asker.start()
        try:
            wait_for(lambda: len(answers) > 20, 60, "requests answered")
            victim = replica_pids(gpuflow_home)[0]
            os.kill(victim, signal.SIGKILL)
            wait_for(
                lambda: (
                    len(replica_pids(gpuflow_home)) == 2
                    and victim not in replica_pids(gpuflow_home)
                ),
                60,
                "the replacement",
            )
            seen = len(answers)
            wait_for(lambda: len(answers) > seen + 20, 60, "requests after the replacement")
        finally:
            stop.set()
            asker.join()
        run_id = served.cancel()
    assert set(answers) == {200}, [a for a in answers if a != 200]
    [replaced] = events_until("gpuflow.service.replaced", run_id, bool)
    assert "its process ended (signal 9)" in replaced["why"]


def test_a_new_version_rolls_out_under_load_with_no_failed_request(
    tmp_path, prefect_api, gpuflow_home, fake_nvml
):
    """`gpuflow service update` with a new command: each replica replaced after its
    successor is ready; then a version whose replica never starts is rolled back."""
    fake_nvml.config["gpus"] = 3
    port = free_port()
    raw = service_spec(port, replicas={"min": 2, "max": 3}, name="rolling")
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def keep_asking() -> None:
        while not stop.is_set():
            try:
                answers.append(ask(port, timeout=30))
            except OSError as exc:
                answers.append((0, str(exc)))

    def update(command: list[str]) -> subprocess.CompletedProcess:
        new = tmp_path / "v.yaml"
        job = {**raw["job"], "command": command}
        new.write_text(json.dumps({**raw, "job": job}))
        env = subprocess_env(prefect_api, gpuflow_home)
        return subprocess.run(
            [*GPUFLOW, "service", "update", str(new)], env=env, capture_output=True, text=True
        )

    def versions_served(last: int) -> set[str]:
        return {body.split()[-1] for _, body in answers[-last:]}

    with serving(raw, gpuflow_home) as served:
        wait_for(lambda: len(replica_pids(gpuflow_home)) == 2, 60, "two replicas")
        asker = threading.Thread(target=keep_asking)
        asker.start()
        try:
            wait_for(lambda: len(answers) > 10, 60, "requests answered")
            out = update([sys.executable, SERVE, "v2"])
            assert out.returncode == 0, out.stderr
            assert "rolling: version 2 rolling out" in out.stdout
            wait_for(lambda: versions_served(20) == {"v2"}, 120, "only v2 answering")
            wait_for(lambda: len(replica_pids(gpuflow_home)) == 2, 60, "two replicas of v2")
            out = update([sys.executable, "-c", "raise SystemExit(3)"])
            assert out.returncode == 0, out.stderr
            run_id = served.run_id
            [back] = events_until("gpuflow.service.rolled_back", run_id, bool, 90)
            seen = len(answers)
            wait_for(lambda: len(answers) > seen + 20, 60, "requests after the roll back")
            assert versions_served(20) == {"v2"}
            bad = {**raw, "job": {**raw["job"], "port": port + 1}}
            (tmp_path / "bad.yaml").write_text(json.dumps(bad))
            refused = subprocess.run(
                [*GPUFLOW, "service", "update", str(tmp_path / "bad.yaml")],
                env=subprocess_env(prefect_api, gpuflow_home),
                capture_output=True,
                text=True,
            )
        finally:
            stop.set()
            asker.join()
        served.cancel()
    assert [a for a in answers if a[0] != 200] == []
    assert "replica" in back["why"] and "never became ready" in back["why"]
    assert refused.returncode == 2
    assert "job.port: a running service keeps its port" in refused.stderr


def test_a_killed_orchestrator_leaves_a_service_that_reap_removes(
    tmp_path, prefect_api, gpuflow_home
):
    port = free_port()
    spec = tmp_path / "service.yaml"
    spec.write_text(
        f"name: orphan\njob: {{kind: service, command: [{sys.executable}, {SERVE}], port: {port},"
        " ready: {path: /health, period_s: 0.2}, replicas: {min: 1, max: 2}}\n"
        "resources: {gpus: 1}\nlimits: {stop_grace_s: 5}\n"
    )
    env = subprocess_env(prefect_api, gpuflow_home, fake_gpus=2)
    proc = subprocess.Popen(
        [*GPUFLOW, "run", str(spec)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_for(lambda: replica_pids(gpuflow_home) and endpoint_pids(port), 120, "the service up")
        wait_for(lambda: ask(port)[0] == 200, 60, "an answer")
    finally:
        proc.kill()  # SIGKILL: no finally, no hooks
        proc.wait(timeout=30)
    assert replica_pids(gpuflow_home) and endpoint_pids(port)  # they outlived their orchestrator
    out = subprocess.run([*GPUFLOW, "reap"], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "1 leftover cluster(s)" in out.stdout, out.stdout
    wait_for(lambda: not replica_pids(gpuflow_home) and not endpoint_pids(port), 90, "all reaped")
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_max_duration_ends_a_service_which_completes_with_its_figures(
    prefect_api, gpuflow_home, fake_nvml
):
    port = free_port()
    raw = service_spec(port, replicas={"min": 1, "max": 1}, name="brief")
    raw["limits"]["max_duration"] = 6
    served = Served(raw, gpuflow_home)
    served.thread.start()
    wait_for(lambda: replica_pids(gpuflow_home) and endpoint_pids(port), 60, "the service up")
    wait_for(lambda: ask(port)[0] == 200, 30, "an answer")
    served.thread.join(timeout=120)
    assert served.state is not None and served.state.is_completed(), served.state
    assert served.result()["requests"] >= 1
    wait_for(lambda: not replica_pids(gpuflow_home) and not endpoint_pids(port), 30, "all stopped")
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_the_documented_service_example_runs_as_docs_services_says(
    tmp_path, prefect_api, gpuflow_home
):
    """docs/services.md's first commands: `gpuflow run examples/service.yaml`, a request,
    `gpuflow cancel service-demo` (on a free port here, the example's folder as it is)."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    raw = yaml.safe_load((root / "examples" / "service.yaml").read_text())
    port = free_port()
    raw["job"].update(port=port, workdir=str(root / "examples" / "service"))
    spec = tmp_path / "service.yaml"
    spec.write_text(yaml.safe_dump(raw))
    env = subprocess_env(prefect_api, gpuflow_home)
    running = subprocess.Popen(
        [*GPUFLOW, "run", str(spec)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: endpoint_pids(port) or running.poll() is not None, 120, "the endpoint")
        status, body = ask(port)
        assert status == 200 and json.loads(body)["replica"] == "replica-1", body
        cancelled = subprocess.run(
            [*GPUFLOW, "cancel", "service-demo"], env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert cancelled.returncode == 0, cancelled.stderr[-2000:]
        out, _ = running.communicate(timeout=120)
    finally:
        if running.poll() is None:
            running.kill()
    assert "gpuflow: cancelled" in out, out[-3000:]
    [result] = (gpuflow_home / "runs").glob("service-demo-*/outputs/result.json")
    assert json.loads(result.read_text())["requests"] >= 1
    assert leftovers(gpuflow_home) == NOTHING_LEFT


CRASH = "import sys; print('cannot load the model', flush=True); sys.exit(3)"
# serves, but on another port than $PORT: never ready
ELSEWHERE = (
    "import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])),"
    " http.server.SimpleHTTPRequestHandler).serve_forever()"
)


@pytest.mark.parametrize("case", ["crash-loop", "wrong-port"])
def test_a_service_whose_replicas_never_serve_fails_with_their_cause(
    case, prefect_api, gpuflow_home, fake_nvml
):
    """Replicas that exit at once, or listen where $PORT is not, are replaced after a
    back-off (1 s, 2 s, ...) and after job.failures_max in a row the run fails with the
    last one's cause: never "completed", never a replica restarted hundreds of times."""
    port, elsewhere = free_port(), free_port()
    command = [sys.executable, "-c", CRASH if case == "crash-loop" else ELSEWHERE]
    if case == "wrong-port":
        command.append(str(elsewhere))
    raw = service_spec(port, replicas={"min": 1, "max": 1}, failures_max=2, command=command)
    raw["job"]["start_timeout_s"] = (
        20  # the wrong-port program listens long before, even on a busy machine
    )
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_failed(), state
    said = str(state.message)
    assert "2 replicas in a row failed to serve (job.failures_max: 2); the last: replica-2" in said
    if case == "crash-loop":
        assert "its process ended (exit code 3): cannot load the model" in said, said
    else:
        assert "not ready within start_timeout_s (20 s)" in said, said
        assert f"it listens on {elsewhere}, not on $PORT (" in said, said
    lines = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "replica-1 failed to serve (1 of job.failures_max 2 in a row); the next replica" in lines
    # who can call the endpoint, said as it starts
    assert "; every user of this machine can call it, nobody else (the endpoint asks" in lines
    assert "replica-3" not in lines  # no replica after the budget
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_an_endpoint_address_not_on_this_machine_is_refused_before_anything_starts(fake_nvml):
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.pipeline.checks import check_spec

    raw = service_spec(free_port(), host="192.0.2.7")  # TEST-NET-1: no machine's own
    with pytest.raises(InvalidSpec) as refused:
        check_spec(load_spec(raw))
    assert str(refused.value) == (
        "job.host: the endpoint cannot listen on 192.0.2.7 on this machine (Cannot assign"
        " requested address); give one of its addresses (127.0.0.1 for this machine alone,"
        " 0.0.0.0 for every network)."
    )
