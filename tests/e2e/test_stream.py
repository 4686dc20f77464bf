"""Stream sessions end to end in headless Chromium: the page decodes the frames with
WebCodecs and draws them, its keys move the camera, every stage's milliseconds are
measured on one clock; a client that sends garbage or floods the socket is cut off while
the session and the page go on; a session with no client ends its replica after
idle_after_s; nothing is left."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_spec
from gpuflow.tasks.spec import load_spec
from tests.conftest import free_port
from tests.e2e.browser import chromium, tab
from tests.e2e.helpers import NOTHING_LEFT, leftovers
from tests.e2e.test_service import Served, endpoint_pids, wait_for

pytestmark = pytest.mark.e2e
SERVER = "gpuflow.tasks.stream.server"
SESSION_S = 30.0  # the 30 s session with the page connected


def sessions_running(home: Path) -> list:
    """Return the session servers running now under `home` (this test's GPUFLOW_HOME)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if SERVER in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            try:
                if Path(proc.cwd()).is_relative_to(home):
                    found.append(proc)
            except psutil.Error:
                continue
    return found


def stream_spec(port: int, **job) -> dict:
    return {
        "name": job.pop("name", "viewer"),
        "job": {"kind": "stream", "port": port, **job},
        "resources": {"gpus": 0},
        "limits": {"max_duration": "10m", "stop_grace_s": 5},
    }


STATE = "JSON.stringify(Object.assign({}, window.gpuflowStream, {glass: [], photon: window.gpuflowStream.photon}))"


async def a_session(url: str, endpoint: str, home: Path) -> dict:
    """Watch the stream for SESSION_S with keys pressed now and then; return what the page
    measured; meanwhile a second page gets a replica of its own, and two bad clients come
    and are cut off."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async with tab(endpoint, url) as page:
        await page.wait_until("window.gpuflowStream && window.gpuflowStream.shown > 10", 60)
        began = time.monotonic()
        await page.call("Page.bringToFront")
        await page.evaluate("document.getElementById('view').focus()")
        yaw0 = await page.evaluate("window.gpuflowStream.yaw")
        for _ in range(3):
            await page.key("ArrowRight")
            await asyncio.sleep(0.5)
        moved = await page.wait_until(
            f"window.gpuflowStream.yaw !== {yaw0} && window.gpuflowStream.photon.length >= 3"
            " && window.gpuflowStream.yaw",
            30,
        )
        async with tab(endpoint, url) as second:  # a second client: a replica of its own
            await second.wait_until("window.gpuflowStream && window.gpuflowStream.shown > 10", 60)
            replicas_for_two = len(sessions_running(home))
            listening = {
                c.laddr.ip
                for p in sessions_running(home)
                for c in p.net_connections("tcp")
                if c.status == "LISTEN"
            }
        cut: dict[str, tuple[int, str]] = {}
        ws_url = url.replace("http://", "ws://").replace("/?key=", "/stream?key=")
        for name, bad in (
            ("garbage", [b"\x00\xffnot json"]),
            ("flood", ['{"t":"ping","c":1}'] * 2000),
            ("huge-seq", ['{"t":"input","seq":' + "9" * 4000 + ',"key":"ArrowLeft"}']),
            ("nan", ['{"t":"stats","frames":[[NaN,1,1,1]],"inputs":[]}']),
            ("1e308", ['{"t":"stats","frames":[],"inputs":[1e308]}']),
        ):
            async with connect(ws_url, max_size=None) as client:
                try:
                    for message in bad:
                        await client.send(message)
                    async for _ in client:  # its frames, until it is cut off
                        pass
                except ConnectionClosed:
                    pass
                cut[name] = (client.close_code, client.close_reason)
        elsewhere = await from_another_site(endpoint, ws_url)
        shown_then = await page.evaluate("window.gpuflowStream.shown")
        await page.wait_until(f"window.gpuflowStream.shown > {shown_then + 10}", 30)
        while time.monotonic() - began < SESSION_S:
            await page.key("ArrowLeft")
            await asyncio.sleep(1.0)
        state = json.loads(await page.evaluate(STATE))
        figures = await page.evaluate("document.getElementById('figures').textContent")
        # a codec the browser cannot decode: the page says so in one sentence
        await page.evaluate(
            "configure({t: 'config', width: 640, height: 360, fps: 30, encoder: 'x',"
            " codec: 'avc9.FFFFFF'})"
        )
        said = await page.evaluate("document.getElementById('said').textContent")
    return {
        "state": state,
        "moved": moved,
        "yaw0": yaw0,
        "cut": cut,
        "said": said,
        "figures": figures,
        "replicas_for_two": replicas_for_two,
        "listening": listening,
        "elsewhere": elsewhere,
    }


async def from_another_site(endpoint: str, ws_url: str) -> list[str]:
    """Open the session's socket, key and all, from a page of another origin in the same
    browser (what any web page the user visits could do); return what that page saw."""
    import http.server

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<!doctype html><title>elsewhere</title>")

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        async with tab(endpoint, f"http://localhost:{server.server_port}/") as page:
            await page.wait_until("document.title === 'elsewhere'", 30)
            await page.evaluate(
                f"window.seen = []; const s = new WebSocket({json.dumps(ws_url)});"
                " s.onopen = () => seen.push('open'); s.onmessage = () => seen.push('message');"
                " s.onclose = (e) => seen.push('closed ' + e.code)"
            )
            return await page.wait_until(
                "window.seen.some((e) => e.startsWith('closed')) && window.seen", 30
            )
    finally:
        server.shutdown()
        server.server_close()


def page_address(served: Served) -> str:
    """Return the page's address the run printed, with the session's key."""
    from tests.e2e.helpers import logs_of

    def said() -> str | None:
        for line in logs_of(served.run_id):
            if found := re.search(r"open (http://\S+/\?key=\S+) ", line):
                return found.group(1)
        return None

    wait_for(lambda: said() is not None, 60, "the page's address in the run's log")
    return said()


def who_gets_in(port: int, key: str) -> dict[str, int]:
    """Return the HTTP status of each kind of visitor, through the endpoint."""
    import http.client

    socket = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
              "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
    here = f"127.0.0.1:{port}"
    visits = {
        "page without the key": ("/", {}),
        "page with a wrong key": ("/?key=" + "x" * len(key), {}),
        "page with the key": (f"/?key={key}", {}),
        "socket without the key": ("/stream", socket),
        "socket from another site's page": (
            f"/stream?key={key}",
            {**socket, "Origin": "http://evil.example"},
        ),
        "socket under a rebound name": (
            f"/stream?key={key}",
            {**socket, "Host": f"evil.example:{port}"},
        ),
    }
    seen = {}
    for who, (path, headers) in visits.items():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        connection.request("GET", path, headers={"Host": here, **headers})
        seen[who] = connection.getresponse().status
        connection.close()
    return seen


@pytest.mark.timeout(300)
def test_a_session_streams_to_a_browser_page_and_measures_each_stage(
    prefect_api, gpuflow_home, fake_nvml, pushgateway
):
    port = free_port()
    # 1080p: x264 keeps up with it on 2 cores (bench/stream.py: 15 ms a frame)
    raw = stream_spec(port, width=1920, height=1080, fps=30, idle_after_s=3)
    raw["metrics"] = {"pushgateway": pushgateway, "push_interval_s": 1}
    served = Served(raw, gpuflow_home)
    served.thread.start()
    try:
        wait_for(lambda: endpoint_pids(port), 120, "the endpoint listening")
        url = page_address(served)
        refused = who_gets_in(port, url.split("?key=")[1])
        with chromium() as endpoint:
            seen = asyncio.run(a_session(url, endpoint, gpuflow_home))
        # the page went away: after idle_after_s the replica ends, the endpoint stays
        wait_for(lambda: not sessions_running(gpuflow_home), 60, "the replica's end")
        assert endpoint_pids(port)
        served.cancel()
    finally:
        if served.thread.is_alive():
            served.cancel()
    assert served.state is not None and served.state.is_cancelled(), served.state
    wait_for(lambda: not endpoint_pids(port), 30, "the endpoint's end")
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    state = seen["state"]
    assert state["state"] == "streaming" and state["error"] is None, state
    assert state["config"]["codec"].startswith("avc1.42E0") and state["config"]["encoder"] == "x264"
    assert state["shown"] >= 100, state  # 30 s of frames, decoded and drawn
    assert seen["moved"] != seen["yaw0"]  # the keys turned the camera, the frames show it
    assert seen["replicas_for_two"] == 2  # a replica per client
    assert seen["listening"] == {"127.0.0.1"}  # behind the endpoint only, not on the network
    assert len(state["photon"]) >= 3 and all(ms > 0 for ms in state["photon"])
    assert seen["cut"]["garbage"][0] == 1008 and "binary" in seen["cut"]["garbage"][1]
    assert seen["cut"]["flood"][0] == 1008 and "messages a second" in seen["cut"]["flood"][1]
    assert seen["cut"]["huge-seq"] == (
        1008,
        "an input without a rising sequence number up to 4294967295",
    )
    for bad in ("nan", "1e308"):  # never a figure: "p50 nan ms"
        assert seen["cut"][bad] == (1008, "a figure that is not a finite time within 3.6e+06 ms")
    # only who holds the session's key, from its own address and page, gets in
    assert refused == {
        "page without the key": 403,
        "page with a wrong key": 403,
        "page with the key": 200,
        "socket without the key": 403,
        "socket from another site's page": 403,
        "socket under a rebound name": 421,
    }, refused
    # a page of another site, in the user's own browser, with the key: refused at the
    # handshake (no frame, no input), the page sees only the failure
    assert seen["elsewhere"] == ["closed 1006"], seen["elsewhere"]
    assert seen["said"].startswith("This browser cannot decode the stream (avc9.FFFFFF")
    # the page shows its own figures as it plays (the last 2 s), not only in the artifacts
    assert re.fullmatch(
        r"glass-to-glass p50 \d+ ms, p95 \d+ ms; input-to-photon (\d+ ms|-); \d+ fps shown,"
        r" \d+ dropped",
        seen["figures"],
    ), seen["figures"]
    # the session's figures, per client, in the run's outputs and its report
    [run] = (gpuflow_home / "runs").glob("*/outputs")
    figures = {p.name: json.loads(p.read_text()) for p in run.glob("stream-*.json")}
    page = max(figures.values(), key=lambda f: f["frames_shown"])
    assert page["width"] == 1920 and page["height"] == 1080
    watched = {
        f["client"].rpartition("-client")[0]
        for f in figures.values()
        if f["frames_sent"] and not f["ended"].startswith("cut off")
    }
    assert len(watched) == 2, figures  # the two pages, on two replicas
    assert page["capture_to_display"]["p50"] > 0 and page["input_to_photon"]["p50"] > 0
    assert page["inputs"] >= 3 and page["bitrate_kbps"] > 0
    assert set(page["stages"]) == {"render", "encode", "send", "decode", "draw"}
    assert all(page["stages"][s]["p50"] is not None for s in page["stages"])
    assert page["capture_to_display"]["p50"] <= page["capture_to_display"]["p95"]
    # and in the run's Pushgateway: each client's stages by quantile
    import urllib.request

    with urllib.request.urlopen(f"{pushgateway}/metrics", timeout=10) as answer:
        pushed = answer.read().decode()
    client = page["client"]
    assert f'gpuflow_stream_fps{{client="{client}"' in pushed, pushed[-2000:]
    for stage in ("capture_to_display", "input_to_photon", "encode", "decode", "draw"):
        assert f'client="{client}",' in pushed and f'phase="{stage}"' in pushed, stage
    ended = sorted(f["ended"] for f in figures.values())
    assert any(e.startswith("cut off: a binary message") for e in ended), ended
    assert any(e.startswith("cut off: more than") for e in ended), ended


@pytest.mark.parametrize(
    ("job", "said"),
    [
        ({"width": 1279}, "job.width: 1279 pixels: give an even number"),
        ({"height": 4098}, "job.height: 4098 pixels: give an even number"),
        ({"fps": 0}, "job.fps: 0 frames per second: give 1 to 240"),
        ({"fps": 241}, "job.fps: 241 frames per second: give 1 to 240"),
        ({"command": ["python", "x.py"]}, "job.command: a stream session runs gpuflow's"),
    ],
)
def test_bad_stream_input_is_one_sentence(job, said):
    with pytest.raises(InvalidSpec) as caught:
        load_spec(stream_spec(free_port(), **job))
    assert said in str(caught.value), str(caught.value)


def test_nvenc_without_a_gpu_and_a_renderer_not_there_are_refused(prefect_api, fake_nvml):
    spec = load_spec(stream_spec(free_port(), encoder="nvenc"))
    with pytest.raises(InvalidSpec) as caught:
        check_spec(spec)
    assert str(caught.value).startswith("job.encoder: nvenc encodes on an NVIDIA GPU")
    spec = load_spec(stream_spec(free_port(), renderer="no_such_scene:make"))
    with pytest.raises(InvalidSpec) as caught:
        check_spec(spec)
    assert str(caught.value).startswith("job.renderer: module 'no_such_scene' cannot be imported")


async def frames_of(ws_url: str, count: int, key: str | None = None) -> list:
    """Connect as a page does; return the decoded frames' mean red after pressing `key`."""
    import av
    from websockets.asyncio.client import connect

    decoder = av.CodecContext.create("h264", "r")
    reds = []
    async with connect(ws_url, max_size=None) as client:
        config = json.loads(await client.recv())
        assert config["t"] == "config"
        if key is not None:
            await client.send(json.dumps({"t": "input", "seq": 1, "key": key}))
        while len(reds) < count:
            message = await client.recv()
            if isinstance(message, str):
                continue
            applied = int.from_bytes(message[8:12], "little")
            for frame in decoder.decode(av.Packet(message[44:])):  # one access unit each
                if key is None or applied >= 1:
                    reds.append(float(frame.to_ndarray(format="rgb24")[..., 0].mean()))
    return reds


@pytest.mark.timeout(180)
def test_a_users_renderer_from_the_working_folder_draws_what_the_camera_sees(
    prefect_api, gpuflow_home, fake_nvml
):
    """renderer: scene:make from job.workdir; a client's key turns the camera, and the
    frames it gets after the input was applied show the renderer's picture of that yaw."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "stream"
    port = free_port()
    raw = stream_spec(
        port, width=128, height=72, renderer="scene:make", workdir=str(fixtures), idle_after_s=2
    )
    served = Served(raw, gpuflow_home)
    served.thread.start()
    try:
        wait_for(lambda: endpoint_pids(port), 120, "the endpoint listening")
        url = page_address(served).replace("http://", "ws://").replace("/?key=", "/stream?key=")
        before = asyncio.run(frames_of(url, 5))
        after = asyncio.run(frames_of(url, 5, key="ArrowRight"))
        served.cancel()
    finally:
        if served.thread.is_alive():
            served.cancel()
    assert all(red < 3 for red in before), before  # yaw 0: no red
    assert all(3 < red < 8 for red in after), after  # yaw 5 after the key
