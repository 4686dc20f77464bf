"""What gpuflow reads on an EC2 instance, against AWS's own instance metadata mock
(amazon-ec2-metadata-mock, built by scripts/imds-mock.sh, IMDSv2 only, on 127.0.0.1,
stopped by PID): the instance's identity, a spot interruption notice and a rebalance
recommendation seen within one poll, and a notice stopping a running job so that it saves
its state and exits 75 (a preemption)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuflow.tasks.backends.ec2.imds import Imds, ImdsUnavailable, Notice, NoticeWatcher
from tests.conftest import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def metadata_mock(mock_binary, tmp_path) -> Iterator:
    """Start the mock with the given arguments (IMDSv2 only, loopback); yield its URL."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [mock_binary, *args, "-I", "-n", "127.0.0.1", "-p", str(port)],
            cwd=tmp_path,
            env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
            stdout=(tmp_path / f"aemm-{port}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        until = time.monotonic() + 30
        while True:  # up once it hands out IMDSv2 tokens
            with contextlib.suppress(httpx.HTTPError):
                ask = {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
                if httpx.put(f"{url}/latest/api/token", headers=ask).status_code == 200:
                    return url
            assert time.monotonic() < until, f"the metadata mock did not start: see {tmp_path}"
            time.sleep(0.05)

    yield start
    for proc in started:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def test_the_instance_is_read_with_imdsv2_tokens_only(metadata_mock):
    url = metadata_mock("spot", "-d", "600", "--rebalance-delay-sec", "600")  # not yet
    assert httpx.get(f"{url}/latest/meta-data/instance-id").status_code == 401  # v1 refused
    imds = Imds(url)
    assert imds.instance_id().startswith("i-")
    identity = imds.identity()
    assert identity["region"] == "us-east-1" and str(identity["availabilityZone"]).startswith(
        "us-east-1"
    )
    assert imds.notices() == []  # no notice yet: nothing to do


def test_a_spot_notice_and_a_rebalance_recommendation_are_each_seen_once(metadata_mock):
    url = metadata_mock("spot", "-a", "terminate", "-d", "2", "--rebalance-delay-sec", "1")
    seen: list[Notice] = []
    both = threading.Event()

    def on_notice(notice: Notice) -> None:
        seen.append(notice)
        if {n.kind for n in seen} == {"spot-terminate", "rebalance"}:
            both.set()

    with NoticeWatcher(Imds(url), on_notice, every_s=0.2):
        assert both.wait(30), f"saw only {seen}"
        count = len(seen)
        threading.Event().wait(1.0)  # more polls: the same notices are not told again
    assert len(seen) == count == 2
    spot = next(n for n in seen if n.kind == "spot-terminate")
    warning = (spot.at - spot.seen_at).total_seconds()
    assert 60 < warning <= 125  # the two minutes' warning, as the notice says it


def test_a_spot_notice_stops_the_job_which_saves_its_state_and_exits_75(
    metadata_mock, gpuflow_home, tmp_path
):
    """The notice reaches a running job as SIGTERM at once (the local backend's stop): the
    job writes its checkpoint and exits 75, which the run stage takes as a preemption."""
    from gpuflow.tasks.backends.local.backend import LocalBackend
    from gpuflow.tasks.contract import WorkUnit, owner_labels
    from gpuflow.tasks.spec import load_spec

    url = metadata_mock("spot", "-a", "terminate", "-d", "4")
    checkpoint = tmp_path / "checkpoint.txt"
    program = (
        "import signal, sys, time\n"
        "def save(*_):\n"
        f"    open({str(checkpoint)!r}, 'w').write('step 42')\n"
        "    sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, save)\n"
        "print('training', flush=True)\n"
        "while True: time.sleep(0.1)\n"
    )
    backend = LocalBackend()
    spec = load_spec({"job": {"kind": "command", "command": ["true"]}})
    cluster = backend.provision(spec, owner_labels("run-spot", "spot"))
    notice = threading.Event()
    lines: list[str] = []
    try:
        with NoticeWatcher(Imds(url), lambda n: notice.set(), every_s=0.5):
            result = backend.run(
                cluster,
                WorkUnit(name="main", command=[sys.executable, "-c", program]),
                {},
                300,
                lambda stream, line: lines.append(line),
                # once its handler is in place (it says so), as a training's is early on
                should_stop=lambda: notice.is_set() and bool(lines),
                grace_s=30,
            )
    finally:
        backend.teardown(cluster)
    assert notice.is_set()
    assert result.exit_code == 75
    assert checkpoint.read_text() == "step 42"
    assert lines[0] == "training"


def test_no_metadata_service_is_one_sentence_and_the_watch_says_so_once(tmp_path):
    port = free_port()  # nothing listens there
    imds = Imds(f"http://127.0.0.1:{port}", timeout_s=0.5)
    with pytest.raises(ImdsUnavailable) as refused:
        imds.instance_id()
    assert str(refused.value).startswith(
        f"the instance metadata service at http://127.0.0.1:{port} did not answer (ConnectError"
    )
    told: list[str] = []
    with NoticeWatcher(imds, lambda n: None, every_s=0.1, on_trouble=told.append):
        threading.Event().wait(1.0)
    assert len(told) == 1 and "did not answer" in told[0]
