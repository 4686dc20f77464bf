"""Services on a fleet: each replica claims GPUs on a fleet host of its own as the load
says and gives them back when scaled away; the endpoint (HAProxy) runs here, in front of
the hosts' addresses, and dies with the gpuflow process that started it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
import yaml

from gpuflow.tasks.spec import load_spec
from tests.conftest import free_port
from tests.e2e.fleet_bed import claims_on, fleet_bed, host_entry, records_on, save_fleet
from tests.e2e.helpers import process_gone
from tests.e2e.test_service import (
    SERVE,
    Served,
    ask,
    endpoint_pids,
    events_until,
    service_spec,
    wait_for,
)

pytestmark = pytest.mark.e2e
HOSTS = ["s1:2", "s2:2"]
GPUFLOW = [sys.executable, "-m", "gpuflow"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory, prefect_api):
    """Fleet `serving`: two hosts with 2 GPUs each, applied."""
    with fleet_bed(tmp_path_factory.mktemp("fleet") / "bed", HOSTS) as found:
        save_fleet(found, "serving", [host_entry(found, n) for n in ("s1", "s2")], lease_s=10)
        env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            "GPUFLOW_HOME": str(tmp_path_factory.mktemp("home")),
        }
        done = subprocess.run(
            [*GPUFLOW, "fleet", "apply", "serving"], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield found


def held(bed: dict) -> dict[str, int]:
    """Return the GPUs claimed on each host of the bed now."""
    return {host: len(claims_on(bed, host)) for host in ("s1", "s2")}


def replicas_on_hosts(bed: dict) -> list[psutil.Process]:
    """Return the replicas running on the bed's hosts (their workspace is there)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if SERVE not in (proc.info["cmdline"] or []) or proc.info["status"] == "zombie":
            continue
        with contextlib.suppress(psutil.Error):
            if str(bed["dir"]) in proc.environ().get("GPUFLOW_WORKSPACE", ""):
                found.append(proc)
    return found


def cancelled_and_gone(served: Served, bed: dict, home) -> None:
    """Assert the service ended cancelled and left no replica, endpoint, claim or record."""
    assert served.state is not None and served.state.is_cancelled(), served.state
    port = served.port
    wait_for(lambda: not replicas_on_hosts(bed) and not endpoint_pids(port), 60, "all stopped")
    assert held(bed) == {"s1": 0, "s2": 0}
    assert records_on(bed, "s1") == [] and records_on(bed, "s2") == []
    assert not list((home / "fleet" / "clusters").glob("*.json"))


def fleet_service(port: int, **job) -> dict:
    """A service of the test replica on fleet `serving`, each replica listening where the
    endpoint here reaches it."""
    raw = service_spec(port, name=job.pop("name", "fleet-svc"), **job)
    raw["env"]["SERVE_HOST"] = "0.0.0.0"
    return raw | {"placement": {"backend": "fleet", "fleet": "serving"}}


