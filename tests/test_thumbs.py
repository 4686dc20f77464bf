"""Tone mapping and the Radiance reader behind contact sheets of HDR frames."""

from __future__ import annotations

import numpy as np
import pytest

from gpuflow.tasks.render.thumbs import kind_of, read_radiance, to_srgb8, tone_map

TONE = [  # linear light -> Reinhard -> 8-bit sRGB
    (0.0, 0),
    (-1.0, 0),  # negative light is black
    (1.0, 188),  # 0.5 after Reinhard
    (1000.0, 255),  # highlights roll off toward white without overflowing
    (float("nan"), 0),
]


@pytest.mark.parametrize(("linear", "expected"), TONE)
def test_tone_map_then_srgb(linear, expected):
    assert to_srgb8(tone_map(np.array([linear], dtype=np.float32)))[0] == expected


def test_tone_map_keeps_order_and_stays_below_one():
    values = tone_map(np.array([0.1, 1.0, 10.0, 1e6], dtype=np.float32))
    assert list(values) == sorted(values) and values.max() < 1.0


def _rgbe(r: float, g: float, b: float) -> bytes:
    top = max(r, g, b)
    mantissa, exponent = np.frexp(top)
    scale = mantissa * 256.0 / top
    return bytes([int(r * scale), int(g * scale), int(b * scale), exponent + 128])


@pytest.mark.parametrize("rle", [False, True])
def test_radiance_flat_and_run_length_scanlines(tmp_path, rle):
    width, height = 8, 2
    pixel = _rgbe(2.0, 1.0, 0.5)
    header = b"#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n" + f"-Y {height} +X {width}\n".encode()
    if rle:  # each channel as one run of 8 equal bytes
        row = b"\x02\x02\x00\x08" + b"".join(bytes([128 + width, c]) for c in pixel)
    else:
        row = pixel * width
    path = tmp_path / "frame.hdr"
    path.write_bytes(header + row * height)
    assert kind_of(path.read_bytes()[:16]) == "hdr"
    pixels = read_radiance(path)
    assert pixels.shape == (height, width, 3)
    assert np.allclose(pixels, [2.0, 1.0, 0.5], rtol=0.01)


def test_a_damaged_radiance_file_is_none(tmp_path):
    path = tmp_path / "cut.hdr"
    path.write_bytes(b"#?RADIANCE\n\n-Y 4 +X 8\n\x02\x02\x00\x08\x88")
    assert read_radiance(path) is None
