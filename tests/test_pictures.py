"""A summary's pictures travel inside the artifact, bounded in size."""

from __future__ import annotations

import base64
import io
import os
import re

from PIL import Image

from gpuflow.tasks.pictures import picture


def _png(path, size: tuple[int, int], noisy: bool) -> None:
    if noisy:  # does not compress: a big PNG
        image = Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3))
    else:
        image = Image.new("RGB", size, (30, 120, 200))
    image.save(path, format="PNG")


def _carried(text: str) -> Image.Image:
    [encoded] = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)\)", text)
    return Image.open(io.BytesIO(base64.b64decode(encoded)))


def test_a_small_picture_is_carried_as_it_is(tmp_path):
    path = tmp_path / "plot.png"
    _png(path, (400, 200), noisy=False)
    text = picture("utilisation plot", path)
    assert text.startswith(
        f"- utilisation plot: `{path}`\n\n  ![utilisation plot](data:image/png;base64,"
    )
    assert _carried(text).size == (400, 200)


def test_a_large_picture_is_scaled_down_under_the_limit(tmp_path):
    path = tmp_path / "sheet.png"
    _png(path, (1600, 1200), noisy=True)
    assert path.stat().st_size > 100_000
    text = picture("contact sheet", path, limit=100_000)
    carried = _carried(text)
    assert carried.size[0] < 1600 and carried.size[0] / carried.size[1] == 1600 / 1200
    assert len(base64.b64decode(re.findall(r"base64,([^)]+)\)", text)[0])) <= 100_000


def test_what_cannot_be_carried_is_named_by_its_path(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png" * 50_000)
    assert picture("chart", broken, limit=1000) == f"- chart: `{broken}`"
    assert picture("chart", tmp_path / "gone.png") == f"- chart: `{tmp_path / 'gone.png'}`"


def test_runs_in_threads_of_one_process_draw_their_plots_at_once(tmp_path):
    """Many runs at once in one process (a sweep, a bench) each draw their utilisation plot
    in their own thread: every PNG is whole and its own size, and
    pyplot's process-wide figure list is never used."""
    import subprocess
    import sys

    code = f"""
import sys, threading
from pathlib import Path
from gpuflow.tasks.metrics.plot import utilisation_png

root = Path({str(tmp_path)!r})
samples = [{{"t": t, "gpus": [], "host": {{"cpu_percent": (7 * t) % 100}}}} for t in range(50)]
threads = [
    threading.Thread(target=utilisation_png, args=(samples, root / f"run{{i}}.png", f"run {{i}}"))
    for i in range(16)
]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("matplotlib.pyplot" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
    for i in range(16):
        with Image.open(tmp_path / f"run{i}.png") as image:
            image.load()
            assert image.size == (800, 350)
