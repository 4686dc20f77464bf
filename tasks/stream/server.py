"""A stream session's replica: `python -m gpuflow.tasks.stream.server` serves, on $PORT,
the page (GET /), its readiness check (GET /health) and the WebSocket (/stream). Each
client gets a renderer's frames encoded by an encoder of its own; its keys and mouse move
its camera; its page reports what it decoded and drew, and when, so each frame's stages
are measured on one clock (the page's, the server's mapped onto it by a clock sync).

Frames are binary messages: a 44-byte header (struct FRAME: kind 1, key flag, frame
number, the last input applied, capture and send times in the server's ms, render and
encode ms, the camera's yaw and pitch) then the H.264 access unit (Annex B). The client
sends JSON text only: `input` (a key, or a mouse move), `ping` (clock sync), `stats`
(what it showed); anything else, a binary message, a figure that is not a finite number
in its range, or a flood of messages cuts it off (close 1008) and the session and its
other clients go on.

Who gets in: the page and the WebSocket answer only a request that carries the session's
key (`?key=`, from $GPUFLOW_STREAM_KEY: the run prints the page's address with it), whose
Host is an IP address or localhost (a page whose name is rebound to this machine, DNS
rebinding, gets 421) and whose Origin, when it has one, is the page's own (another web
site's page gets 403). /health answers anyone: it says nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import os
import signal
import struct
import sys
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Any, TypeGuard

from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from gpuflow.tasks.stream import encode, scene
from gpuflow.tasks.stream.model import StageFigures, StreamFigures
from gpuflow.tasks.stream.page import PAGE

KEY_VARIABLE = "GPUFLOW_STREAM_KEY"  # the session's key (tasks/service/serve.py gives it)
FRAME = struct.Struct(
    "<BBHIIddffff"
)  # kind, flags, -, frame, input, capture, sent, ms, ms, yaw, pitch
MAX_MESSAGE = 64 * 1024  # a client's message: larger is cut off by the socket itself
FLOOD_PER_S = 300  # messages a second from one client: more is a flood
BEHIND = 2  # frames waiting to be sent: more and the next is not made (dropped)
KEPT = 20_000  # per client and stage: enough for its percentiles, bounded
STAGES = ("render", "encode", "send", "decode", "draw")
LONGEST_MS = 3_600_000.0  # a client's figure (ms) above this, or below 0, is not one
LAST_SEQ = 2**32 - 1  # input sequence numbers fit the frame header's field


def now_ms() -> float:
    return time.time() * 1000.0


class Settings:
    def __init__(self, args: argparse.Namespace) -> None:
        self.width, self.height, self.fps = args.width, args.height, args.fps
        self.bitrate_kbps, self.clients = args.bitrate_kbps, args.clients
        self.renderer = args.renderer
        self.pushgateway, self.run_id, self.job = args.pushgateway, args.run_id, args.job
        self.push_every_s = args.push_interval_s
        gpus = bool(os.environ.get("CUDA_VISIBLE_DEVICES", "").strip(" ,-1"))
        self.encoder, self.encoder_why = encode.choose(args.encoder, gpus)
        self.codec = encode.codec_string(self.width, self.height, self.fps)
        self.replica = os.environ.get("GPUFLOW_REPLICA", "replica")
        self.outputs = Path(os.environ.get("GPUFLOW_OUTPUT_DIR") or ".")


class Client:
    """One connected page: its camera, encoder, producer thread and figures."""

    def __init__(self, number: int, settings: Settings, ws: Any) -> None:
        self.number, self.settings, self.ws = number, settings, ws
        self.name = f"{settings.replica}-client{number}"
        self.camera = scene.Camera()
        self.input_seq = 0  # the last input applied to the camera
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.started = time.monotonic()
        self.first_sent: float | None = None
        self.sent = self.made = self.dropped_here = self.dropped_there = self.shown = 0
        self.bytes = 0
        self.inputs = 0
        self.stages: dict[str, deque[float]] = {s: deque(maxlen=KEPT) for s in STAGES}
        self.glass: deque[float] = deque(maxlen=KEPT)  # capture to display
        self.photon: deque[float] = deque(maxlen=KEPT)  # input to photon
        self.clock_error_ms: float | None = None
        self.received: deque[float] = deque()
        self.replies: list[str] = []  # answers to send the page (pongs)
        self.ended = ""
        self.renderer: Any = None
        self.encoder: encode.Encoder | None = None

    # the producer: render, encode, hand to the sender --------------------------------

    def producing(self) -> None:
        """Produce until stopped; a failure ends this client (said, its socket closed and
        its place freed), never a dead thread that keeps its place."""
        try:
            self.produce()
        except Exception as exc:
            self.ended = f"its frames could not be made: {type(exc).__name__}: {exc}"
            say(f"{self.name} cut off: {self.ended}")

            asyncio.run_coroutine_threadsafe(self.ws.close(1011, self.ended[:120]), self.loop)

    def produce(self) -> None:
        settings = self.settings
        interval = 1.0 / settings.fps
        tick = time.monotonic()
        assert self.encoder is not None
        while not self.stop.is_set():
            tick += interval
            if self.outbox.qsize() >= BEHIND:  # the client is behind: skip this frame
                self.dropped_here += 1
            else:
                with self.lock:
                    camera = scene.Camera(self.camera.yaw, self.camera.pitch)
                    applied = self.input_seq
                captured = now_ms()
                began = time.perf_counter()
                frame = self.renderer(camera, time.monotonic() - self.started)
                if hasattr(frame, "cpu"):  # a torch tensor (on the GPU): to this host
                    frame = frame.cpu().numpy()
                rendered = time.perf_counter()
                packets = self.encoder.encode(frame)
                encoded = time.perf_counter()
                render_ms, encode_ms = (rendered - began) * 1000, (encoded - rendered) * 1000
                self.stages["render"].append(render_ms)
                self.stages["encode"].append(encode_ms)
                for packet in packets:
                    header = FRAME.pack(
                        1, int(packet.key), 0, self.made, applied, captured, 0.0,
                        render_ms, encode_ms, camera.yaw, camera.pitch,
                    )  # fmt: skip
                    self.made += 1
                    self.loop.call_soon_threadsafe(self.outbox.put_nowait, header + packet.data)
            late = tick - time.monotonic()
            if late > 0:
                self.stop.wait(late)
            elif late < -interval:
                tick = time.monotonic()  # far behind: do not make up for it

    async def send_frames(self) -> None:
        while True:
            message = await self.outbox.get()
            sent = now_ms()
            message = message[:20] + struct.pack("<d", sent) + message[28:]
            await self.ws.send(message)
            if self.first_sent is None:
                self.first_sent = time.monotonic()
            self.sent += 1
            self.bytes += len(message) - FRAME.size

    # what the page says -----------------------------------------------------------------

    def flooding(self) -> bool:
        now = time.monotonic()
        self.received.append(now)
        while self.received and self.received[0] < now - 1.0:
            self.received.popleft()
        return len(self.received) > FLOOD_PER_S

    def take(self, message: Any) -> str | None:
        """Act on one message from the page; return why it is cut off, if it is."""
        if not isinstance(message, str):
            return "a binary message: a page sends JSON text only"
        if self.flooding():
            return f"more than {FLOOD_PER_S} messages a second"
        try:
            said = json.loads(message)
        except ValueError:
            return "a message that is not JSON"
        kind = said.get("t") if isinstance(said, dict) else None
        if kind == "input":
            return self._input(said)
        if kind == "ping":
            if not _finite(said.get("c"), 1e15):
                return "a ping without its time"
            self.replies.append(json.dumps({"t": "pong", "c": said["c"], "s": now_ms()}))
            return None
        if kind == "stats":
            return self._stats(said)
        if kind == "hello":
            if said.get("supported") is False:
                self.ended = f"the page cannot decode {str(said.get('codec'))[:40]}"
            return None
        return f"a message of kind {kind!r}, which a page does not send"

    def _input(self, said: dict) -> str | None:
        seq = said.get("seq")
        if not isinstance(seq, int) or not self.input_seq < seq <= LAST_SEQ:
            return f"an input without a rising sequence number up to {LAST_SEQ}"
        key, dx, dy = said.get("key"), said.get("dx"), said.get("dy")
        if isinstance(key, str) and key in scene.KEYS:
            turn = scene.KEYS[key]
        elif _finite(dx, 1e6) and _finite(dy, 1e6):
            turn = (max(-90.0, min(90.0, dx * 0.2)), max(-90.0, min(90.0, -dy * 0.2)))
        else:
            return "an input that is neither a known key nor a mouse move"
        with self.lock:
            self.camera.turn(*turn)
            self.input_seq = seq
        self.inputs += 1
        return None

    def _stats(self, said: dict) -> str | None:
        frames, inputs = said.get("frames"), said.get("inputs", [])
        if not isinstance(frames, list) or not isinstance(inputs, list) or len(frames) > 2000:
            return "stats that are not lists of figures"
        try:
            rows = [[float(v) for v in row] for row in frames]
            photon = [float(ms) for ms in inputs[:2000]]
            dropped = said.get("dropped", self.dropped_there)
            clock = said.get("clock_error_ms")
            if any(len(row) != 4 for row in rows):
                raise ValueError
        except (TypeError, ValueError):
            return "stats that are not lists of figures"
        figures = [v for row in rows for v in row] + photon
        if not all(_finite(v, LONGEST_MS) for v in figures):  # a clock's error may go below 0
            return f"a figure that is not a finite time within {LONGEST_MS:g} ms"
        if not isinstance(dropped, int) or not 0 <= dropped <= LAST_SEQ:
            return "a dropped count that is not a whole number of frames"
        if clock is not None and not _finite(clock, LONGEST_MS):
            return "a clock error that is not a finite time in ms"
        for glass, send, decode, draw in rows:
            self.glass.append(glass)
            self.stages["send"].append(send)
            self.stages["decode"].append(decode)
            self.stages["draw"].append(draw)
        self.photon.extend(photon)
        self.shown += len(rows)
        self.dropped_there = dropped
        if clock is not None:
            self.clock_error_ms = float(clock)
        return None

    def figures(self) -> StreamFigures:
        seconds = max(time.monotonic() - (self.first_sent or self.started), 1e-9)
        return StreamFigures(
            client=self.name,
            width=self.settings.width,
            height=self.settings.height,
            encoder=self.settings.encoder,
            seconds=round(seconds, 2),
            frames_sent=self.sent,
            frames_shown=self.shown,
            fps=round(self.shown / seconds, 2),
            bitrate_kbps=round(self.bytes * 8 / seconds / 1000, 1),
            dropped=self.dropped_here + self.dropped_there,
            clock_error_ms=self.clock_error_ms,
            capture_to_display=_stage(self.glass),
            input_to_photon=_stage(self.photon),
            inputs=self.inputs,
            stages={name: _stage(values) for name, values in self.stages.items()},
            ended=self.ended,
        )

    def save(self) -> None:
        path = self.settings.outputs / f"stream-{self.name}.json"
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(self.figures().model_dump_json(indent=1))
            path.with_suffix(".tmp").replace(path)


def _stage(values: deque[float]) -> StageFigures:
    if not values:
        return StageFigures()
    ordered = sorted(values)

    def at(percent: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(percent / 100 * len(ordered)))], 2)

    return StageFigures(p50=at(50), p95=at(95), p99=at(99))


class Session:
    """The replica: its clients, its socket server."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.clients: dict[int, Client] = {}
        self.gone: list[StreamFigures] = []  # clients that left: their last figures
        self.count = 0
        self._push_warned = False

    def push(self) -> None:
        """Push every client's figures to the run's Pushgateway (when it has one); a
        failure is said once, never fatal."""
        settings = self.settings
        if not settings.pushgateway:
            return
        from gpuflow.tasks.errors import TransientError
        from gpuflow.tasks.metrics.prometheus import push
        from gpuflow.tasks.stream import metrics

        clients = [*self.gone[-50:], *(c.figures() for c in list(self.clients.values()))]
        run = {"flow_run_id": settings.run_id, "job": settings.job}
        try:
            push(
                settings.pushgateway,
                metrics.exposition(clients, run),
                settings.run_id,
                settings.job,
                f"stream-{settings.replica}",
            )
        except TransientError as exc:
            if not self._push_warned:
                self._push_warned = True
                say(f"stream figures not pushed: {exc}")

    async def pushing(self) -> None:
        while True:
            await asyncio.sleep(self.settings.push_every_s)
            if self.clients:
                await asyncio.to_thread(self.push)

    async def client(self, ws: Any) -> None:
        settings = self.settings
        watching = [c for c in self.clients.values() if c.ws.state is State.OPEN]
        if len(watching) >= settings.clients:  # one that is closing has left already
            await ws.close(1013, f"this session serves {settings.clients} client(s) at once")
            return
        self.count += 1
        client = Client(self.count, settings, ws)
        self.clients[client.number] = client
        sender = None
        producer = None
        try:
            client.renderer, where = await asyncio.to_thread(
                scene.load, settings.renderer, settings.width, settings.height
            )
            client.encoder = await asyncio.to_thread(
                encode.Encoder,
                settings.encoder,
                settings.width,
                settings.height,
                settings.fps,
                settings.bitrate_kbps,
            )
            say(f"{client.name} connected: {where}, {settings.encoder_why}")
            await ws.send(
                json.dumps(
                    {
                        "t": "config",
                        "width": settings.width,
                        "height": settings.height,
                        "fps": settings.fps,
                        "codec": settings.codec,
                        "encoder": settings.encoder,
                        "client": client.name,
                    }
                )
            )
            sender = asyncio.create_task(client.send_frames())
            producer = threading.Thread(target=client.producing, name=client.name, daemon=True)
            producer.start()
            saved = time.monotonic()
            async for message in ws:
                why = client.take(message)
                if why is not None:
                    client.ended = f"cut off: {why}"
                    say(f"{client.name} cut off: {why}")
                    await ws.close(1008, why[:120])
                    break
                while client.replies:
                    await ws.send(client.replies.pop(0))
                if time.monotonic() - saved > 5.0:  # a killed replica still leaves figures
                    await asyncio.to_thread(client.save)
                    saved = time.monotonic()
        except ConnectionClosed:
            pass  # the page went away (a closed tab need not say goodbye)
        except Exception as exc:  # its encoder or renderer: this client ends, not others
            client.ended = client.ended or f"{type(exc).__name__}: {exc}"
            say(f"{client.name} failed: {client.ended}")
        finally:
            self.clients.pop(client.number, None)  # its place is free: the socket closed
            client.stop.set()
            if sender is not None:
                sender.cancel()
            if producer is not None:
                await asyncio.to_thread(producer.join, 5.0)
            if client.encoder is not None:
                client.encoder.close()
            client.ended = client.ended or "the page went away"
            client.save()
            figures = client.figures()
            say(f"{client.name} ended ({client.ended}): {summary(figures)}")
            self.gone.append(figures)
            await asyncio.to_thread(self.push)


