"""Glass-to-glass latency of a stream session on this machine (x264 on the CPU; the
page in headless Chromium decodes with WebCodecs): for each size, a session through
gpuflow's endpoint for --seconds with a key pressed every second; the page's figures
(capture to display, input to photon, each stage) side by side with the 80 ms a cloud
game is held to, and the encoder's milliseconds per frame.

    python bench/stream.py [--seconds 20] [--sizes 1280x720,1920x1080] [--fps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from uuid import UUID

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "fakes"))  # fake NVML: the host's GPUs, none used

from waiting import free_port, listening, until  # noqa: E402

TARGET_MS = 80.0  # the seeds' 1080p glass-to-glass bound
STAGES = ("render", "encode", "send", "decode", "draw")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--sizes", default="1280x720,1920x1080")
    parser.add_argument("--fps", type=int, default=30)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-stream-"))
    os.environ.update(
        GPUFLOW_HOME=str(scratch / "home"),
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    from prefect.testing.utilities import prefect_test_harness

    from gpuflow.tasks.stream import encode

    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    encoded = encode.keeps_up("x264", sizes, args.fps, frames=40)
    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        for width, height in sizes:
            rows.append(session(width, height, args.fps, args.seconds))
    print(f"\nx264 (ultrafast, zerolatency), {args.fps} fps asked, {args.seconds:g} s each:")
    print(f"  {'size':<10} {'encode ms/frame':>16} {'keeps up to':>12}")
    for row in encoded:
        print(f"  {row['width']}x{row['height']:<5} {row['encode_ms']:>16.2f} {row['fps']:>9} fps")
    print(f"\n  {'size':<10} {'fps':>5} {'g2g p50':>8} {'p95':>6} {'p99':>6} {'input p50':>10}"
          f" {'p95':>6} {'vs 80 ms':>9} {'kbit/s':>7} {'dropped':>8}")  # fmt: skip
    for figures in rows:
        glass, photon = figures["capture_to_display"], figures["input_to_photon"]
        print(
            f"  {figures['width']}x{figures['height']:<5} {figures['fps']:>5.1f}"
            f" {glass['p50']:>8.1f} {glass['p95']:>6.1f} {glass['p99']:>6.1f}"
            f" {photon['p50'] or 0:>10.1f} {photon['p95'] or 0:>6.1f}"
            f" {glass['p50'] / TARGET_MS:>8.2f}x {figures['bitrate_kbps']:>7.0f}"
            f" {figures['dropped']:>8}"
        )
    print("\n  share of each stage (p50 ms, and of their sum):")
    for figures in rows:
        p50 = {s: figures["stages"][s]["p50"] or 0.0 for s in STAGES}
        total = sum(p50.values()) or 1.0
        said = ", ".join(f"{s} {p50[s]:.1f} ({100 * p50[s] / total:.0f} %)" for s in STAGES)
        print(f"  {figures['width']}x{figures['height']}: {said}")


def session(width: int, height: int, fps: int, seconds: float) -> dict:
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.browser import chromium, tab

    port = free_port()
    spec = load_spec(
        {
            "name": f"bench-{width}x{height}",
            "job": {"kind": "stream", "port": port, "width": width, "height": height,
                    "fps": fps, "encoder": "x264", "idle_after_s": 2},
            "resources": {"gpus": 0},
            "limits": {"max_duration": "15m"},
        }
    )  # fmt: skip
    thread = threading.Thread(target=lambda: gpu_pipeline(spec, return_state=True), daemon=True)
    thread.start()
    until(lambda: listening(port))

    async def watch(endpoint: str) -> None:
        async with tab(endpoint, f"http://127.0.0.1:{port}/") as page:
            await page.wait_until("window.gpuflowStream && window.gpuflowStream.shown > 10", 120)
            began = time.monotonic()
            while time.monotonic() - began < seconds:
                await page.key("ArrowRight")
                await asyncio.sleep(1.0)

    with chromium() as endpoint:
        asyncio.run(watch(endpoint))
    home = Path(os.environ["GPUFLOW_HOME"])
    [record] = (home / "local" / "clusters").glob("*.json")
    run_id = record.stem.removeprefix("gpuflow-")
    workspace = json.loads(record.read_text())["cluster"]["workspace"]
    outputs = Path(workspace) / "outputs"
    until(lambda: any(_shown(p) for p in outputs.glob("stream-*.json")), 60)
    figures = next(json.loads(p.read_text()) for p in outputs.glob("stream-*.json") if _shown(p))
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(UUID(run_id), Cancelling(), force=True)
    thread.join()
    return figures


def _shown(path: Path) -> bool:
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return said["frames_shown"] > 0 and said["ended"] != ""


if __name__ == "__main__":
    main()
