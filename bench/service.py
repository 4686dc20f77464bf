"""What a service costs and how fast it reacts, on this machine (fake NVML, 4 GPUs; the
replica is tests/fixtures/service/serve.py, a small threaded HTTP server):

1. Cold start: a request to a service scaled to zero, until its answer (the replica
   starting, passing its readiness check, HAProxy sending the held request to it);
   --rounds times, the service going back to zero in between.
2. The endpoint's cost: wrk at the same load (-c4, 10 s) straight to the replica and
   through the endpoint, alternating, --rounds each; p50 and p95 latency side by side.
3. Reaction to a load step: wrk -c8 starts; seconds until 4 replicas are ready (target
   15 requests/s per replica, window 2 s); it stops: seconds until 1 again
   (down_after_s 2).
4. With --fleet (root: two fleet hosts as network namespaces, scripts/fleet-testbed.sh,
   2 fake GPUs each): the cold start there (a claim on a host, the replica's start, its
   answer through the endpoint here), and the reaction to the same load step, 1 -> 3
   replicas, each a claim of its own on a host.

    python bench/service.py [--rounds 3] [--fleet]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from uuid import UUID

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "fakes"))  # fake NVML: 4 GPUs

from waiting import free_port, listening, until  # noqa: E402

SERVE = str(ROOT / "tests" / "fixtures" / "service" / "serve.py")
PERCENTILES = """
done = function(summary, latency, requests)
  io.write(string.format("p50=%d p95=%d requests=%d errors=%d\\n", latency:percentile(50),
    latency:percentile(95), summary.requests, summary.errors.status + summary.errors.connect
    + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fleet", action="store_true", help="also on a fleet (root)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-service-"))
    os.environ.update(
        GPUFLOW_HOME=str(scratch / "home"),
        FAKE_NVML_GPUS="4",
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    (scratch / "percentiles.lua").write_text(PERCENTILES)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        cold = cold_starts(args.rounds)
        direct, through = endpoint_cost(args.rounds, scratch / "percentiles.lua")
        up, down = load_step()
        fleet = on_fleet(args.rounds, scratch) if args.fleet else None
    print("\ncold start, zero to the first answer (s):", _spread(cold))
    print("latency at the same load (wrk -c4, 10 s), median of rounds:")
    print(f"  {'':<18} {'p50 ms':>8} {'p95 ms':>8} {'requests/s':>11}")
    for name, rows in (("straight to it", direct), ("through endpoint", through)):
        p50 = statistics.median(r[0] for r in rows) / 1000
        p95 = statistics.median(r[1] for r in rows) / 1000
        rate = statistics.median(r[2] for r in rows)
        print(f"  {name:<18} {p50:>8.2f} {p95:>8.2f} {rate:>11.0f}")
    ratio = statistics.median(r[0] for r in through) / statistics.median(r[0] for r in direct)
    print(f"  p50 through the endpoint / straight: {ratio:.2f}x")
    print(
        f"reaction to a load step (own scaler): 1 -> 4 replicas in {up:.1f} s,"
        f" back to 1 in {down:.1f} s after the load stopped"
    )
    if fleet is not None:
        cold_fleet, up_fleet, down_fleet = fleet
        print("on a fleet (two hosts, a claim per replica):")
        print("  cold start, zero to the first answer (s):", _spread(cold_fleet))
        print(
            f"  reaction to a load step: 1 -> 3 replicas in {up_fleet:.1f} s,"
            f" back to 1 in {down_fleet:.1f} s after the load stopped"
        )


class Service:
    """A service run in a thread of this process."""

    def __init__(self, port: int, placement: dict | None = None, **job: object) -> None:
        from gpuflow.flows.pipeline import gpu_pipeline
        from gpuflow.tasks.spec import load_spec

        scaling = job.pop("scaling", {})
        self.port = port
        where = {"placement": placement} if placement else {}
        self.spec = load_spec(
            {
                "name": "bench",
                "job": {
                    "kind": "service",
                    "command": [sys.executable, SERVE],
                    "port": port,
                    "ready": {"path": "/health", "period_s": 0.1},
                    "scaling": {"window_s": 2, "down_after_s": 2, **scaling},
                    **job,
                },
                # a fleet host's replica listens where the endpoint here reaches it
                "env": {"SERVE_DELAY_MS": "5", **({"SERVE_HOST": "0.0.0.0"} if placement else {})},
                "resources": {"gpus": 1},
                "limits": {"max_duration": "30m"},
                **where,
            }
        )
        self.thread = threading.Thread(
            target=lambda: gpu_pipeline(self.spec, return_state=True), daemon=True
        )

    def __enter__(self) -> Service:
        self.thread.start()
        until(lambda: _answers(f"http://127.0.0.1:{self.port}/health", 0.2) or self._started())
        return self

    def _started(self) -> bool:
        return bool(_records())

    def __exit__(self, *exc: object) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        [record] = _records()
        with get_client(sync_client=True) as client:
            run_id = UUID(record.stem.removeprefix("gpuflow-"))
            client.set_flow_run_state(run_id, Cancelling(), force=True)
        self.thread.join()


def _records() -> list[Path]:
    home = Path(os.environ["GPUFLOW_HOME"])
    return [
        *(home / "local" / "clusters").glob("*.json"),
        *(home / "fleet" / "clusters").glob("*.json"),
    ]


def on_fleet(rounds: int, scratch: Path) -> tuple[list[float], float, float]:
    """Cold starts and a load step on a fleet of two hosts (2 GPUs each)."""
    from gpuflow.commands.fleet import _apply
    from tests.e2e.fleet_bed import fleet_bed, host_entry, save_fleet

    with fleet_bed(scratch / "bed", ["b1:2", "b2:2"]) as bed:
        save_fleet(bed, "bench", [host_entry(bed, n) for n in ("b1", "b2")], lease_s=10)
        assert _apply("bench", True) == 0
        placement = {"backend": "fleet", "fleet": "bench"}
        cold = cold_starts(rounds, placement)
        up, down = load_step(placement, 3)
    return cold, up, down


def cold_starts(rounds: int, placement: dict | None = None) -> list[float]:
    port = free_port()
    times = []
    with Service(port, placement, replicas={"min": 0, "max": 1}, scaling={"to_zero_after_s": 1}):
        until(lambda: listening(port))
        for _ in range(rounds):
            until(lambda: not _replicas())
            began = time.monotonic()
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60).read()
            times.append(time.monotonic() - began)
    return times


def endpoint_cost(rounds: int, script: Path) -> tuple[list[tuple], list[tuple]]:
    port = free_port()
    direct, through = [], []
    with Service(port, replicas={"min": 1, "max": 1}):
        until(lambda: _answers(f"http://127.0.0.1:{port}/", 1.0))
        replica_port = _replica_port()
        for _ in range(rounds):
            direct.append(_wrk(replica_port, script))
            through.append(_wrk(port, script))
    return direct, through


def load_step(placement: dict | None = None, most: int = 4) -> tuple[float, float]:
    port = free_port()
    with Service(port, placement, replicas={"min": 1, "max": most}, scaling={"rps": 15}):
        until(lambda: len(_replicas()) == 1 and _answers(f"http://127.0.0.1:{port}/", 1.0))
        began = time.monotonic()
        load = subprocess.Popen(
            ["wrk", "-t2", "-c8", "-d120s", f"http://127.0.0.1:{port}/"], stdout=subprocess.DEVNULL
        )
        until(lambda: _ready_replicas() == most)
        up = time.monotonic() - began
        load.terminate()
        load.wait()
        stopped = time.monotonic()
        until(lambda: len(_replicas()) == 1)
        return up, time.monotonic() - stopped


def _wrk(port: int, script: Path) -> tuple[int, int, float]:
    out = subprocess.run(
        ["wrk", "-t1", "-c4", "-d10s", "-s", str(script), f"http://127.0.0.1:{port}/"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    fields = dict(word.split("=") for word in out.strip().splitlines()[-1].split())
    assert fields["errors"] == "0", out
    return int(fields["p50"]), int(fields["p95"]), int(fields["requests"]) / 10


def _replicas() -> list:
    import psutil

    return [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if SERVE in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def _replica_port() -> int:
    [proc] = _replicas()
    return next(c.laddr.port for c in proc.net_connections("tcp") if c.status == "LISTEN")


def _ready_replicas() -> int:
    count = 0
    for proc in _replicas():
        try:
            port = next(c.laddr.port for c in proc.net_connections("tcp") if c.status == "LISTEN")
        except StopIteration:
            continue
        count += _answers(f"http://127.0.0.1:{port}/health", 0.5)
    return count + _ready_on_fleet()


def _ready_on_fleet() -> int:
    """Return the replicas a fleet service's endpoint sends requests to (their hosts'
    namespaces hide their sockets from here): HAProxy's servers that are UP."""
    from gpuflow.tasks.service import proxy

    count = 0
    for folder in (Path(os.environ["GPUFLOW_HOME"]) / "fleet" / "runs").glob("*/endpoint"):
        runtime = proxy.Runtime(folder)
        try:
            count += sum(
                row.get("status") in ("UP", "no check") for row in runtime.stats().values()
            )
        except proxy.ProxyError:
            pass
        finally:
            runtime.close()
    return count


def _answers(url: str, timeout: float) -> bool:
    try:
        urllib.request.urlopen(url, timeout=timeout).read()
        return True
    except OSError:
        return False


def _spread(values: list[float]) -> str:
    return (
        f"min {min(values):.2f}, median {statistics.median(values):.2f},"
        f" max {max(values):.2f} ({len(values)} rounds)"
    )


if __name__ == "__main__":
    main()
