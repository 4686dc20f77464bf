"""A unit's log read from an API server on loopback that behaves like a kubelet: one that
keeps a follow stream open after its container ended (as KWOK does), one that drops the
stream mid-way. No line is lost or taken twice, and the outputs at the log's end arrive."""

from __future__ import annotations

import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi, load_config
from gpuflow.tasks.backends.kubernetes.logs import LogFollower

LOG_PATH = "/api/v1/namespaces/ns/pods/unit-0/log"


class Kubelet:
    """Serves LOG_PATH: a follow stream sends the lines present, then each line added, and
    stays open until the server stops (`hold`) or ends after `drop_after` lines; a read that
    does not follow sends the lines present and ends."""

    def __init__(self, hold: bool = True, drop_after: int | None = None) -> None:
        self.lines: list[str] = []
        self.present = True  # False: no log yet (the container is starting)
        self.hold, self.drop_after = hold, drop_after
        self.reads: list[bool] = []  # follow or not, one per request
        self.closing = threading.Event()
        kubelet = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                follow = parse_qs(url.query).get("follow") == ["true"]
                kubelet.reads.append(follow)
                if url.path != LOG_PATH or not kubelet.present:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                sent = 0
                while True:
                    while sent < len(kubelet.lines):
                        self.wfile.write(kubelet.lines[sent].encode() + b"\n")
                        self.wfile.flush()
                        sent += 1
                        if follow and kubelet.drop_after and sent == kubelet.drop_after:
                            kubelet.drop_after = None  # drops once
                            return
                    if not follow or not kubelet.hold or kubelet.closing.wait(0.05):
                        return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def api(self) -> KubeApi:
        host, port = self.server.server_address[:2]
        doc = {
            "current-context": "c",
            "contexts": [
                {"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "ns"}}
            ],
            "clusters": [{"name": "k", "cluster": {"server": f"http://{host}:{port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
        }
        return KubeApi(load_config(doc))

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kubelet():
    made: list[Kubelet] = []

    def make(**kwargs) -> Kubelet:
        made.append(Kubelet(**kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the follower did not take the lines in time"
        time.sleep(0.02)


def test_the_last_lines_and_outputs_arrive_when_the_follow_stream_outlives_its_pod(
    kubelet, tmp_path
):
    """The pod prints its last lines (and its outputs) just as it ends, and the follow
    stream never ends nor sends them in time: the read at the end takes them, once each."""
    server = kubelet()
    server.lines = ["step 1", "step 2"]
    said: list[tuple[str, str]] = []
    follower = LogFollower(
        server.api(), lambda s, line: said.append((s, line)), tmp_path, nonce="n0nce"
    )
    follower.start(LOG_PATH)
    _wait_for(lambda: len(said) == 2)
    server.hold = False  # the open stream sends nothing more
    server.closing.set()
    server.closing = threading.Event()
    encoded = base64.b64encode(b'{"loss": 0.1}').decode()
    server.lines += ["step 3", "done", f"@@gpuflow-output-n0nce result.json {encoded}"]
    follower.stop(drain_s=0.5)
    assert said == [("stdout", f"step {i}") for i in (1, 2, 3)] + [("stdout", "done")]
    assert (tmp_path / "result.json").read_text() == '{"loss": 0.1}'
    assert server.reads[-1] is False  # the log was read to its end without following


def test_a_dropped_stream_is_read_again_and_skips_the_lines_seen(kubelet, tmp_path):
    """The stream ends after two lines while the pod runs: the next read starts at the
    log's first line again; the lines already given are not given twice."""
    server = kubelet(drop_after=2)
    server.lines = ["a", "b", "c"]
    said: list[str] = []
    follower = LogFollower(server.api(), lambda s, line: said.append(line), tmp_path)
    follower.start(LOG_PATH)
    _wait_for(lambda: len(said) == 3)
    server.lines.append("d")
    _wait_for(lambda: len(said) == 4)
    follower.stop(drain_s=1)
    assert said == ["a", "b", "c", "d"]
    assert server.reads[:2] == [True, True]


def test_a_log_not_there_yet_is_asked_for_again_and_read_out_when_the_pod_ends(kubelet, tmp_path):
    """No log yet (the container is starting): the follower asks again, backing off. The
    pod prints and ends between two asks: its ending wakes the follower for one read to the
    log's end, and every line arrives."""
    server = kubelet()
    server.present = False
    said: list[str] = []
    follower = LogFollower(server.api(), lambda s, line: said.append(line), tmp_path)
    follower.start(LOG_PATH)
    _wait_for(lambda: len(server.reads) >= 2)  # refused twice, asked again each time
    server.lines, server.present = ["warming up", "done"], True
    follower.stop(drain_s=5)
    assert said == ["warming up", "done"]
    assert server.reads[-1] is False
