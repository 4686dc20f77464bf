"""Is a rendered frame a whole, readable image in the format asked for? Pure (reads files).

Blender can exit 0 and leave no file, an empty one, or a file cut short (disk full,
killed while saving); a frame counts as done only when this check passes.
PNG, JPEG, TIFF, BMP, WebP and Targa are decoded in full with Pillow; OpenEXR has no
Pillow decoder, so its header and chunk offset table are checked against the file size,
which catches truncation; the rarer formats are checked by their signature.
"""

from __future__ import annotations

import struct
from pathlib import Path

_PILLOW = {
    "PNG": "PNG",
    "JPEG": "JPEG",
    "TIFF": "TIFF",
    "BMP": "BMP",
    "WEBP": "WEBP",
    "TARGA": "TGA",
    "TARGA_RAW": "TGA",
}
_SIGNATURES = {
    "HDR": (b"#?RADIANCE", b"#?RGBE"),
    "JPEG2000": (b"\x00\x00\x00\x0cjP  ", b"\xff\x4f\xff\x51"),
    "CINEON": (b"\x80\x2a\x5f\xd7", b"\xd7\x5f\x2a\x80"),
    "DPX": (b"SDPX", b"XPDS"),
    "IRIS": (b"\x01\xda",),
}
_EXR_MAGIC = b"\x76\x2f\x31\x01"
# Scan lines per chunk for each OpenEXR compression (none, rle, zips, zip, piz, pxr24,
# b44, b44a, dwaa, dwab).
_EXR_LINES = {0: 1, 1: 1, 2: 1, 3: 16, 4: 32, 5: 16, 6: 32, 7: 32, 8: 32, 9: 256}


def check_image(path: Path, file_format: str) -> str | None:
    """Return None when `path` is a whole image in `file_format`, else what is wrong."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "was not written"
    if size == 0:
        return "is empty"
    try:
        if file_format in _PILLOW:
            return _check_pillow(path, _PILLOW[file_format])
        if file_format in ("OPEN_EXR", "OPEN_EXR_MULTILAYER"):
            return _check_exr(path, size)
        head = path.read_bytes()[:16]
        if any(head.startswith(sig) for sig in _SIGNATURES.get(file_format, (b"",))):
            return None
        return f"is not a {file_format} file"
    except OSError as exc:
        return f"could not be read ({exc.strerror or exc})"


def _check_pillow(path: Path, expected: str) -> str | None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            found = image.format
            image.load()  # decodes every byte: a truncated file fails here
    except UnidentifiedImageError:
        return f"is not a {expected} image"
    except (OSError, SyntaxError, ValueError) as exc:
        return f"is damaged ({exc})"
    if found != expected:
        return f"is a {found} image, not {expected}"
    return None


def _check_exr(path: Path, size: int) -> str | None:
    with open(path, "rb") as handle:
        data = handle.read(min(size, 1 << 20))  # headers are small; offsets follow them
        if not data.startswith(_EXR_MAGIC):
            return "is not an OpenEXR file"
        version = struct.unpack_from("<I", data, 4)[0]
        if version & 0x1000:  # multi-part: several headers; check the magic and size only
            return None
        header, pos = _exr_header(data, 8)
        if header is None:
            return "is damaged (its header is cut short)"
        window = header.get("dataWindow")
        compression = header.get("compression", 0)
        if window is None:
            return "is damaged (no dataWindow in its header)"
        _, y_min, _, y_max = window
        if version & 0x200:  # tiled: count of tiles is harder; the last offset still bounds it
            chunks = None
        else:
            lines = _EXR_LINES.get(compression, 1)
            chunks = -(-(y_max - y_min + 1) // lines)
        if chunks is None:
            return None
        need = pos + 8 * chunks
        if need > len(data):
            handle.seek(0)
            data = handle.read(need)
        if len(data) < need:
            return "is damaged (cut short in its offset table)"
        offsets = struct.unpack_from(f"<{chunks}Q", data, pos)
        bad = [o for o in offsets if o == 0 or o >= size]
        if bad:
            return f"is damaged (cut short: {len(bad)} of {chunks} chunks missing)"
        handle.seek(max(offsets))
        chunk_head = handle.read(8)
        if len(chunk_head) < 8:
            return "is damaged (its last chunk is cut short)"
        data_size = struct.unpack_from("<i", chunk_head, 4)[0]
        if max(offsets) + 8 + data_size > size:
            return "is damaged (its last chunk is cut short)"
    return None


def _exr_header(data: bytes, pos: int) -> tuple[dict | None, int]:
    """Return the header attributes gpuflow needs and the position after the header."""
    header: dict = {}
    while True:
        end = data.find(b"\0", pos)
        if end < 0:
            return None, pos
        name = data[pos:end].decode(errors="replace")
        pos = end + 1
        if not name:
            return header, pos
        type_end = data.find(b"\0", pos)
        if type_end < 0 or type_end + 5 > len(data):
            return None, pos
        kind = data[pos:type_end].decode(errors="replace")
        length = struct.unpack_from("<i", data, type_end + 1)[0]
        value_at = type_end + 5
        if value_at + length > len(data):
            return None, pos
        if name == "dataWindow" and kind == "box2i":
            header[name] = struct.unpack_from("<4i", data, value_at)
        elif name == "compression":
            header[name] = data[value_at]
        pos = value_at + length
