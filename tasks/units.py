"""Sizes ("16Gi", "512MB") and durations ("1h30m", "90s") as users write them."""

from __future__ import annotations

import math
import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|d|h|m|s)")
_DURATION_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_size(value: int | float | str) -> int:
    """Return a size in bytes; raise ValueError with an example of what is accepted."""
    if isinstance(value, bool):
        raise ValueError("is not a size; write e.g. 16Gi, 512Mi or a number of bytes")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("must not be negative")
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size; write e.g. 16Gi, 512Mi or 100GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(value: int | float | str) -> float:
    """Return a duration in seconds from 90, "90s", "30m", "1h30m" or "2d"."""
    if isinstance(value, bool):
        raise ValueError("is not a duration; write e.g. 90s, 30m or 1h30m")
    if isinstance(value, int | float):
        return _finite(float(value), value)
    text = str(value).strip().lower().replace(" ", "")
    try:
        return _finite(float(text), value)
    except ValueError as exc:
        if "finite" in str(exc):
            raise
    parts = _DURATION_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{value!r} is not a duration; write e.g. 90s, 30m or 1h30m")
    return _finite(sum(float(n) * _DURATION_SECONDS[u] for n, u in parts), value)


def _finite(seconds: float, value: object) -> float:
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration; write e.g. 90s, 30m or 1h30m")
    return seconds


def format_bytes(size: float) -> str:
    """Return a size for people: 1.5 GiB, 512.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"
