"""The platform's front (tasks/platform/access.py): what it adds to each API request.

Starts the platform's server program twice on loopback, without a user book (Prefect's own
auth check only, as before) and with one (the front: who sends it, the route's role, the
owner of what it changes, the audit event), and times the same requests on each: a search
(POST /flow_runs/filter) with the platform's string and with a member's token, and a change
(a member's PATCH of its own run's tags: an ownership lookup and an audit event). Prints
p50 and p99 per request side by side, with the difference and the ratio.

    python bench/platform_auth.py [--requests 400]
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gpuflow.tasks.host import stop_group
from gpuflow.tasks.platform.users import UserBook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from waiting import free_port


def start(root: Path, users: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "gpuflow.tasks.platform.server", "--port", str(port)]
    argv += ["--auth-file", str(root / "auth")]
    argv += ["--users", str(root / "users.json")] if users else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root / f"prefect-{users}"), PREFECT_SERVER_ANALYTICS_ENABLED="0")
    server = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(api + "/ready", timeout=2).status_code == 200:
                return server, api
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("the server did not start")
        time.sleep(0.2)


def basic(auth: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}


def timings(client: httpx.Client, count: int, request: dict) -> list[float]:
    spent = []
    for _ in range(count):
        started = time.perf_counter()
        answer = client.request(**request)
        spent.append(time.perf_counter() - started)
        assert answer.status_code < 300, answer.text
    return spent


def measure(api: str, owner: str, member: str | None, count: int) -> dict[str, list[float]]:
    with httpx.Client(timeout=30) as client:
        flow = client.post(api + "/flows/", json={"name": "b"}, headers=basic(owner)).json()
        maker = basic(member or owner)
        run = client.post(api + "/flow_runs/", json={"flow_id": flow["id"]}, headers=maker).json()
        search = {"method": "POST", "url": api + "/flow_runs/filter", "json": {"limit": 5}}
        change = {
            "method": "PATCH",
            "url": f"{api}/flow_runs/{run['id']}",
            "json": {"tags": ["bench"]},
            "headers": maker,
        }
        timings(client, 20, dict(search, headers=basic(owner)))  # warm
        return {
            "search, platform's string": timings(client, count, dict(search, headers=basic(owner))),
            "search, a member's token": timings(client, count, dict(search, headers=maker)),
            "change of its own run": timings(client, count, change),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        owner = "gpuflow:" + base64.urlsafe_b64encode(os.urandom(24)).decode()
        (root / "auth").write_text(owner + "\n")
        (root / "auth").chmod(0o600)
        member = UserBook(root / "users.json").add("mia", "member")
        results = {}
        for users in (False, True):
            server, api = start(root, users)
            try:
                results[users] = measure(api, owner, member if users else None, args.requests)
            finally:
                stop_group(server.pid, None, grace_s=10)
    print(f"{'request':<28} {'':>4} {'Prefect only':>13} {'with the front':>15} {'diff':>8} ratio")
    for name in results[True]:
        for label, pick in (("p50", 0.5), ("p99", 0.99)):
            before, after = (
                statistics.quantiles(results[u][name], n=100)[int(pick * 100) - 1] * 1000
                for u in (False, True)
            )
            print(
                f"{name:<28} {label:>4} {before:>10.2f} ms {after:>12.2f} ms"
                f" {after - before:>+6.2f} ms {after / before:.2f}"
            )


if __name__ == "__main__":
    main()
