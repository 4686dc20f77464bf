"""The page a stream session serves: it decodes the frames with WebCodecs, draws them on
a canvas, sends keys and mouse moves back, keeps the server's clock mapped onto its own
(the best of repeated pings), and reports each shown frame's stages and each input's
time to photon. `window.gpuflowStream` holds what it measured (for tests and debugging).
"""

PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>gpuflow stream</title>
<style>
  body { margin: 0; background: #111; color: #ddd; font: 14px sans-serif; }
  #view { display: block; max-width: 100vw; max-height: 92vh; margin: 0 auto; outline: none; }
  #said, #figures { padding: 6px 10px; }
  #figures { color: #9a9; font-family: monospace; }
</style></head>
<body>
<canvas id="view" tabindex="0"></canvas>
<div id="said">connecting...</div>
<div id="figures"></div>
<script>
"use strict";
const FRAME_BYTES = 44;
const now = () => performance.timeOrigin + performance.now();  // the page's clock, ms
const S = window.gpuflowStream = {
  state: "connecting", config: null, decoded: 0, shown: 0, dropped: 0, bytes: 0,
  yaw: null, pitch: null, inputs: 0, offset: null, bestRtt: Infinity, error: null,
  glass: [], photon: [], lastInputShown: 0,
};
const canvas = document.getElementById("view");
const said = document.getElementById("said");
const ctx = canvas.getContext("2d");
const meta = new Map();     // frame number -> what its header and arrival said
const inputs = new Map();   // input sequence -> when it was made
let pending = [], pendingInputs = [], seq = 0, decoder = null, newestShown = -1;
const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/stream" + location.search;
const ws = new WebSocket(url);
ws.binaryType = "arraybuffer";

function send(message) { if (ws.readyState === 1) ws.send(JSON.stringify(message)); }
function ping() { send({t: "ping", c: now()}); }
function toPage(serverMs) { return serverMs - (S.offset || 0); }

async function configure(config) {
  S.config = config;
  canvas.width = config.width; canvas.height = config.height;
  const wanted = {codec: config.codec, codedWidth: config.width, codedHeight: config.height,
                  optimizeForLatency: true};
  let ok = typeof VideoDecoder !== "undefined";
  if (ok) {
    try { ok = (await VideoDecoder.isConfigSupported(wanted)).supported; } catch (e) { ok = false; }
  }
  if (!ok) {
    S.state = "unsupported";
    said.textContent = "This browser cannot decode the stream (" + config.codec + ", H.264) with" +
      " WebCodecs; open it in a recent Chrome, Edge, Firefox or Safari.";
    send({t: "hello", supported: false, codec: config.codec});
    return;
  }
  decoder = new VideoDecoder({output: show, error: e => { S.error = String(e); said.textContent = "decoder: " + e; }});
  decoder.configure(wanted);
  send({t: "hello", supported: true, codec: config.codec});
  S.state = "streaming";
  said.textContent = config.width + "x" + config.height + " at " + config.fps + " fps, " +
    config.encoder + "; arrow keys or drag to look around";
}

function show(frame) {
  const number = frame.timestamp;
  const m = meta.get(number);
  meta.delete(number);
  const decoded = now();
  S.decoded += 1;
  if (!m || number < newestShown) { frame.close(); S.dropped += 1; return; }
  ctx.drawImage(frame, 0, 0);
  frame.close();
  newestShown = number;
  requestAnimationFrame(() => {
    const shown = now();
    S.shown += 1;
    S.yaw = m.yaw; S.pitch = m.pitch;
    const glass = shown - toPage(m.captured);
    S.glass.push(glass);
    pending.push([glass, m.arrived - toPage(m.sent), decoded - m.arrived, shown - decoded]);
    for (const [id, made] of inputs) {
      if (id <= m.input) { const ms = shown - made; pendingInputs.push(ms); S.photon.push(ms); inputs.delete(id); }
    }
    if (m.input > S.lastInputShown) S.lastInputShown = m.input;
  });
}

ws.onopen = () => { S.state = "open"; for (let i = 0; i < 5; i++) setTimeout(ping, i * 100); };
ws.onclose = e => { S.state = "closed"; said.textContent = "the session ended (" + (e.reason || e.code) + ")"; };
ws.onmessage = e => {
  if (typeof e.data === "string") {
    const m = JSON.parse(e.data);
    if (m.t === "config") configure(m);
    else if (m.t === "pong") {
      const back = now(), rtt = back - m.c;
      if (rtt < S.bestRtt) { S.bestRtt = rtt; S.offset = m.s - (m.c + rtt / 2); }
    }
    return;
  }
  if (!decoder || decoder.state !== "configured") return;
  const view = new DataView(e.data);
  const number = view.getUint32(4, true);
  meta.set(number, {
    key: view.getUint8(1) === 1, input: view.getUint32(8, true),
    captured: view.getFloat64(12, true), sent: view.getFloat64(20, true),
    yaw: view.getFloat32(36, true), pitch: view.getFloat32(40, true), arrived: now(),
  });
  S.bytes += e.data.byteLength - FRAME_BYTES;
  decoder.decode(new EncodedVideoChunk({
    type: view.getUint8(1) === 1 ? "key" : "delta", timestamp: number,
    data: new Uint8Array(e.data, FRAME_BYTES),
  }));
};

function input(message) {
  seq += 1; inputs.set(seq, now()); S.inputs += 1;
  send(Object.assign({t: "input", seq: seq}, message));
}
const KEYS = new Set(["ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown", "a", "d", "w", "s"]);
document.addEventListener("keydown", e => { if (KEYS.has(e.key)) { e.preventDefault(); input({key: e.key}); } });
let drag = null;
canvas.addEventListener("mousedown", e => { drag = [e.clientX, e.clientY]; });
window.addEventListener("mouseup", () => { drag = null; });
window.addEventListener("mousemove", e => {
  if (!drag) return;
  const dx = e.clientX - drag[0], dy = e.clientY - drag[1];
  drag = [e.clientX, e.clientY];
  if (dx || dy) input({dx: dx, dy: dy});
});
// what this page measures, shown under the picture: the last 2 s of frames
const figures = document.getElementById("figures");
function quantile(values, q) {
  if (!values.length) return null;
  const sorted = values.slice().sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}
let lastShown = 0, lastGlass = 0, lastPhoton = 0;
setInterval(() => {
  const glass = S.glass.slice(lastGlass), photon = S.photon.slice(lastPhoton);
  lastGlass = S.glass.length; lastPhoton = S.photon.length;
  if (S.glass.length > 10000) { S.glass.splice(0, 5000); lastGlass -= 5000; }
  const fps = (S.shown - lastShown) / 2; lastShown = S.shown;
  if (!glass.length) return;
  const ms = v => v === null ? "-" : v.toFixed(0) + " ms";
  S.figures = "glass-to-glass p50 " + ms(quantile(glass, 0.5)) + ", p95 " + ms(quantile(glass, 0.95)) +
    "; input-to-photon " + (photon.length ? ms(quantile(photon, 0.5)) : "-") +
    "; " + fps.toFixed(0) + " fps shown, " + S.dropped + " dropped";
  figures.textContent = S.figures;
}, 2000);
setInterval(() => {
  ping();
  if (!pending.length && !pendingInputs.length) return;
  send({t: "stats", frames: pending.splice(0, 2000), inputs: pendingInputs.splice(0, 2000),
        dropped: S.dropped, clock_error_ms: S.bestRtt / 2});
}, 500);
</script>
</body></html>
"""
