"""The Blender log parser, on output captured from the real Blender (tests/fixtures/blender)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuflow.tasks.render.logparse import classify, parse

FIXTURES = Path(__file__).parent / "fixtures" / "blender"


def log_of(name: str):
    return parse((FIXTURES / name).read_text())


def test_successful_cycles_render():
    log = log_of("cycles_ok.log")
    assert log.saved == {1: "/work/scene/out/frame_0001.png", 2: "/work/scene/out/frame_0002.png"}
    assert log.samples == (2, 2)
    assert log.frame_seconds == {1: pytest.approx(0.42), 2: pytest.approx(0.0)}
    assert log.errors == [] and classify(log, 0) is None


@pytest.mark.parametrize(
    ("fixture", "exit_code", "kind", "words"),
    [
        ("bad_frame_arg.log", 0, "bad_frame_argument", "did not understand the frames 1-3"),
        ("pyexc.log", 0, "python_error", "the settings script failed (ValueError: boom)"),
        ("garbage.log", 1, "not_a_blend", "/work/scene/garbage.blend is not a .blend file"),
        ("trunc.log", 1, "corrupt_blend", "/work/scene/trunc.blend is damaged (Missing DNA block)"),
        ("missing.log", 1, "missing_file", "the scene /work/scene/nope.blend does not exist"),
        ("no_denoiser.log", 1, "no_denoiser", "set denoise: false"),
    ],
)
def test_failures_are_classified_even_with_exit_0(fixture, exit_code, kind, words):
    failure = classify(log_of(fixture), exit_code)
    assert failure is not None and failure.kind == kind and not failure.transient
    assert words in failure.message


def test_python_error_still_saved_the_frame():
    log = log_of("pyexc.log")
    assert 1 in log.saved  # Blender rendered anyway: only the log tells
    assert log.python_error == "ValueError: boom"


@pytest.mark.parametrize(
    ("line", "frame", "samples"),
    [
        (
            "Fra:12 Mem:9.9M (Peak 10M) | Time:00:01.20 | Mem:0.7M, Peak:0.7M | Scene, ViewLayer | Sample 7/64",
            12,
            (7, 64),
        ),
        ("Fra:3 Mem:20M (Peak 21M) | Time:00:00.50 | Rendering 5 / 16 samples", 3, (5, 16)),
        (
            "10:32:01.123  render           | Fra:4 Mem:9M | Time:00:00.10 | Scene, ViewLayer | Sample 1/8",
            4,
            (1, 8),
        ),
    ],
)
def test_progress_lines_from_cycles_eevee_and_newer_prefixes(line, frame, samples):
    log = parse(line)
    assert log.current_frame == frame and log.samples == samples


def test_signals_and_silent_exits_are_transient():
    assert classify(parse(""), None, signal=9).transient
    assert "out-of-memory killer" in classify(parse(""), None, signal=9).message
    assert classify(parse(""), 3).transient
    assert classify(parse("Error: Cannot render, no camera"), 0).kind == "no_camera"


@pytest.mark.parametrize(
    ("line", "path", "seconds"),
    [
        ("Saved: '/out/frame_0001.png'", "/out/frame_0001.png", None),
        ("Saved: '/out/it''s here/f_1.exr'", "/out/it''s here/f_1.exr", None),
        (" Time: 00:00.53 (Saving: 00:00.25)", None, 0.53),
        (" Time: 01:02:03.50 (Saving: 00:00.25)", None, 3723.5),
        ("Fra:1 Mem:9.17M (Peak 10.87M) | Time:00:00.00 | Scene | Finished", None, None),
    ],
)
def test_saved_and_time_lines_without_fra_lines(line, path, seconds):
    from gpuflow.tasks.render.logparse import frame_time, saved_path

    assert saved_path(line) == path
    assert frame_time(line) == seconds
