"""Render job specs: every bad input is one sentence naming the field and the fix."""

from __future__ import annotations

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.spec import load_spec


def spec(**job):
    return {
        "job": {"kind": "render", "scene": "/scenes/shot.blend", "output": "file:///out", **job}
    }


def test_a_good_render_spec():
    job = load_spec(spec(frames="1-240x10", engine="cycles", device="optix", chunk="8")).job
    assert (job.engine, job.device, job.chunk, job.file_format) == ("CYCLES", "OPTIX", 8, None)
    assert load_spec(spec()).job.chunk == "auto"


BAD = [
    ({"frames": ""}, "job.frames: the frame spec is empty"),
    ({"frames": "10-1"}, "job.frames: '10-1' runs backwards; write 1-10"),
    ({"frames": "abc"}, "job.frames: 'abc' is not a frame"),
    ({"frames": "1-10x0"}, "job.frames: '1-10x0' has step 0"),
    ({"chunk": 0}, "job.chunk: 0 is not a chunk size; give a whole number of frames of at least 1"),
    ({"chunk": "big"}, "job.chunk: 'big' is not a chunk size"),
    ({"engine": "octane"}, "job.engine: 'octane' is not known; use one of CYCLES"),
    ({"engine": "cycle"}, "did you mean CYCLES?"),
    ({"device": "gpu"}, "job.device: 'gpu' is not known; name the kind of GPU (CUDA or OPTIX"),
    ({"device": "optics"}, "job.device: 'optics' is not known; use one of CPU, CUDA, OPTIX"),
    ({"file_format": "gif"}, "job.file_format: 'gif' is not known"),
    ({"scene": ""}, "job.scene: is empty; give the .blend as a local path"),
    ({"scene": "s3://bucket"}, "names no object; write s3://bucket/path/scene.blend"),
    ({"scene": "http://host/x.blend"}, "is not a path or storage URL"),
    ({"output": "/out"}, "job.output: '/out' is not a storage URL"),
    (
        {"pattern": "../escape_####"},
        "job.pattern: '../escape_####' is not a file name under job.output",
    ),
    ({"max_workers": 0}, "job.max_workers must be at least 1"),
    ({"framez": "1-3"}, "job.framez: unknown field; did you mean 'frames'?"),
]


@pytest.mark.parametrize(("job", "expected"), BAD, ids=[str(b[0]) for b in BAD])
def test_bad_render_inputs(job, expected):
    with pytest.raises(InvalidSpec) as caught:
        load_spec(spec(**job))
    assert expected in str(caught.value)


def test_missing_scene_and_output():
    with pytest.raises(InvalidSpec, match=r"job.scene is required.*job.output is required"):
        load_spec({"job": {"kind": "render"}})


def test_job_blend_can_not_leave_the_scene_folder(tmp_path):
    from gpuflow.tasks.render.scene import find_blend

    scene = tmp_path / "scene"
    (scene / "sub").mkdir(parents=True)
    (scene / "sub" / "shot.blend").write_bytes(b"BLENDER")
    outside = tmp_path / "other" / "outside.blend"
    outside.parent.mkdir()
    outside.write_bytes(b"BLENDER")
    (scene / "linked.blend").symlink_to(outside)
    for blend in ("../other/outside.blend", str(outside), "linked.blend"):
        with pytest.raises(InvalidSpec, match="leads outside the scene folder"):
            find_blend(scene, blend)
    assert find_blend(scene, "sub/shot.blend") == (scene / "sub" / "shot.blend").resolve()
    assert find_blend(scene, None) == scene / "sub" / "shot.blend"  # the link is not a candidate


def test_a_relative_workspace_root_is_recorded_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_spec(
        {"job": {"kind": "command", "command": ["true"]}, "placement": {"workspace_root": "ws"}}
    )
    assert spec.placement.workspace_root == str(tmp_path / "ws")
