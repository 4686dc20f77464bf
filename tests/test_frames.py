"""Frame specs and chunking, table-driven."""

from __future__ import annotations

import pytest

from gpuflow.tasks.render.frames import (
    FrameSpecError,
    auto_chunk_size,
    blender_frames,
    chunk,
    label,
    outside,
    parse_frames,
)

PARSE = [
    ("1-5", [1, 2, 3, 4, 5]),
    ("1..5", [1, 2, 3, 4, 5]),
    ("1,3,5", [1, 3, 5]),
    ("1-20x5", [1, 6, 11, 16]),
    ("1..20x5", [1, 6, 11, 16]),
    ("7", [7]),
    ("0", [0]),
    ("5,1-3,3,2", [1, 2, 3, 5]),
    (" 1 - 3 , 10 ", [1, 2, 3, 10]),
    ("1..10,20..25,40,3..8", [*range(1, 11), *range(20, 26), 40]),
]


@pytest.mark.parametrize(("spec", "frames"), PARSE)
def test_parse(spec, frames):
    assert parse_frames(spec) == frames


BAD = [
    ("", "the frame spec is empty"),
    ("10-1", "'10-1' runs backwards; write 1-10"),
    ("abc", "'abc' is not a frame, a range A-B or a stepped range A-BxS"),
    ("1-10x0", "'1-10x0' has step 0"),
    ("1-", "'1-' is not a frame"),
    ("-3", "'-3' is not a frame"),
    ("1,,2", "'' is not a frame"),
    ("1-2000000", "goes past Blender's last frame"),
]


@pytest.mark.parametrize(("spec", "message"), BAD)
def test_bad_specs(spec, message):
    with pytest.raises(FrameSpecError, match=message.replace("(", r"\(")):
        parse_frames(spec)


def test_flamenco_chunk_table():
    frames = parse_frames("1..10,20..25,40,3..8")
    assert [label(c) for c in chunk(frames, 4)] == ["1-4", "5-8", "9,10,20,21", "22-25", "40"]


@pytest.mark.parametrize(
    ("frames", "size", "chunks"),
    [
        ([1, 2, 3], 1, [[1], [2], [3]]),
        ([1, 2, 3], 5, [[1, 2, 3]]),
        ([], 3, []),
    ],
)
def test_chunk(frames, size, chunks):
    assert chunk(frames, size) == chunks


def test_chunk_size_zero():
    with pytest.raises(FrameSpecError, match="chunk size must be at least 1"):
        chunk([1, 2], 0)


@pytest.mark.parametrize(
    ("frames", "label_text", "blender"),
    [
        ([1, 2, 3, 4], "1-4", "1..4"),
        ([1, 2, 4], "1,2,4", "1,2,4"),
        ([5, 7, 8, 9, 20], "5,7-9,20", "5,7..9,20"),
    ],
)
def test_labels(frames, label_text, blender):
    assert label(frames) == label_text
    assert blender_frames(frames) == blender


@pytest.mark.parametrize(
    ("frames", "startup", "per_frame", "workers", "size"),
    [
        (240, 1.0, 0.5, 1, 20),  # 1 s start over 20 x 0.5 s = 10 % overhead
        (240, 1.0, 10.0, 1, 1),  # slow frames: one per chunk is already amortised
        (240, 1.0, 0.5, 4, 20),
        (30, 1.0, 0.1, 4, 8),  # capped so that all 4 workers get work
        (1, 1.0, 0.01, 8, 1),
    ],
)
def test_auto_chunk_size(frames, startup, per_frame, workers, size):
    assert auto_chunk_size(frames, startup, per_frame, workers) == size


def test_frames_outside_the_scene():
    assert outside([1, 5, 250, 300], 1, 250) == [300]


SIZER = [
    # chunk, start-up s, workers, learned (per-frame s, start-up s) or None, remaining, size
    (8, 1.5, 1, None, 100, 8),  # fixed sizes are kept
    ("auto", 1.5, 1, None, 24, 24),  # one worker: nothing to balance, start-up paid once
    ("auto", 1.5, 4, None, 100, 10),  # several: small first chunks to time frames
    ("auto", 1.5, 4, None, 8, 2),  # ... but never more than a fair share
    ("auto", 1.5, 4, (0.5, 1.0), 1000, 25),  # median start-up 1.25 s / (0.1 x 0.5 s)
    ("auto", 1.5, 4, (0.001, 1.0), 1000, 250),  # trivial frames: the fair share caps it
    ("auto", 1.5, 2, (60.0, 1.0), 100, 1),  # minute-long frames: one per chunk
]


@pytest.mark.parametrize(("size", "startup", "workers", "learned", "remaining", "expected"), SIZER)
def test_chunk_sizer(size, startup, workers, learned, remaining, expected):
    from gpuflow.tasks.render.frames import ChunkSizer

    sizer = ChunkSizer(size, startup, workers)
    if learned:
        sizer.learn(*learned)
    assert sizer.next(remaining) == expected
