"""Pictures in a run's summary (utilisation plot, training curve, contact sheet, cost
chart) as the Prefect UI draws them: inside the markdown artifact, as a data: URI, so a
browser on another machine, or CI, sees the picture and not a path on this one. A picture
over PICTURE_LIMIT is scaled down until it fits; the path to the full file stays beside it."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

PICTURE_LIMIT = 300 * 1024  # bytes of PNG per picture carried in an artifact


def _fitted(data: bytes, limit: int) -> bytes | None:
    """Return `data` (a PNG), scaled down by halves until it is under `limit` bytes; None
    when it cannot be read or never fits."""
    if len(data) <= limit:
        return data
    try:
        from PIL import Image

        image: Any = Image.open(io.BytesIO(data))
        image.load()
    except Exception:  # not a picture Pillow reads: shown by its path only
        return None
    while image.width > 64 and image.height > 64:
        image = image.resize((image.width // 2, image.height // 2))
        out = io.BytesIO()
        image.save(out, format="PNG", optimize=True)
        if out.tell() <= limit:
            return out.getvalue()
    return None


def picture(label: str, path: Path, limit: int = PICTURE_LIMIT) -> str:
    """Return a summary's list item for the PNG at `path`: its label and path, and the
    picture itself under it (scaled to fit `limit`), or the path alone when it cannot be
    carried."""
    line = f"- {label}: `{path}`"
    try:
        fitted = _fitted(path.read_bytes(), limit)
    except OSError:
        return line
    if fitted is None:
        return line
    encoded = base64.b64encode(fitted).decode()
    return f"{line}\n\n  ![{label}](data:image/png;base64,{encoded})\n"
