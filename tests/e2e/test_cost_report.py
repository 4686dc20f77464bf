"""The cost report over real runs on the test Prefect server: its sums are the runs' own
summaries, grouped by job, backend and GPU product; a day over budget emits an event."""

from __future__ import annotations

import sys
from datetime import UTC, datetime

import pytest

from gpuflow.flows.cost_report import cost_report
from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.spec import load_spec
from tests.e2e.helpers import artifacts_of, events_named

pytestmark = pytest.mark.e2e


def _run(name: str, gpus: int, seconds: float) -> object:
    raw = {
        "name": name,
        "job": {"kind": "command", "command": [sys.executable, "-c", f"import time; time.sleep({seconds})"]},
        "resources": {"gpus": gpus},
        "placement": {"block": "gpuflow-priced-host"},
        "metrics": {"interval_s": 0.1, "plot": False},
    }  # fmt: skip
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    return state.result()


def _window(since: datetime, until: datetime) -> str:
    """The window from `since` to `until`, never wider: a run of an earlier test that ended
    just before `since` is not this test's."""
    return f"{int((until - since).total_seconds() * 1000) / 1000:.3f}s"


def test_the_report_adds_up_the_runs_own_summaries(prefect_api, gpuflow_home, fake_nvml):
    from gpuflow.blocks import LocalGpuHost

    LocalGpuHost(gpu_hourly_usd=36.0).save("gpuflow-priced-host", overwrite=True)  # 1 ¢/s
    since = datetime.now(UTC)
    fake_nvml.config["util"] = 0
    idle = [_run("train-a", 1, 1.0), _run("train-a", 2, 0.5)]
    fake_nvml.config["util"] = 90
    busy = [_run("render-b", 1, 1.0)]
    until = datetime.now(UTC)
    runs = idle + busy
    window = _window(since, until)

    report = cost_report(window=window, until=until.isoformat(), budget_usd_per_day=0.001)

    assert report["runs"] == 3
    assert report["cost_usd"] == pytest.approx(sum(r.metrics.cost_usd for r in runs))
    assert report["gpu_hours"] == pytest.approx(sum(r.metrics.gpu_hours for r in runs))
    jobs = report["by_job"]
    assert jobs["train-a"]["runs"] == 2
    assert jobs["train-a"]["cost_usd"] == pytest.approx(sum(r.metrics.cost_usd for r in idle))
    assert jobs["train-a"]["gpu_hours_idle"] == pytest.approx(jobs["train-a"]["gpu_hours"])
    assert jobs["render-b"]["gpu_hours_idle"] == 0
    assert set(report["by_backend"]) == {"local"}
    [product] = {p for r in runs for p in r.cluster.gpu_products}
    assert report["by_gpu_product"][product]["gpu_hours"] == pytest.approx(report["gpu_hours"])
    assert report["cost_usd"] > 0.001  # so the day is over the budget
    today = str(until.date())
    assert list(report["over_budget"]) == [today]
    [event, *_] = events_named("gpuflow.budget.exceeded", f"gpuflow.budget.{today}")
    assert event["payload"]["spend_usd"] == pytest.approx(report["cost_usd"], rel=1e-4)

    with open(report["chart"], "rb") as chart:
        assert chart.read(8) == b"\x89PNG\r\n\x1a\n"

    within = cost_report(window=window, until=until.isoformat(), budget_usd_per_day=1000.0)
    assert within["over_budget"] == {} and within["cost_usd"] == report["cost_usd"]


def test_the_markdown_lists_every_group(prefect_api, gpuflow_home, fake_nvml):
    from gpuflow.blocks import LocalGpuHost

    LocalGpuHost(gpu_hourly_usd=36.0).save("gpuflow-priced-host", overwrite=True)
    since = datetime.now(UTC)
    result = _run("sweep-c", 1, 0.3)
    until = datetime.now(UTC)
    window = _window(since, until)
    state = cost_report(window=window, until=until.isoformat(), return_state=True)
    text = str(artifacts_of(state.state_details.flow_run_id)["gpuflow-cost-report"].data)
    assert "## by job" in text and "## by backend" in text and "## by GPU product" in text
    assert (
        f"| sweep-c | 1 | {result.metrics.gpu_hours:.3f} | {result.metrics.cost_usd:.2f} |" in text
    )


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"window": "soon"}, "window: 'soon' is not a duration"),
        ({"window": "0s"}, "window must be at least 1s (got '0s')"),
        ({"budget_usd_per_day": -5}, "budget_usd_per_day must be more than 0 (got -5)"),
        ({"until": "yesterday"}, "until: 'yesterday' is not a date and time"),
    ],
)
def test_bad_report_settings_are_refused_by_name(prefect_api, gpuflow_home, kwargs, said):
    with pytest.raises(InvalidSpec) as caught:
        cost_report(**kwargs)
    assert said in str(caught.value)
