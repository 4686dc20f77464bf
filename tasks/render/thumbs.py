"""Thumbnails of the frame formats Pillow cannot read: OpenEXR (single and multilayer),
Radiance HDR and DPX.

High-dynamic-range frames (EXR, HDR) hold linear light with values above 1: they are
tone-mapped (Reinhard, x / (1 + x)) and encoded as sRGB, so highlights roll off instead
of clipping to white. EXR and DPX are decoded by ffmpeg; Radiance HDR by a small RGBE
reader here (this ffmpeg has no Radiance decoder).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where pixels are handled (half a second cold)
    import numpy as np

_EXR_MAGIC = b"\x76\x2f\x31\x01"


def kind_of(head: bytes) -> str | None:
    """Return "exr", "hdr" or "dpx" from a file's first bytes, else None."""
    if head.startswith(_EXR_MAGIC):
        return "exr"
    if head.startswith((b"#?RADIANCE", b"#?RGBE")):
        return "hdr"
    if head.startswith((b"SDPX", b"XPDS")):
        return "dpx"
    return None


def thumbnail_rgb(path: Path, box: int) -> np.ndarray | None:
    """Return an 8-bit sRGB thumbnail (H x W x 3, fitting in box x box) of a frame in one
    of this module's formats, or None when it is none of them or cannot be decoded."""
    import numpy as np

    with open(path, "rb") as handle:
        kind = kind_of(handle.read(16))
    if kind == "hdr":
        linear = read_radiance(path)
        return None if linear is None else to_srgb8(tone_map(shrink(linear, box)))
    if kind == "exr":
        info = exr_info(path)
        if info is None:
            return None
        (width, height), layer = info
        size = _fit(width, height, box)
        linear = _ffmpeg_float(path, size, ["-layer", layer] if layer else [])
        return None if linear is None else to_srgb8(tone_map(linear))
    if kind == "dpx":
        header = path.read_bytes()[:2048]
        big = header.startswith(b"SDPX")
        width, height = struct.unpack_from(">II" if big else "<II", header, 772)
        linear = _ffmpeg_float(path, _fit(width, height, box), [])
        return None if linear is None else to_srgb8(np.clip(linear, 0.0, 1.0), encode=False)
    return None


def tone_map(linear: np.ndarray) -> np.ndarray:
    """Return Reinhard-mapped values in [0, 1) from linear light (negatives as 0)."""
    import numpy as np

    linear = np.nan_to_num(np.maximum(linear, 0.0), nan=0.0, posinf=1e6)
    return linear / (1.0 + linear)


def to_srgb8(values: np.ndarray, encode: bool = True) -> np.ndarray:
    """Return 8-bit pixels; with `encode`, linear [0, 1] values get the sRGB curve first."""
    import numpy as np

    if encode:
        values = np.where(
            values <= 0.0031308, 12.92 * values, 1.055 * np.power(values, 1 / 2.4) - 0.055
        )
    return np.clip(np.rint(values * 255.0), 0, 255).astype(np.uint8)


