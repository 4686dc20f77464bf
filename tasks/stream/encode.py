"""Low-latency H.264 for a stream: NVENC where the GPU has it, libx264 on the CPU
otherwise, through PyAV (FFmpeg's libraries). Every frame in gives its packet out at once:
no B-frames, no look-ahead, x264's zero-latency tuning (NVENC: ultra-low-latency, no
delay). The bitstream is Annex B with the parameter sets in every keyframe, what a
browser's WebCodecs decoder takes with no description."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

CODECS = {"nvenc": "h264_nvenc", "x264": "libx264"}


class EncoderError(Exception):
    """The encoder asked for cannot be opened here (one sentence, its real cause)."""


def codec_string(width: int, height: int, fps: int) -> str:
    """Return the WebCodecs codec string of the stream: H.264 constrained baseline at the
    level the size and rate need."""
    macroblocks = ((width + 15) // 16) * ((height + 15) // 16)
    rate = macroblocks * fps
    levels = [  # (level_idc, max macroblocks/s, max frame macroblocks)
        (31, 108_000, 3_600),
        (40, 245_760, 8_192),
        (42, 522_240, 8_704),
        (50, 589_824, 22_080),
        (51, 983_040, 36_864),
        (52, 2_073_600, 36_864),
    ]
    level = next((lv for lv, most, frame in levels if rate <= most and macroblocks <= frame), 52)
    return f"avc1.42E0{level:02X}"


@dataclass
class Packet:
    data: bytes
    key: bool


class Encoder:
    """One client's H.264 encoder."""

    def __init__(self, kind: str, width: int, height: int, fps: int, bitrate_kbps: int) -> None:
        import av

        self.av = av
        self.kind, self.width, self.height = kind, width, height
        name = CODECS[kind]
        try:
            context: Any = av.CodecContext.create(name, "w")  # a video encoder's context
        except Exception as exc:  # not built into this FFmpeg
            raise EncoderError(f"{name} is not in this FFmpeg ({exc})") from None
        context.width, context.height = width, height
        context.pix_fmt = "yuv420p"
        context.framerate = Fraction(fps, 1)
        context.time_base = Fraction(1, fps)
        context.bit_rate = bitrate_kbps * 1000
        context.gop_size = fps * 2
        context.max_b_frames = 0
        if kind == "x264":
            context.profile = "baseline"
            context.options = {
                "preset": "ultrafast",
                "tune": "zerolatency",
                "x264-params": "repeat-headers=1:rc-lookahead=0:sync-lookahead=0:bframes=0",
            }
        else:
            context.options = {
                "preset": "p1",
                "tune": "ull",
                "zerolatency": "1",
                "delay": "0",
                "rc": "cbr",
                "profile": "baseline",
                "forced-idr": "1",
            }
        try:
            context.open()
        except Exception as exc:  # NVENC: no driver, no encoder, no free session
            raise EncoderError(f"{name} could not be opened: {exc}") from None
        self.context = context
        self.pts = 0
        self.key_next = True

    def encode(self, rgb: Any) -> list[Packet]:
        """Encode one (height, width, 3) uint8 RGB frame; return its packets (one)."""
        frame = self.av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
        frame.pts = self.pts
        self.pts += 1
        if self.key_next:
            frame.pict_type = self.av.video.frame.PictureType.I
            self.key_next = False
        return [Packet(bytes(p), bool(p.is_keyframe)) for p in self.context.encode(frame)]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.context.encode(None)


def choose(kind: str, gpus: bool) -> tuple[str, str]:
    """Return the encoder to use and why: `auto` takes NVENC where a GPU's encoder opens
    (a free session), else x264; `nvenc` without a GPU raises EncoderError."""
    if kind == "x264":
        return "x264", "x264 (asked for)"
    if not gpus:
        if kind == "nvenc":
            raise EncoderError(
                "job.encoder: nvenc encodes on an NVIDIA GPU and this host shows none; use"
                " encoder x264 (or auto), or run where there is a GPU"
            )
        return "x264", "x264 on the CPU (no GPU here)"
    try:
        Encoder("nvenc", 256, 144, 30, 1000).close()
    except EncoderError as exc:
        if kind == "nvenc":
            raise
        return "x264", f"x264 on the CPU (NVENC: {exc})"
    return "nvenc", "NVENC on the GPU"


def keeps_up(kind: str, sizes: list[tuple[int, int]], fps: int, frames: int = 20) -> list[dict]:
    """Encode `frames` moving frames at each size; return each size's milliseconds per
    frame and the frame rate it keeps up with (the preflight's short encode)."""
    import numpy as np

    rows = []
    for width, height in sizes:
        encoder = Encoder(kind, width, height, fps, 8000)
        base = np.random.default_rng(1).integers(0, 255, (height, width, 3), dtype=np.uint8)
        spent = []
        for i in range(frames):
            frame = np.roll(base, i * 8, axis=1)
            began = time.perf_counter()
            encoder.encode(frame)
            spent.append((time.perf_counter() - began) * 1000)
        encoder.close()
        ms = sorted(spent[2:])[len(spent[2:]) // 2]  # the median, past the first frames
        rows.append({"width": width, "height": height, "encode_ms": round(ms, 2),
                     "fps": int(1000 / ms) if ms > 0 else 1000})  # fmt: skip
    return rows