@pytest.mark.timeout(420)
def test_replicas_claim_fleet_hosts_as_the_load_grows_and_give_them_back(
    bed, prefect_api, gpuflow_home
):
    """wrk's bounded load: 1 -> 3 replicas, each a claim of one GPU on a host of the
    fleet (two hosts, so both serve), every answer 2xx through the endpoint here; when the
    load stops, back to one claim; cancelled, no claim, record or process is left."""
    port = free_port()
    raw = fleet_service(port, replicas={"min": 1, "max": 3}, scaling={"rps": 15})
    served = Served(raw, gpuflow_home)
    served.thread.start()
    try:
        wait_for(lambda: endpoint_pids(port), 120, "the endpoint listening")
        wait_for(lambda: len(replicas_on_hosts(bed)) == 1, 120, "the first replica")
        assert sum(held(bed).values()) == 1
        status, said = ask(port)
        assert (status, said) == (200, "replica-1")
        load = subprocess.Popen(
            ["wrk", "-t2", "-c8", "-d120s", f"http://127.0.0.1:{port}/"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: len(replicas_on_hosts(bed)) == 3, 120, "three replicas under load")
            claims = held(bed)
            assert sum(claims.values()) == 3 and all(claims.values()), claims  # both hosts
        finally:
            load.send_signal(signal.SIGINT)
            text, _ = load.communicate(timeout=30)
        assert re.search(r"(\d+) requests in", text), text
        assert "Non-2xx" not in text and "Socket errors" not in text, text
        wait_for(lambda: sum(held(bed).values()) == 1, 90, "two claims given back")
        run_id = served.cancel()
    finally:
        if served.thread.is_alive():
            served.cancel()
    cancelled_and_gone(served, bed, gpuflow_home)
    [path] = (gpuflow_home / "runs").glob("*/outputs/result.json")
    result = json.loads(path.read_text())
    assert result["most_replicas"] == 3 and result["errors"] == 0
    hosts = {r["host"] for r in result["replicas"]}
    assert hosts == {"s1", "s2"}, result["replicas"]
    assert any(r["ended"] == "scaled down" for r in result["replicas"])
    # GPU-seconds count only while a replica held its claim (one GPU each), which starts
    # after the replica does: never more than the replicas' lives (each rounded to 0.01 s;
    # both from the service's own records on one monotonic clock)
    lives = sum(r["served_s"] for r in result["replicas"])
    assert 0 < result["gpu_seconds"] <= lives + 0.01 * len(result["replicas"])
    # the run's own report (metrics.json, the summary, the pushes) counts the same claims,
    # read by the same process at the same `now` (tasks/service/report.py): no two clocks
    # are compared here, the bound is the rounding of each figure (0.01 s, 1e-6 h)
    [counted] = (gpuflow_home / "runs").glob("*/metrics.json")
    run_hours = json.loads(counted.read_text())["gpu_hours"]
    assert abs(run_hours * 3600 - result["gpu_seconds"]) < 0.1, (run_hours, result)
    placed = events_until(
        "gpuflow.service.ready", run_id, lambda found: len(found) >= 3, seconds=60
    )
    assert all(p["cold_start_s"] > 0 for p in placed)


@pytest.mark.timeout(300)
def test_a_cancel_ends_a_replica_that_waits_for_a_claim(bed, prefect_api, gpuflow_home):
    """Three replicas of two GPUs each on a fleet of two 2-GPU hosts: the third waits for
    a host with room (start_timeout_s: 10 min). Cancelling the run ends that wait at once,
    not after it; nothing is claimed, recorded or running after."""
    port = free_port()
    raw = fleet_service(port, replicas={"min": 3, "max": 3}, start_timeout_s="10m")
    raw["resources"] = {"gpus": 2}
    served = Served(raw, gpuflow_home)
    served.thread.start()
    try:
        wait_for(lambda: held(bed) == {"s1": 2, "s2": 2}, 120, "two replicas' claims")
        wait_for(lambda: len(replicas_on_hosts(bed)) == 2, 120, "two replicas running")
        assert ask(port)[0] == 200
        served.cancel()  # within its 120 s: the third replica's wait read the cancel
    finally:
        if served.thread.is_alive():
            served.cancel()
    cancelled_and_gone(served, bed, gpuflow_home)


@pytest.mark.timeout(300)
def test_max_cost_counts_every_replicas_claim(bed, prefect_api, gpuflow_home):
    """Two replicas, each a one-GPU claim at $36 a GPU-hour (1 cent a second), and
    max_cost_usd 0.60: together they spend it in about 30 s, half the time one claim
    alone would. The service ends by that limit having spent its budget, not the twice
    as much a deadline priced on one claim would let two claims spend."""
    hosts = [host_entry(bed, n) for n in ("s1", "s2")]
    save_fleet(bed, "serving-priced", hosts, lease_s=10, gpu_hourly_usd=36.0)
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "GPUFLOW_HOME": str(gpuflow_home)}
    done = subprocess.run(
        [*GPUFLOW, "fleet", "apply", "serving-priced"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    port = free_port()
    raw = fleet_service(port, replicas={"min": 2, "max": 2}, name="priced")
    raw["placement"]["fleet"] = "serving-priced"
    raw["limits"]["max_cost_usd"] = 0.6
    served = Served(raw, gpuflow_home)
    served.thread.start()
    served.thread.join(timeout=240)
    assert not served.thread.is_alive(), "the service did not end by its budget"
    assert served.state is not None and served.state.is_completed(), served.state
    result = served.result()
    # the claims' cost at the stop is the budget; their stop adds a few seconds of two
    # claims, far from the 1.20 of two claims for the 60 s one claim's budget lasts
    assert 0.6 <= result["cost_usd"] < 0.9, result
    assert len(result["replicas"]) == 2 and all(r["host"] for r in result["replicas"])
    wait_for(lambda: not replicas_on_hosts(bed) and not endpoint_pids(port), 60, "all stopped")
    assert held(bed) == {"s1": 0, "s2": 0}


@pytest.mark.timeout(300)
def test_a_killed_gpuflow_leaves_no_endpoint_and_its_hosts_free_the_replicas(
    bed, prefect_api, gpuflow_home, tmp_path
):
    """`gpuflow run` SIGKILLed while a fleet service serves: the endpoint here ends with
    it at once; the hosts stop the replicas and free their GPUs once the lease lapses."""
    port = free_port()
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(fleet_service(port, replicas={"min": 2, "max": 2})))
    orchestrator = subprocess.Popen(
        [*GPUFLOW, "run", str(path)],
        env={**os.environ, "PREFECT_API_URL": prefect_api, "GPUFLOW_HOME": str(gpuflow_home)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: len(replicas_on_hosts(bed)) == 2, 120, "two replicas")
        wait_for(lambda: endpoint_pids(port), 60, "the endpoint listening")
        endpoint = endpoint_pids(port)
        replicas = [p.pid for p in replicas_on_hosts(bed)]
        orchestrator.send_signal(signal.SIGKILL)
        orchestrator.wait()
        wait_for(lambda: all(process_gone(pid) for pid in endpoint), 10, "the endpoint's end")
        wait_for(lambda: all(process_gone(pid) for pid in replicas), 90, "the replicas' stop")
        wait_for(lambda: held(bed) == {"s1": 0, "s2": 0}, 30, "the GPUs' release")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(orchestrator.pid, signal.SIGKILL)
    reaped = subprocess.run(
        [*GPUFLOW, "reap", "--backend", "fleet", "--block", "serving"],
        env={**os.environ, "PREFECT_API_URL": prefect_api, "GPUFLOW_HOME": str(gpuflow_home)},
        capture_output=True,
        text=True,
    )
    assert reaped.returncode == 0, reaped.stdout + reaped.stderr
    assert not list((gpuflow_home / "fleet" / "clusters").glob("*.json")), reaped.stdout


def test_a_fleet_service_is_sized_one_replica_per_claim(bed, prefect_api):
    """Checked before anything is claimed: each replica a node of its own (resources.gpus
    each), the endpoint here; nodes given is refused in one sentence."""
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.pipeline.checks import check_pool

    raw = fleet_service(free_port(), replicas={"min": 0, "max": 4})
    [(placed, _)] = check_pool(load_spec(raw))
    assert placed.job.replica_claims and placed.job.replica_gpus == 1
    assert placed.resources.gpus == 1 and placed.resources.nodes == 1
    raw["resources"] = {"gpus": 1, "nodes": 2}
    with pytest.raises(InvalidSpec) as caught:
        check_pool(load_spec(raw))
    assert str(caught.value).startswith("resources.nodes: a service's replicas are counted")
