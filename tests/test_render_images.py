"""Frame checks: whole images pass; empty, cut-short, wrong-format files do not."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from gpuflow.tasks.render.images import check_image

FIXTURES = Path(__file__).parent / "fixtures" / "render"
PILLOW_FORMATS = {
    "PNG": "png",
    "JPEG": "jpg",
    "TIFF": "tif",
    "BMP": "bmp",
    "WEBP": "webp",
    "TARGA": "tga",
}


def picture(path: Path, fmt: str) -> Path:
    image = Image.linear_gradient("L").resize((64, 48)).convert("RGB")
    image.save(path, format={"TARGA": "TGA"}.get(fmt, fmt))
    return path


@pytest.mark.parametrize("fmt", sorted(PILLOW_FORMATS))
def test_whole_images_pass(tmp_path, fmt):
    assert check_image(picture(tmp_path / f"f.{PILLOW_FORMATS[fmt]}", fmt), fmt) is None


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "BMP", "WEBP"])
def test_cut_short_images_fail(tmp_path, fmt):
    path = picture(tmp_path / f"f.{PILLOW_FORMATS[fmt]}", fmt)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    problem = check_image(path, fmt)
    assert problem is not None and ("damaged" in problem or "not a" in problem)


def test_empty_missing_and_wrong_format(tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    assert check_image(empty, "PNG") == "is empty"
    assert check_image(tmp_path / "none.png", "PNG") == "was not written"
    jpeg = picture(tmp_path / "f.jpg", "JPEG")
    assert check_image(jpeg, "PNG") == "is a JPEG image, not PNG"
    garbage = tmp_path / "g.png"
    garbage.write_bytes(b"this is not an image at all")
    assert check_image(garbage, "PNG") == "is not a PNG image"


@pytest.mark.parametrize("name", ["zip.exr", "piz.exr"])  # written by Blender 3.4
def test_openexr_whole_and_cut_short(tmp_path, name):
    whole = FIXTURES / name
    assert check_image(whole, "OPEN_EXR") is None
    for keep in (0.3, 0.7, 0.99):
        cut = tmp_path / name
        data = whole.read_bytes()
        cut.write_bytes(data[: int(len(data) * keep)])
        problem = check_image(cut, "OPEN_EXR")
        assert problem is not None and "damaged" in problem, keep
    assert check_image(picture(tmp_path / "p.png", "PNG"), "OPEN_EXR") == "is not an OpenEXR file"


def test_signature_formats(tmp_path):
    assert check_image(FIXTURES / "frame.hdr", "HDR") is None
    assert check_image(picture(tmp_path / "p.png", "PNG"), "HDR") == "is not a HDR file"
