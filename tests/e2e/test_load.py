"""Load: 50 runs submitted at once to the local platform, on a host with 4 (fake) GPUs
and the Prefect global concurrency limit `gpu` at 4: every run completes, never more
than 4 jobs hold GPUs at a time and no two hold the same one, no line is lost, nothing
is left. Prints the runs per minute.

Run on both databases the platform offers: SQLite (the default) and PostgreSQL
(`platform up --database postgresql`). Opt-in (GPUFLOW_LOAD_TEST=1): it takes minutes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import FAKES, free_port
from tests.e2e.helpers import NOTHING_LEFT, Platform, leftovers, purge_database

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1800),  # minutes on 2 cores; the test's own deadline is 1500 s
    pytest.mark.skipif(
        not os.environ.get("GPUFLOW_LOAD_TEST"),
        reason="the load test runs with GPUFLOW_LOAD_TEST=1",
    ),
]
RUNS, GPUS, LINES = 50, 4, 20


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def platform(request, tmp_path_factory):
    home = tmp_path_factory.mktemp(f"load-home-{request.param}")
    platform = Platform(home, free_port())
    platform.env |= {"FAKE_NVML_GPUS": str(GPUS), "PYTHONPATH": str(FAKES)}
    up = platform.gpuflow(
        "platform", "up", "--port", str(platform.port), "--database", request.param, timeout=300
    )
    assert up.returncode == 0, up.stdout + up.stderr
    platform.database = request.param
    yield platform
    platform.gpuflow("platform", "down", timeout=300)
    purge_database(platform)


def _job(events: Path, index: int) -> dict:
    # Each job notes when it holds its GPU (wall clock, the same on this host), then
    # prints its numbered lines.
    script = (
        f'echo "start $(date +%s.%N) $CUDA_VISIBLE_DEVICES" >> {events}/{index};'
        f" for i in $(seq 1 {LINES}); do echo run{index}-line$i; done; sleep 1;"
        f' echo "end $(date +%s.%N)" >> {events}/{index}'
    )
    return {
        "name": f"load-{index}",
        "job": {"kind": "command", "command": ["sh", "-c", script]},
        "resources": {"gpus": 1},
        "placement": {"gpu_wait": "30m"},
    }


def test_fifty_runs_at_once_share_four_gpus(platform, tmp_path):
    from prefect.deployments import run_deployment

    events = tmp_path / "events"
    events.mkdir()
    started = time.monotonic()
    with platform.client():
        runs = [
            run_deployment(
                "gpu-pipeline/command-local", parameters={"spec": _job(events, i)}, timeout=0
            )
            for i in range(RUNS)
        ]
    submitted = time.monotonic() - started
    ids = [run.id for run in runs]
    deadline = time.monotonic() + 1500
    with platform.client() as client:
        while True:
            states = [client.read_flow_run(run_id).state for run_id in ids]
            if all(state is not None and state.is_final() for state in states):
                break
            assert time.monotonic() < deadline, [s.name for s in states if s]
            time.sleep(2)
        took = time.monotonic() - started
        failed = [(s.name, s.message) for s in states if not s.is_completed()]
        assert not failed, failed[:3]
        for index, run_id in enumerate(ids):
            logs = _logs(client, run_id)
            every = [line for message in logs for line in message.splitlines()]
            lines = [line for line in every if line.startswith(f"run{index}-line")]
            assert lines == [f"run{index}-line{i}" for i in range(1, LINES + 1)], (index, logs)
    holds = []
    for index in range(RUNS):
        start, end = (events / str(index)).read_text().splitlines()
        _, at, gpu = start.split()
        holds.append((float(at), float(end.split()[1]), gpu))
    assert max(_overlap(holds)) <= GPUS
    for a in holds:  # no two jobs at once on one GPU
        assert not [b for b in holds if b is not a and b[2] == a[2] and b[0] < a[1] and a[0] < b[1]]
    assert {gpu for _, _, gpu in holds} <= {str(i) for i in range(GPUS)}
    assert leftovers(platform.home) == NOTHING_LEFT
    per_minute = RUNS / (took / 60)
    print(
        f"\n{platform.database}: {RUNS} runs: submitted in {submitted:.1f} s, all completed"
        f" in {took:.0f} s:"
        f" {per_minute:.1f} runs/min; at most {max(_overlap(holds))} held GPUs at once"
    )
    figures = {"database": platform.database, "runs_per_minute": per_minute, "took_s": took}
    (Path(platform.home) / "load.json").write_text(json.dumps(figures))


def _overlap(holds: list[tuple[float, float, str]]) -> list[int]:
    """Return how many holds are open after each event, in time order."""
    edges = sorted([(s, 1) for s, _, _ in holds] + [(e, -1) for _, e, _ in holds])
    open_now, counts = 0, []
    for _, step in edges:
        open_now += step
        counts.append(open_now)
    return counts


def _logs(client, run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    found, offset = [], 0
    while True:
        page = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
            limit=200,
            offset=offset,
        )
        found += [log.message for log in page]
        if len(page) < 200:
            return found
        offset += 200
