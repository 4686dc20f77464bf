"""Blender argv: order, safety of odd paths, settings, output patterns."""

from __future__ import annotations

import pytest

from gpuflow.tasks.render.argv import (
    RenderSettings,
    frame_filename,
    output_pattern,
    render_argv,
    safe_path,
    settings_expr,
)


def test_order_blend_first_frames_last_device_after_dashes():
    argv = render_argv(
        "blender",
        "scene.blend",
        "/out/frame_####",
        "1..4",
        RenderSettings(engine="cycles", device="optix", file_format="exr", samples=16),
    )
    assert argv[:3] == ["blender", "-b", "scene.blend"]
    assert (
        argv.index("-E")
        < argv.index("-o")
        < argv.index("-F")
        < argv.index("--python-expr")
        < argv.index("-f")
    )
    assert argv[argv.index("-E") + 1] == "CYCLES" and argv[argv.index("-F") + 1] == "OPEN_EXR"
    assert argv[-5:] == ["-f", "1..4", "--", "--cycles-device", "OPTIX"]


@pytest.mark.parametrize(
    "path",
    [
        "my scene.blend",
        'it\'s "quoted".blend',
        "scène-ünïcode.blend",
        "-starts-with-dash.blend",
        "$(rm -rf ~).blend",
    ],
)
def test_odd_paths_pass_as_one_argument(path):
    argv = render_argv("blender", path, "/out/f_####", "1", RenderSettings())
    assert argv[2] == safe_path(path)
    assert argv[2].endswith(path) and not argv[2].startswith("-")
    assert len(argv) == 9  # blender -b SCENE -o OUT --python-expr EXPR -f 1: nothing split


def test_no_settings_only_file_extensions():
    expr = settings_expr(RenderSettings())
    assert expr.splitlines()[-1] == "r.use_file_extension = True"
    assert "resolution" not in expr and "samples" not in expr


@pytest.mark.parametrize(
    ("pattern", "frame", "extension", "name"),
    [
        ("frame_####", 7, ".png", "frame_0007.png"),
        ("frame_#", 12, ".png", "frame_12.png"),  # wider than the placeholder: more digits
        ("shot#_f_###", 3, ".exr", "shot#_f_003.exr"),  # the last run is the frame
        ("render", 5, ".jpg", "render0005.jpg"),
        ("f_###_final", 42, ".tif", "f_042_final.tif"),
    ],
)
def test_frame_filename(pattern, frame, extension, name):
    assert frame_filename(pattern, frame, extension) == name


def test_settings_expr_sets_what_was_asked():
    expr = settings_expr(
        RenderSettings(
            resolution_x=32, resolution_y=24, resolution_percentage=50, threads=2, denoise=False
        )
    )
    assert "r.resolution_x = 32" in expr and "r.resolution_y = 24" in expr
    assert "r.resolution_percentage = 50" in expr and "r.threads = 2" in expr
    assert "s.cycles.use_denoising = False" in expr
    compile(expr, "<python-expr>", "exec")


@pytest.mark.parametrize(
    ("pattern", "fixed", "noted"),
    [
        ("/out/frame_####", "/out/frame_####", False),
        ("/out/render", "/out/render_####", True),
        ("/out/", "/out/frame_####", True),
        ("/a#b/render", "/a#b/render_####", True),  # a # in a folder name is not a placeholder
    ],
)
def test_output_pattern(pattern, fixed, noted):
    result, note = output_pattern(pattern)
    assert result == fixed and (note is not None) == noted
