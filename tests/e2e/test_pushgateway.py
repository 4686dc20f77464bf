"""Metrics pushed to a real Pushgateway (Debian's prometheus-pushgateway) on loopback."""

from __future__ import annotations

import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.spec import load_spec
from tests.conftest import free_port
from tests.e2e.helpers import logs_of

pytestmark = pytest.mark.e2e


LIVE_CHECK = """
import sys, time, urllib.request
deadline = time.time() + 30
while time.time() < deadline:
    text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=5).read().decode()
    if any('job="pushed"' in l and 'stage="run"' in l for l in text.splitlines() if l.startswith("gpuflow_host_cpu_percent")):
        print("live metrics seen")
        sys.exit(0)
    time.sleep(0.2)
sys.exit(1)
"""


def test_run_metrics_reach_the_pushgateway(prefect_api, gpuflow_home, pushgateway):
    """The job itself watches the Pushgateway for its live samples; then the totals land
    and the live group is gone."""
    spec = load_spec(
        {
            "name": "pushed",
            "job": {"kind": "command", "command": [sys.executable, "-c", LIVE_CHECK, pushgateway]},
            "metrics": {"interval_s": 0.2, "push_interval_s": 0.2, "pushgateway": pushgateway},
        }
    )
    state = gpu_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    text = urllib.request.urlopen(f"{pushgateway}/metrics", timeout=5).read().decode()
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("flow_run_id") == run_id
    ]
    by_name = {s.name: s for s in samples}
    assert by_name["gpuflow_run_duration_seconds"].value > 0
    assert by_name["gpuflow_run_duration_seconds"].labels["job"] == "pushed"
    assert "gpuflow_run_host_cpu_mean" in by_name
    assert {s.labels["stage"] for s in samples} == {"summary"}  # the live group was deleted


def test_unreachable_pushgateway_does_not_fail_the_run(prefect_api, gpuflow_home):
    """The warning names the gateway without the password its URL carries."""
    spec = load_spec(
        {
            "job": {"kind": "command", "command": ["true"]},
            "metrics": {"pushgateway": f"http://ops:hunter2@127.0.0.1:{free_port()}"},
        }
    )
    state = gpu_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    said = "\n".join(logs_of(state.state_details.flow_run_id))
    assert "metrics not pushed: could not reach the Pushgateway at http://127.0.0.1:" in said
    assert "hunter2" not in said


def test_a_pushgateway_url_with_credentials_is_pushed_to(prefect_api, gpuflow_home, pushgateway):
    gateway = pushgateway.replace("http://", "http://ops:hunter2@")
    state = gpu_pipeline(
        load_spec(
            {
                "name": "authed",
                "job": {"kind": "command", "command": ["true"]},
                "metrics": {"pushgateway": gateway},
            }
        ),
        return_state=True,
    )
    assert state.is_completed(), state.message
    text = urllib.request.urlopen(f"{pushgateway}/metrics", timeout=5).read().decode()
    assert 'job="authed"' in text and "gpuflow_run_duration_seconds" in text


LOSS_WATCH = """
import sys, time, urllib.request
for step in range(1000):
    print(f"step {step} loss {1 / (step + 1):.4f}", flush=True)
    text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=5).read().decode()
    seen = [l for l in text.splitlines() if l.startswith("gpuflow_job_metric") and 'stage="log"' in l]
    if any('name="loss"' in l for l in seen) and step >= 3:
        print("its own loss seen live", flush=True)
        sys.exit(0)
    time.sleep(0.1)
sys.exit(1)
"""


def test_a_jobs_own_figures_are_pushed_live_then_in_the_summary(
    prefect_api, gpuflow_home, pushgateway
):
    """metrics.from_log: the loss the job prints reaches the Pushgateway while it runs
    (the job sees it there), then its last value is in the run's summary group and the
    live group is gone."""
    spec = load_spec(
        {
            "name": "own-figures",
            "job": {"kind": "command", "command": [sys.executable, "-c", LOSS_WATCH, pushgateway]},
            "metrics": {
                "push_interval_s": 0.1,
                "pushgateway": pushgateway,
                "from_log": [r"step (?P<step>\d+) loss (?P<loss>[\d.]+)"],
                "plot": False,
            },
        }
    )
    state = gpu_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    assert "its own loss seen live" in "\n".join(logs_of(run_id))
    figures = state.result().metrics.from_log
    text = urllib.request.urlopen(f"{pushgateway}/metrics", timeout=5).read().decode()
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("flow_run_id") == run_id and s.name == "gpuflow_job_metric"
    ]
    assert {(s.labels["name"], s.labels["stage"], s.value) for s in samples} == {
        ("loss", "summary", figures["loss"]),
        ("step", "summary", figures["step"]),
    }