def _finite(value: Any, most: float, least: float | None = None) -> TypeGuard[int | float]:
    """Return True for a number (not a bool) that is finite and within [least, most]
    (least defaults to -most)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    low = -most if least is None else least
    return math.isfinite(value) and low <= value <= most


def admitted(request: Any, key: str | None) -> tuple[int, str] | None:
    """Return (status, why) when a request to the page or the WebSocket is refused: a name
    other than localhost in its Host (421), another site's Origin (403), no session key
    or a wrong one (403); None when it may go on."""
    headers = request.headers
    host = headers.get("Host", "")
    try:
        name = urllib.parse.urlsplit(f"//{host}").hostname or ""
    except ValueError:
        name = ""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        if name != "localhost":
            return 421, f"this session answers its own addresses only, not {name[:60]!r}"
    origin = headers.get("Origin")
    if origin is not None and origin not in (f"http://{host}", f"https://{host}"):
        return 403, "a page of another site may not open this session"
    if key is None:
        return None
    given = urllib.parse.parse_qs(urllib.parse.urlsplit(request.path).query).get("key", [""])[0]
    if not hmac.compare_digest(given.encode(), key.encode()):
        return 403, "the session's key is missing or wrong: open the address the run printed"
    return None


def summary(figures: StreamFigures) -> str:
    glass = figures.capture_to_display
    photon = figures.input_to_photon
    parts = [f"{figures.frames_shown} frames shown, {figures.fps:g} fps"]
    if glass.p50 is not None:
        parts.append(f"capture to display p50 {glass.p50:g} ms, p95 {glass.p95:g} ms")
    if photon.p50 is not None:
        parts.append(f"input to photon p50 {photon.p50:g} ms")
    parts.append(f"{figures.bitrate_kbps:g} kbit/s, {figures.dropped} dropped")
    return "; ".join(parts)


def say(line: str) -> None:
    print(line, flush=True)


async def serve(settings: Settings, host: str, port: int) -> None:
    from websockets.asyncio.server import serve as ws_serve
    from websockets.datastructures import Headers
    from websockets.http11 import Response

    session = Session(settings)
    page = PAGE.encode()

    key = os.environ.get(KEY_VARIABLE) or None

    def process_request(connection: Any, request: Any) -> Any:
        path = request.path.split("?", 1)[0]
        if path == "/health":
            return connection.respond(200, "ok\n")
        if path in ("/stream", "/", "/index.html") and (refused := admitted(request, key)):
            say(f"refused a request for {path}: {refused[1]}")
            return connection.respond(refused[0], f"{refused[1]}\n")
        if path == "/stream":
            return None  # the WebSocket
        if path in ("/", "/index.html"):
            headers = Headers(
                [
                    ("Content-Type", "text/html; charset=utf-8"),
                    ("Content-Length", str(len(page))),
                    ("Cache-Control", "no-store"),
                ]
            )
            return Response(200, "OK", headers, page)
        return connection.respond(404, "not found\n")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with ws_serve(
        session.client,
        host,
        port,
        process_request=process_request,
        max_size=MAX_MESSAGE,
        compression=None,
        ping_interval=5,
        ping_timeout=20,
    ) as server:
        say(
            f"stream session on port {port}: {settings.width}x{settings.height} at"
            f" {settings.fps} fps, {settings.encoder_why}, codec {settings.codec}"
        )
        pushing = asyncio.create_task(session.pushing())
        await stop.wait()
        pushing.cancel()
        for client in list(session.clients.values()):
            client.ended = "the session ended"
        server.close(close_connections=True)
        await server.wait_closed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuflow.tasks.stream.server")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--encoder", choices=("auto", "nvenc", "x264"), default="auto")
    parser.add_argument("--bitrate-kbps", type=int, default=8000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--renderer", default=None)
    parser.add_argument("--pushgateway", default=None, help="the run's Pushgateway URL")
    parser.add_argument("--run-id", default="", help="the flow run's id (its push group)")
    parser.add_argument("--job", default="stream", help="the spec's name (its push group)")
    parser.add_argument("--push-interval-s", type=float, default=2.0)
    # where the endpoint reaches it: this machine's loopback, or (a fleet host's session)
    # every address: gpuflow says which
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    try:
        settings = Settings(args)
    except encode.EncoderError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    asyncio.run(serve(settings, args.host, int(os.environ["PORT"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
