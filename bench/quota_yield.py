"""From a quota owner's submission to its job's start, when a borrower must yield first.

A platform on 4 fake GPUs (`platform up`), teams vision and nlp with 2 GPUs each. Idle: nlp
submits a 2-GPU run to a platform where nothing runs. Yield: vision runs 2 GPUs of its own
and borrows nlp's 2, then nlp submits: the borrower is asked to yield, its job saves on
SIGTERM and exits 75, its GPUs are released, the parked nlp run is scheduled again by the
admitter and the worker starts it. Prints each round and the medians side by side; the
difference is what giving the GPUs back costs (the borrower's grace is what its job takes
to save: here at once).

    python bench/quota_yield.py [--rounds 2]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from waiting import free_port  # noqa: E402

STEPS = """\
import pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1]); folder.mkdir(parents=True, exist_ok=True)
(folder / "started").write_text(str(time.time()))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
while not (folder / "done").exists():
    time.sleep(0.05)
"""


class Bed:
    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env |= {"GPUFLOW_HOME": str(root / "home"), "PREFECT_HOME": str(root / "prefect")}
        self.env |= {"FAKE_NVML_GPUS": "4", "PYTHONPATH": str(ROOT / "tests" / "fakes")}
        self.env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self.tokens: dict[str, str] = {}
        self.retries = 0

    def gpuflow(self, *argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gpuflow", *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return done.stdout

    def submit(self, who: str, folder: Path) -> float:
        token = base64.b64encode(self.tokens[who].encode()).decode()
        headers = {"Authorization": f"Basic {token}"}
        with httpx.Client(base_url=self.api, headers=headers, timeout=30) as api:
            deployment = api.get("/deployments/name/gpu-pipeline/command-local").json()
            spec = {"name": folder.name, "resources": {"gpus": 2}}
            spec["job"] = {"kind": "command", "command": ["python3", "-c", STEPS, str(folder)]}
            started = time.time()
            for _ in range(20):  # as Prefect's own client does: SQLite's 503s retried
                made = api.post(
                    f"/deployments/{deployment['id']}/create_flow_run",
                    json={"parameters": {"spec": spec}},
                )
                if made.status_code != 503:
                    break
                self.retries += 1
                time.sleep(0.5)
            assert made.status_code == 201, made.text
            return started


def until_started(folder: Path, since: float) -> float:
    deadline = time.monotonic() + 300
    while not (folder / "started").exists():
        assert time.monotonic() < deadline, f"{folder.name} never started"
        time.sleep(0.05)
    return float((folder / "started").read_text()) - since


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"idle platform": [], "a borrower yields first": []}
    with tempfile.TemporaryDirectory() as tmp:
        bed = Bed(Path(tmp))
        bed.gpuflow("platform", "up", "--port", str(bed.port))
        try:
            for name, team in (("ana", "vision"), ("bo", "nlp")):
                out = bed.gpuflow(
                    "platform", "user", "add", name, "--role", "admin", "--team", team
                )
                bed.tokens[name] = out.strip()
                bed.gpuflow("platform", "quota", "set", team, "--gpus", "2")
            for round_ in range(args.rounds):
                work = Path(tmp) / f"round{round_}"
                idle = work / "idle"
                rows["idle platform"].append(until_started(idle, bed.submit("bo", idle)))
                (idle / "done").write_text("")
                own, lent, theirs = work / "own", work / "lent", work / "theirs"
                until_started(own, bed.submit("ana", own))
                until_started(lent, bed.submit("ana", lent))
                rows["a borrower yields first"].append(
                    until_started(theirs, bed.submit("bo", theirs))
                )
                for folder in (own, lent, theirs):
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / "done").write_text("")
                time.sleep(5)  # the runs end and give their GPUs back
                print(
                    f"round {round_ + 1}: idle {rows['idle platform'][-1]:.2f} s, with a"
                    f" yield {rows['a borrower yields first'][-1]:.2f} s",
                    flush=True,
                )
        finally:
            log = (Path(tmp) / "home" / "platform" / "server.log").read_text(errors="replace")
            print(
                f"submissions retried after a 503: {bed.retries}; 'locked' in the server's log: {log.count('locked')}"
            )
            bed.gpuflow("platform", "down")
    idle, yielded = (statistics.median(v) for v in rows.values())
    print(f"{'submission to the job start':<34} {'median':>8}")
    print(f"{'idle platform':<34} {idle:>6.2f} s")
    print(
        f"{'a borrower yields first':<34} {yielded:>6.2f} s  (+{yielded - idle:.2f} s, {yielded / idle:.2f}x)"
    )


if __name__ == "__main__":
    main()