def shrink(pixels: np.ndarray, box: int) -> np.ndarray:
    """Return `pixels` reduced by a whole factor to fit in box x box (area average)."""

    height, width = pixels.shape[:2]
    factor = max(1, -(-max(height, width) // box))
    height, width = height // factor * factor, width // factor * factor
    cropped = pixels[:height, :width]
    return cropped.reshape(height // factor, factor, width // factor, factor, 3).mean(axis=(1, 3))


def read_radiance(path: Path) -> np.ndarray | None:
    """Return the linear RGB pixels of a Radiance .hdr file (flat or run-length encoded
    RGBE scanlines), or None when it is damaged."""
    import numpy as np

    data = path.read_bytes()
    end = data.find(b"\n\n")
    if end < 0:
        return None
    line_end = data.find(b"\n", end + 2)
    resolution = data[end + 2 : line_end].split()
    if len(resolution) != 4 or resolution[0] != b"-Y" or resolution[2] != b"+X":
        return None
    height, width = int(resolution[1]), int(resolution[3])
    pos, rows = line_end + 1, []
    try:
        for _ in range(height):
            row, pos = _radiance_row(data, pos, width)
            rows.append(row)
    except (IndexError, ValueError):
        return None
    rgbe = np.stack(rows).astype(np.float32)
    exponent = np.where(rgbe[..., 3] > 0, np.ldexp(1.0, rgbe[..., 3].astype(int) - 136), 0.0)
    return rgbe[..., :3] * exponent[..., None]


def _radiance_row(data: bytes, pos: int, width: int) -> tuple[np.ndarray, int]:
    import numpy as np

    if not (8 <= width < 0x8000) or data[pos : pos + 2] != b"\x02\x02" or data[pos + 2] & 0x80:
        flat = np.frombuffer(data, np.uint8, width * 4, pos).reshape(width, 4)
        return flat, pos + width * 4
    if (data[pos + 2] << 8 | data[pos + 3]) != width:
        raise ValueError("scanline width does not match the image")
    pos += 4
    row = np.empty((4, width), np.uint8)
    for channel in range(4):
        x = 0
        while x < width:
            count = data[pos]
            pos += 1
            if count > 128:  # a run of one value
                count -= 128
                row[channel, x : x + count] = data[pos]
                pos += 1
            else:
                if count == 0:
                    raise ValueError("empty run")
                row[channel, x : x + count] = np.frombuffer(data, np.uint8, count, pos)
                pos += count
            x += count
    return row.T, pos


def exr_info(path: Path) -> tuple[tuple[int, int], str | None] | None:
    """Return (width, height) and the layer to show (None for plain R, G, B channels; the
    Combined pass, else the first layer with R, G and B, for a multilayer file)."""
    data = path.read_bytes()[: 1 << 20]
    pos, window, channels = 8, None, []
    while True:
        end = data.find(b"\0", pos)
        if end <= pos:
            break
        name = data[pos:end]
        kind_end = data.find(b"\0", end + 1)
        if kind_end < 0 or kind_end + 5 > len(data):
            return None
        length = struct.unpack_from("<i", data, kind_end + 1)[0]
        value = data[kind_end + 5 : kind_end + 5 + length]
        if name == b"dataWindow" and len(value) == 16:
            window = struct.unpack("<4i", value)
        elif name == b"channels":
            channels = [c.decode(errors="replace") for c in _channel_names(value)]
        pos = kind_end + 5 + length
    if window is None:
        return None
    size = (window[2] - window[0] + 1, window[3] - window[1] + 1)
    if {"R", "G", "B"} <= set(channels):
        return size, None
    layers = sorted({c.rsplit(".", 1)[0] for c in channels if "." in c})
    full = [layer for layer in layers if {f"{layer}.{c}" for c in "RGB"} <= set(channels)]
    if not full:
        return None
    combined = [layer for layer in full if layer.endswith("Combined")]
    return size, (combined or full)[0]


def _channel_names(value: bytes) -> list[bytes]:
    names, pos = [], 0
    while pos < len(value) and value[pos] != 0:
        end = value.index(b"\0", pos)
        names.append(value[pos:end])
        pos = end + 1 + 16  # pixel type, pLinear + reserved, xSampling, ySampling
    return names


def _fit(width: int, height: int, box: int) -> tuple[int, int]:
    scale = min(1.0, box / max(width, height, 1))
    return max(1, round(width * scale)), max(1, round(height * scale))


def _ffmpeg_float(path: Path, size: tuple[int, int], options: list[str]) -> np.ndarray | None:
    """Return the frame at `size` as float RGB from ffmpeg, or None without ffmpeg or on
    a decode error."""
    import numpy as np

    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        return None
    width, height = size
    argv = [ffmpeg, "-v", "error", *options, "-i", str(path), "-frames:v", "1"]
    argv += ["-vf", f"scale={width}:{height}:flags=area", "-f", "rawvideo"]
    argv += ["-pix_fmt", "gbrpf32le", "-"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return None
    planes = np.frombuffer(done.stdout, np.float32)
    if done.returncode != 0 or planes.size != 3 * width * height:
        return None
    green, blue, red = planes.reshape(3, height, width)
    return np.stack([red, green, blue], axis=-1)
