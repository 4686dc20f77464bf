"""Fleet-wide reclaim with a real Prometheus scraping the Pushgateway and a real Prefect
server: three real runs push live samples from fake-NVML GPUs; the idle one is warned,
then cancelled (its own teardown runs), the kept and the busy ones are left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from uuid import UUID

import pytest

from gpuflow.flows.reclaim import reclaim
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform import reclaim as reclaiming
from tests.conftest import free_port, subprocess_env
from tests.e2e.helpers import ROOT, events_named, flow_run, nothing_left

pytestmark = pytest.mark.e2e

RUN_TAGGED = """
import json, sys
from prefect import tags
from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.spec import load_spec
with tags(*sys.argv[2:]):
    gpu_pipeline(load_spec(json.loads(sys.argv[1])), return_state=True)
"""


def _start(name: str, util: int, tags: list[str], prefect_api, gateway, tmp_path):
    home = tmp_path / f"home-{name}"
    env = subprocess_env(prefect_api, home, fake_gpus=1) | {"FAKE_NVML_UTIL": str(util)}
    raw = {
        "name": name,
        "job": {
            "kind": "command",
            "command": [sys.executable, "-c", "import time; time.sleep(600)"],
        },
        "resources": {"gpus": 1},
        "limits": {"max_duration": "2h"},
        "metrics": {"interval_s": 0.2, "push_interval_s": 0.2, "pushgateway": gateway},
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_TAGGED, json.dumps(raw), *tags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / f"{name}.log").open("w"),
        start_new_session=True,
    )
    return proc, home


def _run_ids(prometheus, names: set[str], deadline_s: float = 180) -> dict[str, str]:
    """Wait until every named run has reported for a few seconds; return job -> run id."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        series = prometheus.query('DCGM_FI_DEV_GPU_UTIL{stage="run"} offset 4s')
        found = {s["metric"]["job"]: s["metric"]["flow_run_id"] for s in series}
        if names <= set(found):
            return found
        time.sleep(0.5)
    pytest.fail(f"runs {sorted(names)} never reported to Prometheus")


def _cancel(run_id: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(run_id), Cancelling(), force=True)


def test_reclaim_cancels_the_idle_run_and_spares_the_kept_and_busy(
    prefect_api, prometheus, tmp_path
):
    started = {
        "idle-run": _start("idle-run", 0, [], prefect_api, prometheus.gateway, tmp_path),
        "kept-run": _start("kept-run", 0, ["gpuflow.io/keep"], prefect_api, prometheus.gateway, tmp_path),
        "busy-run": _start("busy-run", 90, [], prefect_api, prometheus.gateway, tmp_path),
    }  # fmt: skip
    try:
        ids = _run_ids(prometheus, set(started))
        idle_id, kept_id, busy_id = ids["idle-run"], ids["kept-run"], ids["busy-run"]

        looked = reclaim(prometheus.url, window="3s", grace="0s", dry_run=True)
        assert looked["cancel"] == [idle_id] and looked["spared"] == [kept_id]
        assert looked["gpu_hours_saved"] > 1.9  # 1 GPU, ~2 h of limits.max_duration left
        assert all(flow_run(i).state.is_running() for i in ids.values())  # nothing cancelled

        warned = reclaim(prometheus.url, window="3s", grace="1h")  # not idle for 1 h yet
        assert warned["warned"] == 1 and warned["cancel"] == []
        [event, *_] = events_named("gpuflow.gpu.idle", f"gpuflow.run.{idle_id}")
        assert event["payload"]["source"] == "reclaim"
        assert flow_run(idle_id).state.is_running()

        done = reclaim(prometheus.url, window="3s", grace="0s")
        assert done["cancel"] == [idle_id] and done["spared"] == [kept_id]
        proc, home = started["idle-run"]
        proc.wait(timeout=120)
        state = flow_run(idle_id).state
        assert state.is_cancelled(), state
        assert nothing_left(home)  # its own teardown ran
        assert flow_run(kept_id).state.is_running() and flow_run(busy_id).state.is_running()
        assert started["kept-run"][0].poll() is None and started["busy-run"][0].poll() is None
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in started.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("prometheus:9090", 5, "15m", "10m"),
            "prometheus_url: 'prometheus:9090' is not an http(s) URL",
        ),
        (("http://p:9090", 0, "15m", "10m"), "below_pct must be over 0 and at most 100 (got 0)"),
        (("http://p:9090", 5, "soon", "10m"), "window: 'soon' is not a duration"),
        (("http://p:9090", 5, "0s", "10m"), "window must be at least 1s"),
        (("http://p:9090", 5, "15m", "-1m"), "grace: '-1m' is not a duration"),
    ],
)
def test_bad_reclaim_settings_are_refused_by_name(args, said):
    with pytest.raises(InvalidSpec) as caught:
        reclaiming.check(*args)
    assert said in str(caught.value)


@pytest.mark.parametrize("credentials", ["", "ops:hunter2@"])
def test_unreachable_prometheus_is_named_with_its_cause(prefect_api, tmp_path, credentials):
    """Named with its cause, and without the password a URL may carry."""
    port = free_port()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuflow",
            "reclaim",
            "--prometheus",
            f"http://{credentials}127.0.0.1:{port}",
            "--dry-run",
        ],
        env=subprocess_env(prefect_api, tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert (
        f"could not reach Prometheus at http://127.0.0.1:{port}: [Errno 111] Connection refused"
        in (done.stdout + done.stderr)
    )
    assert "Traceback" not in done.stderr
    assert "hunter2" not in done.stdout + done.stderr
