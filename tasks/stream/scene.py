"""The built-in scene, and how a user's renderer plugs in.

A renderer is `render(camera, t) -> frame`: `camera` a Camera (yaw and pitch in degrees,
moved by the page's keys and mouse), `t` seconds since the session started, the frame an
(height, width, 3) uint8 RGB array (numpy, or a torch tensor on any device). A user's
renderer is named `module:factory`; factory(width, height) returns it.

The built-in scene is a lit 360-degree panorama (a floor grid, pillars, a sky) the camera
looks around in, with a block that bounces across it so every frame differs. With torch
and a CUDA GPU it is made and cut on the GPU; else with numpy on the CPU (it says so).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Frame = Any  # numpy.ndarray or torch.Tensor, (height, width, 3) uint8
Renderer = Callable[["Camera", float], Frame]


@dataclass
class Camera:
    yaw: float = 0.0  # degrees, 0..360
    pitch: float = 0.0  # degrees, -60..60

    def turn(self, dyaw: float, dpitch: float) -> None:
        self.yaw = (self.yaw + dyaw) % 360.0
        self.pitch = max(-60.0, min(60.0, self.pitch + dpitch))


KEYS = {  # degrees a key press turns the camera
    "ArrowLeft": (-5.0, 0.0),
    "ArrowRight": (5.0, 0.0),
    "ArrowUp": (0.0, 5.0),
    "ArrowDown": (0.0, -5.0),
    "a": (-5.0, 0.0),
    "d": (5.0, 0.0),
    "w": (0.0, 5.0),
    "s": (0.0, -5.0),
}


def load(renderer: str | None, width: int, height: int) -> tuple[Renderer, str]:
    """Return the renderer and where it renders (for the session's first line)."""
    if renderer:
        module, _, name = renderer.partition(":")
        factory = getattr(importlib.import_module(module), name)
        return factory(width, height), f"your renderer {renderer}"
    scene = Panorama(width, height)
    return scene.render, scene.where


class Panorama:
    """The built-in scene: a panorama 4x the frame wide and 2x high, cut at the camera."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.torch, self.device = _torch_device()
        self.where = (
            f"the built-in scene on {self.device}"
            if self.device != "cpu"
            else "the built-in scene on the CPU (no GPU here: the software path)"
        )
        pano = _panorama(width * 4, height * 2)
        if self.torch is not None:
            self.pano = self.torch.from_numpy(pano).to(self.device)
        else:
            self.pano = pano

    def render(self, camera: Camera, t: float) -> Frame:
        w, h = self.width, self.height
        pw = w * 4
        x0 = int(camera.yaw / 360.0 * pw) % pw
        y0 = int((60.0 - camera.pitch) / 120.0 * h)  # pitch 60: the top; -60: the bottom
        rows = self.pano[y0 : y0 + h]
        if x0 + w <= pw:
            frame = rows[:, x0 : x0 + w]
        else:
            cat = self.torch.cat if self.torch is not None else np.concatenate
            frame = cat((rows[:, x0:], rows[:, : x0 + w - pw]), 1)
        frame = frame.clone() if self.torch is not None else frame.copy()
        _ball(frame, w, h, t)
        return frame


def _torch_device() -> tuple[Any, str]:
    try:
        import torch
    except ImportError:
        return None, "cpu"
    if torch.cuda.is_available():
        return torch, f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    return None, "cpu"  # numpy cuts a panorama as fast on the CPU


def _panorama(width: int, height: int) -> np.ndarray:
    """Return the scene's panorama: sky above the horizon, a grid floor below, pillars
    (each drawn into its own columns only: a second at 1080p, not several)."""
    ys = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    xs = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    image = np.empty((height, width, 3), dtype=np.uint8)
    horizon = height // 2
    sky = ys[:horizon]
    image[:horizon, :, 0] = 70 + 120 * sky
    image[:horizon, :, 1] = 120 + 100 * sky
    image[:horizon, :, 2] = 230 - 60 * sky
    image[horizon:] = (60, 70, 80)
    below = np.clip((ys[horizon:] - 0.5) * 2.0, 1e-3, 1.0)  # 0 at the horizon, 1 at the feet
    lines = (np.abs(((xs * 64) % 1.0) - 0.5) < 0.03 * below) | (
        np.abs(((2.0 / below) % 1.0) - 0.5) < 0.04
    )
    image[horizon:][lines] = (220, 220, 200)
    for i in range(16):  # pillars around the viewer, each its colour
        centre = (i + 0.5) / 16
        half = 0.006 + 0.004 * (i % 3)
        hue = 2 * math.pi * i / 16
        colour = np.array(
            [127 + 120 * math.cos(hue + shift) for shift in (0.0, 2.1, 4.2)], dtype=np.float32
        )
        left, right = int((centre - half) * width), int((centre + half) * width) + 1
        top, bottom = int((0.25 + 0.05 * (i % 4)) * height), int(0.62 * height)
        shade = 1.0 - 0.5 * np.abs(xs[0, left:right] - centre) / half
        image[top:bottom, left:right] = (shade[None, :, None] * colour).clip(0, 255)
    return image


def _ball(frame: Frame, width: int, height: int, t: float) -> None:
    """Draw a block bouncing across the frame (inverted colours) at time `t` (every frame differs)."""
    radius = max(4, height // 24)
    x = int((0.5 + 0.4 * math.sin(t * 1.3)) * (width - 2 * radius)) + radius
    y = int(height - radius - abs(math.sin(t * 3.0)) * height * 0.5) - 1
    top, left = max(0, y - radius), max(0, x - radius)
    frame[top : y + radius, left : x + radius] = 255 - frame[top : y + radius, left : x + radius]
