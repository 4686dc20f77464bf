"""infra/grafana/gpuflow.json: every panel's PromQL runs against a real Prometheus that
scrapes a Pushgateway holding what gpuflow pushes (real runs' totals, live samples from
its sampler), and must return series; a query naming a metric nobody writes fails."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.metrics.prometheus import exposition, push
from gpuflow.tasks.metrics.sampler import Sampler, read_samples
from gpuflow.tasks.spec import load_spec
from tests.conftest import free_port, load_fake_nvml

pytestmark = pytest.mark.e2e
DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "gpuflow.json"
METRIC = re.compile(r"\b(DCGM_FI_[A-Z_]+|gpuflow_[a-z0-9_]+)\b")


def _targets() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":  # a heading (Services, Streams): no query of its own
            assert panel["title"] and not panel.get("targets"), panel
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["refId"], panel["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource"}


def _live(gateway: str, run_id: str, job: str, util: float | None, tmp_path: Path) -> None:
    """Push a live sample taken by gpuflow's sampler from a fake-NVML GPU at `util` %."""
    nvml = load_fake_nvml(gpus=2, util=util)
    path = tmp_path / f"{run_id}.jsonl"
    with Sampler(path, [0, 1], 0.05, nvml_module=nvml):
        time.sleep(0.2)
    sample = read_samples(path)[-1]
    push(gateway, exposition(sample, None, run_id, job), run_id, job, "run")


def _service(gateway: str, home: Path) -> None:
    """A service that answers a few requests, its figures pushed as it serves and ends."""
    from tests.e2e.test_service import ask, service_spec, serving

    port = free_port()
    raw = service_spec(port, replicas={"min": 1, "max": 1}, name="dash-service")
    raw["placement"] = {"block": "gpuflow-dash-host"}
    raw["metrics"] |= {"pushgateway": gateway, "push_interval_s": 0.5, "plot": False}
    with serving(raw, home):
        for _ in range(5):
            assert ask(port)[0] == 200


def _stream(gateway: str) -> None:
    """A stream replica's push of one client's figures (what its server pushes)."""
    from gpuflow.tasks.stream import metrics
    from gpuflow.tasks.stream.model import StreamFigures

    stage = {"p50": 5.0, "p95": 9.0, "p99": 12.0}
    done = StreamFigures.model_validate(
        {
            "client": "replica-1-client1", "width": 1920, "height": 1080, "encoder": "x264",
            "seconds": 10, "frames_sent": 300, "frames_shown": 298, "fps": 29.8,
            "bitrate_kbps": 900, "dropped": 2, "capture_to_display": stage,
            "input_to_photon": stage,
            "stages": {s: stage for s in ("render", "encode", "send", "decode", "draw")},
        }
    )  # fmt: skip
    run = {"flow_run_id": "stream-run", "job": "dash-stream"}
    push(gateway, metrics.exposition([done], run), "stream-run", "dash-stream", "stream-replica-1")


def test_every_panel_returns_series_from_gpuflows_metrics(
    prefect_api, gpuflow_home, fake_nvml, prometheus, tmp_path
):
    from gpuflow.blocks import LocalGpuHost

    LocalGpuHost(gpu_hourly_usd=3.6).save("gpuflow-dash-host", overwrite=True)
    for name, command in (("dash-ok", "pass"), ("dash-bad", "raise SystemExit(3)")):
        raw = {
            "name": name,
            "job": {"kind": "command", "command": [sys.executable, "-c", command]},
            "resources": {"gpus": 1},
            "placement": {"block": "gpuflow-dash-host"},
            "metrics": {"interval_s": 0.1, "pushgateway": prometheus.gateway, "plot": False},
        }
        gpu_pipeline(load_spec(raw), return_state=True)
    _service(prometheus.gateway, gpuflow_home)
    _stream(prometheus.gateway)
    _live(prometheus.gateway, "live-idle", "dash-idle", 0, tmp_path)
    _live(prometheus.gateway, "live-busy", "dash-busy", None, tmp_path)

    targets = _targets()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until a scrape holds everything
        empty = [(title, expr) for title, expr in targets if not prometheus.query(expr)]
        if not empty:
            break
        time.sleep(0.5)
    assert not empty, f"panels without series: {empty}"
    written = set(prometheus.query_names())
    for title, expr in targets:
        named = set(METRIC.findall(expr))
        assert named and named <= written, f"{title}: {sorted(named - written)} is never written"
    outcomes = {s["metric"]["outcome"] for s in prometheus.query(dict(targets)["Run outcomes"])}
    assert outcomes == {"completed", "failed", "cancelled"}  # the service ends by a cancel
    [idle] = prometheus.query(dict(targets)["Idle GPUs held (under 5%)"])
    assert float(idle["value"][1]) == 2  # live-idle's two GPUs
