"""Renders with the real Blender: chunks, per-frame upload, resume after a kill, the
failures Blender exits 0 on, scene problems found before anything starts, odd paths."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.render.images import check_image
from gpuflow.tasks.spec import load_spec
from tests.conftest import subprocess_env
from tests.e2e.helpers import artifacts_of, logs_of, nothing_left, task_runs_of

pytestmark = pytest.mark.e2e
BLENDER = shutil.which("blender")
if BLENDER is None:
    if os.environ.get("CI"):
        raise RuntimeError("blender is not installed; the test command installs it")
    pytest.skip("blender is not installed (scripts/test.sh installs it)", allow_module_level=True)


def make_scene(path: Path, frames: int = 6, size: int = 32, expr: str | None = None) -> Path:
    """Save the demo scene (a moving cube) at `path`, then apply `expr` (bpy code) to it."""
    from gpuflow.tasks.render.scene import demo_scene

    return demo_scene(BLENDER, path, frames, size, expr)


@pytest.fixture(scope="session")
def scene(tmp_path_factory) -> Path:
    return make_scene(tmp_path_factory.mktemp("scenes") / "cube.blend")


def render_spec(scene: Path | str, out: str, **job) -> dict:
    return {
        "name": "render-test",
        "job": {"kind": "render", "scene": str(scene), "output": out, **job},
        "resources": {"gpus": 1, "allow_cpu": True},
        "metrics": {"plot": False},
    }


def run_render(spec: dict):
    from gpuflow.flows.render import render

    return render(spec, return_state=True)


def frames_in(folder: Path) -> dict[str, int]:
    """Return the frame files under `folder` with their modification times (ns)."""
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("*.png"))}


def wrapper(tmp_path: Path, body: str) -> Path:
    """Write an executable stand-in for blender: `body` is Python that may change `argv`
    before the real Blender runs (inspection calls pass through untouched); every render
    call is logged to calls.jsonl next to it."""
    path = tmp_path / "blender-wrapper"
    path.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            f"""
            import json, os, sys
            argv = ["{BLENDER}", *sys.argv[1:]]
            if "--python" in argv:  # gpuflow inspecting the scene
                os.execv(argv[0], argv)
            with open("{tmp_path / "calls.jsonl"}", "a") as log:
                log.write(json.dumps(argv) + "\\n")
            """
        )
        + textwrap.dedent(body)
        + "\nos.execv(argv[0], argv)\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def frames_asked(argv: list[str]) -> str:
    return argv[argv.index("-f") + 1]


def test_renders_frames_in_chunks_then_a_rerun_renders_nothing(
    prefect_api, scene, tmp_path, gpuflow_home
):
    out = tmp_path / "out"
    state = run_render(render_spec(scene, f"file://{out}", frames="1-6", chunk=3))
    assert state.is_completed(), state.message
    result = state.result()
    names = frames_in(out)
    assert list(names) == [f"frame_{i:04d}.png" for i in range(1, 7)]
    for name in names:
        assert check_image(out / name, "PNG") is None
        with Image.open(out / name) as image:
            assert image.size == (32, 32)
    job = result.metrics.job
    assert (job["chunks"], job["blender_invocations"], job["frames_rendered"]) == (2, 2, 6)
    outputs = Path(result.artifacts_dir) / "outputs"
    assert (outputs / "contact-sheet.png").is_file()
    with Image.open(outputs / "contact-sheet.png") as sheet:
        assert sheet.width > 6 * 32
    if shutil.which("ffmpeg"):
        assert (outputs / "preview.mp4").stat().st_size > 0
    timings = json.loads((outputs / "frames.json").read_text())
    assert [t["frame"] for t in timings] == [1, 2, 3, 4, 5, 6]
    assert all(t["seconds"] is not None and t["chunk"] in (0, 1) for t in timings)
    artifacts = artifacts_of(result.flow_run_id)
    assert artifacts["gpuflow-render-progress"].data == 100.0
    assert len(artifacts["gpuflow-render-frames"].data) > 0
    assert "6 rendered, 0 already in storage" in artifacts["gpuflow-summary"].data
    chunk_runs = [t for t in task_runs_of(result.flow_run_id) if t.name.startswith("render-chunk")]
    assert len(chunk_runs) == 2
    assert nothing_left(gpuflow_home)

    again = run_render(render_spec(scene, f"file://{out}", frames="1-6", chunk=3))
    assert again.is_completed(), again.message
    job = again.result().metrics.job
    assert (job["frames_skipped"], job["frames_rendered"], job["blender_invocations"]) == (6, 0, 0)
    assert frames_in(out) == names  # nothing rewritten


def test_a_killed_render_resumes_with_only_the_missing_frames(prefect_api, tmp_path, gpuflow_home):
    slow = make_scene(
        tmp_path / "slow.blend", frames=10, size=96, expr="bpy.context.scene.cycles.samples = 64"
    )
    blender = wrapper(tmp_path, "")
    out = tmp_path / "out"
    env = subprocess_env(prefect_api, gpuflow_home)
    env["TMPDIR"] = str(tmp_path / "tmp")  # this host's temporary folder, as gpuflow sees it
    (tmp_path / "tmp").mkdir()
    args = [sys.executable, "-m", "gpuflow", "render", str(slow), "--out", f"file://{out}"]
    args += ["--frames", "1-10", "--chunk", "10", "--blender", str(blender)]
    first = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while len(frames_in(out)) < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, first.stdout.read().decode()[-2000:]
    os.killpg(first.pid, signal.SIGKILL)  # the orchestrator dies; Blender runs on alone
    first.wait()
    reaped = subprocess.run(
        [sys.executable, "-m", "gpuflow", "reap"], env=env, capture_output=True, text=True
    )
    assert "reaping" in reaped.stdout, reaped.stdout + reaped.stderr
    kept = frames_in(out)
    assert 2 <= len(kept) < 10
    done = {int(name[6:10]) for name in kept}

    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"rendered {10 - len(kept)} frames ({len(kept)} already in storage)" in second.stdout
    render_calls = calls(tmp_path)
    assert frames_asked(render_calls[0]) == "1..10"
    from gpuflow.tasks.render.frames import parse_frames

    again = set().union(
        *(parse_frames(frames_asked(c).replace("..", "-")) for c in render_calls[1:])
    )
    assert again == set(range(1, 11)) - done  # only what was missing
    final = frames_in(out)
    assert len(final) == 10 and all(final[name] == kept[name] for name in kept)
    assert all(check_image(out / name, "PNG") is None for name in final)
    assert nothing_left(gpuflow_home)
    # the killed Blender's temporary folder went with the chunk's workspace
    assert not list((tmp_path / "tmp").glob("blender_*"))


def test_a_crashed_chunk_is_retried_without_redoing_its_saved_frames(
    prefect_api, tmp_path, gpuflow_home
):
    slow = make_scene(
        tmp_path / "slow.blend", frames=6, size=96, expr="bpy.context.scene.cycles.samples = 64"
    )
    blender = wrapper(tmp_path, "")
    out = tmp_path / "out"
    killed: list[int] = []

    def kill_blender_once() -> None:
        records = gpuflow_home / "local" / "clusters"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if len(frames_in(out)) >= 2:
                for record in records.glob("*.json"):
                    for pgid in json.loads(record.read_text()).get("jobs", {}):
                        os.killpg(int(pgid), signal.SIGKILL)
                        killed.append(int(pgid))
                        return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_blender_once, daemon=True)
    watcher.start()
    state = run_render(
        render_spec(slow, f"file://{out}", frames="1-6", chunk=6, blender=str(blender))
    )
    watcher.join(timeout=5)
    assert killed and state.is_completed(), state.message
    result = state.result()
    chunk = next(t for t in task_runs_of(result.flow_run_id) if t.name.startswith("render-chunk"))
    assert chunk.run_count == 2  # crashed (signal 9, retryable), then retried
    first, retry = calls(tmp_path)
    assert frames_asked(first) == "1..6"
    assert not frames_asked(retry).startswith("1..6")
    assert len(frames_in(out)) == 6
    assert any("killed by signal 9" in line for line in logs_of(result.flow_run_id))


FAKE_SAVE = """
frame = int(argv[argv.index("-f") + 1].split("..")[0].split(",")[0])
pattern = argv[argv.index("-o") + 1]
path = pattern.replace("####", f"{frame:04d}") + ".png"
os.makedirs(os.path.dirname(path), exist_ok=True)
open(path, "wb").write(b"not an image")
print("Blender 3.4.1")
print(f"Fra:{frame} Mem:9.17M (Peak 10.87M) | Time:00:00.00 | Mem:0.00M, Peak:0.00M | Scene | Finished")
print(f"Saved: '{path}'")
print(" Time: 00:00.10 (Saving: 00:00.00)")
sys.exit(0)
"""
EXIT_ZERO = {
    "frames Blender cannot read": (
        'argv[argv.index("-f") + 1] = "1-3"',
        "Blender did not understand the frames 1-3",
    ),
    "unknown device": (
        'argv += ["--", "--cycles-device", "BOGUS"]',
        "BOGUS is not a Cycles device",
    ),
    "settings script raises": (
        'argv[argv.index("--python-expr") + 1] = "raise RuntimeError(\'boom\')"',
        "the settings script failed (RuntimeError: boom)",
    ),
    "a frame that is not an image": (FAKE_SAVE, "frame 1 is not a PNG image"),
    "no frame written": (
        'print("Blender 3.4.1"); sys.exit(0)',
        "Blender exited 0 without writing them",
    ),
}


@pytest.mark.parametrize("case", sorted(EXIT_ZERO))
def test_failures_blender_exits_zero_on_are_caught(
    prefect_api, scene, tmp_path, gpuflow_home, case
):
    body, sentence = EXIT_ZERO[case]
    blender = wrapper(tmp_path, body)
    spec = render_spec(scene, f"file://{tmp_path / 'out'}", frames="1-2", blender=str(blender))
    state = run_render(spec)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert sentence in message and "chunk 0" in message, message
    assert len(calls(tmp_path)) == 1  # not transient: not retried
    assert nothing_left(gpuflow_home)


def check(spec: dict) -> str:
    """Return the one sentence validation gives `spec`, checking nothing was provisioned."""
    from gpuflow.tasks.pipeline.checks import check_job

    with pytest.raises(InvalidSpec) as caught:
        check_job(load_spec(spec))
    return str(caught.value)


def test_scene_problems_are_named_before_anything_starts(scene, tmp_path, gpuflow_home):
    out = f"file://{tmp_path / 'out'}"
    garbage = tmp_path / "garbage.blend"
    garbage.write_bytes(b"definitely not a blend file\n" * 100)
    truncated = tmp_path / "truncated.blend"
    truncated.write_bytes(scene.read_bytes()[: scene.stat().st_size // 2])
    cases = {
        tmp_path / "missing.blend": "job.scene: "
        + str(tmp_path / "missing.blend")
        + " does not exist",
        garbage: "garbage.blend is not a .blend file; upload the scene itself",
        truncated: "truncated.blend is damaged (Missing DNA block); upload it again",
    }
    for path, sentence in cases.items():
        assert sentence in check(render_spec(path, out))
    assert "frames 7-9 are outside the scene's range 1-6" in check(
        render_spec(scene, out, frames="5-9")
    )
    assert "job.frames_outside_scene: warn" in check(render_spec(scene, out, frames="5-9"))
    from gpuflow.tasks.render.scene import plan

    warned = plan(
        load_spec(render_spec(scene, out, frames="5-9", frames_outside_scene="warn")),
        None,
        here=True,
    )
    assert warned.frames == [5, 6, 7, 8, 9]
    assert "frames 7-9 are outside the scene's range 1-6; rendering them" in warned.warnings[0]
    assert "Blender sees no OPTIX device on this host" in check(
        render_spec(scene, out, device="OPTIX")
    )
    assert "built without OpenImageDenoise" in check(render_spec(scene, out, denoise=True))
    assert "'no-blender' was not found; install Blender" in check(
        render_spec(scene, out, blender="no-blender")
    )
    assert "job.output: cannot write to file:///proc/out" in check(
        render_spec(scene, "file:///proc/out")
    )
    assert not (gpuflow_home / "workspaces").exists()


def test_scene_without_camera_or_with_missing_textures(tmp_path):
    out = f"file://{tmp_path / 'out'}"
    no_camera = make_scene(
        tmp_path / "nocam.blend", expr="bpy.data.objects.remove(bpy.data.objects['Camera'])"
    )
    assert "has no active camera; set one in the .blend" in check(render_spec(no_camera, out))
    texture = """
image = bpy.data.images.new('brick', 4, 4)
image.filepath = '//textures/brick.png'
image.source = 'FILE'
material = bpy.data.materials['demo']
node = material.node_tree.nodes.new('ShaderNodeTexImage')
node.image = image
"""
    textured = make_scene(tmp_path / "textured.blend", expr=texture)
    sentence = check(render_spec(textured, out))
    assert (
        "refers to files that are not there: image 'brick' at "
        + str(tmp_path / "textures" / "brick.png")
        in sentence
    )
    assert "or set job.missing_files: warn" in sentence
    from gpuflow.tasks.pipeline.checks import check_job
    from gpuflow.tasks.render.scene import plan

    allowed = load_spec(render_spec(textured, out, missing_files="warn"))
    check_job(allowed)
    assert "will render as magenta" in plan(allowed, None, here=True).warnings[0]
    (tmp_path / "textures").mkdir()
    Image.new("RGB", (4, 4), "red").save(tmp_path / "textures" / "brick.png")
    check_job(load_spec(render_spec(textured, out)))  # uploaded: now it passes


def test_odd_paths_render(prefect_api, scene, tmp_path, gpuflow_home):
    folder = tmp_path / "my scènes 'quoted' \"double\""
    folder.mkdir()
    odd = folder / "-leading dash ünï.blend"
    shutil.copyfile(scene, odd)
    out = tmp_path / "out put ü"
    state = run_render(render_spec(odd, f"file://{out}", frames="2,4", pattern="shot 1/-f_###"))
    assert state.is_completed(), state.message
    assert sorted(p.name for p in (out / "shot 1").iterdir()) == ["-f_002.png", "-f_004.png"]


def test_a_zipped_scene_from_s3_renders_to_s3_and_skips_on_rerun(
    prefect_api, s3_server, aws_block, tmp_path, gpuflow_home
):
    texture = """
image = bpy.data.images.load(bpy.path.abspath('//textures/brick.png'))
image.filepath = '//textures/brick.png'
material = bpy.data.materials['demo']
node = material.node_tree.nodes.new('ShaderNodeTexImage')
node.image = image
"""
    work = tmp_path / "shot"
    (work / "textures").mkdir(parents=True)
    Image.new("RGB", (8, 8), "red").save(work / "textures" / "brick.png")
    make_scene(work / "shot.blend", expr=texture)
    bundle = tmp_path / "shot.zip"
    with zipfile.ZipFile(bundle, "w") as archive:
        archive.write(work / "shot.blend", "shot.blend")
        archive.write(work / "textures" / "brick.png", "textures/brick.png")
    shutil.rmtree(work)
    from gpuflow.tasks.storage import store_for

    store = store_for(s3_server.url("scenes/shot.zip"), s3_server.settings())
    store.upload_file(s3_server.url("scenes/shot.zip"), bundle)
    spec = render_spec(
        s3_server.url("scenes/shot.zip"), s3_server.url("renders/shot"), frames="1-3"
    )
    spec["storage"] = {"aws_credentials": aws_block}
    state = run_render(spec)
    assert state.is_completed(), state.message
    listed = sorted(o.url for o in store.list(s3_server.url("renders/shot")))
    assert listed == [s3_server.url(f"renders/shot/frame_{i:04d}.png") for i in (1, 2, 3)]
    again = run_render(spec)
    assert again.result().metrics.job["frames_skipped"] == 3
    secret = s3_server.settings().secret_access_key.get_secret_value()
    assert not any(secret in line for line in logs_of(again.result().flow_run_id))


def test_overrides_engine_format_and_resolution(prefect_api, scene, tmp_path, gpuflow_home):
    out = tmp_path / "out"
    spec = render_spec(
        scene,
        f"file://{out}",
        frames="1,3",
        engine="WORKBENCH",  # prints no Fra: lines; frames are known by their file names
        file_format="OPEN_EXR",
        resolution_percentage=50,
        samples=2,
        pattern="still",
    )
    state = run_render(spec)
    assert state.is_completed(), state.message
    names = sorted(p.name for p in out.iterdir())
    assert names == ["still_0001.exr", "still_0003.exr"]
    logs = logs_of(state.result().flow_run_id)
    assert any("'still' had no # frame placeholder; using 'still_####'" in line for line in logs)
    assert all(check_image(out / name, "OPEN_EXR") is None for name in names)
    assert state.result().metrics.job["engine"] == "WORKBENCH"


@pytest.mark.parametrize("file_format", ["OPEN_EXR", "OPEN_EXR_MULTILAYER", "HDR", "DPX"])
def test_every_still_format_gets_a_contact_sheet(
    file_format, prefect_api, scene, tmp_path, gpuflow_home
):
    """Formats Pillow cannot read: the sheet shows each frame (EXR and HDR tone-mapped),
    with the cube's shading, not an empty or single-colour tile."""
    import numpy as np

    state = run_render(
        render_spec(scene, f"file://{tmp_path / 'out'}", frames="1-2", file_format=file_format)
    )
    assert state.is_completed(), state.message
    sheet = Path(state.result().artifacts_dir) / "outputs" / "contact-sheet.png"
    assert sheet.is_file(), f"no contact sheet for {file_format}"
    with Image.open(sheet) as image:
        pixels = np.asarray(image.convert("L"), dtype=np.float32)
    tiles = pixels[30:62, 8:40]  # the first thumbnail (32 x 32) below the title
    assert tiles.std() > 5.0  # a picture, not a blank tile


def test_render_command_rejects_bad_input_with_exit_2(prefect_api, scene, tmp_path, gpuflow_home):
    env = subprocess_env(prefect_api, gpuflow_home)
    args = [sys.executable, "-m", "gpuflow", "render", str(scene), "--out", f"file://{tmp_path}"]
    for extra, sentence in (
        (["--frames", "10-1"], "job.frames: '10-1' runs backwards; write 1-10"),
        (["--chunk", "0"], "job.chunk: 0 is not a chunk size"),
        (["--engine", "octane"], "job.engine: 'octane' is not known"),
        (["--frames", "1-99"], "frames 7-99 are outside the scene's range 1-6"),
        (["--blender", "/bin/false"], "job.blender: /bin/false did not start as Blender (exit 1"),
    ):
        done = subprocess.run([*args, *extra], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-1000:]
        assert sentence in done.stderr and "Traceback" not in done.stderr
    assert nothing_left(gpuflow_home)


def pod_chunk(tmp_path: Path, s3_server, *, stdout=subprocess.PIPE, **chunk) -> subprocess.Popen:
    """The chunk program as a pod runs it: its own GPUFLOW_HOME, unbuffered output (as the job
    image sets), storage access from AWS_* variables only (as the run's Secret gives them)."""
    root = Path(__file__).resolve().parents[2]
    body = {
        "output": s3_server.url("pod-renders", tmp_path.name),
        "pattern": "frame_####",
        "extension": ".png",
        "file_format": "PNG",
        "index": 0,
        "blender": BLENDER,
        "settings": {"device": "CPU"},
        **chunk,
    }
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "GPUFLOW_HOME": str(tmp_path / "pod-home"),
        "PYTHONUNBUFFERED": "1",
        **s3_server.settings().child_env(),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "gpuflow.tasks.render.pod_chunk", "--chunk-json", json.dumps(body)],
        cwd=root,
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_pod_chunk_program_says_in_one_line_when_its_scene_is_gone(s3_server, tmp_path):
    """The scene was removed from storage after the run checked it: the pod's program
    exits 2 with one sentence naming the field and the URL, no traceback, nothing uploaded."""
    from gpuflow.tasks.storage import store_for

    missing = s3_server.url("pod-scenes", "gone.blend")
    proc = pod_chunk(tmp_path, s3_server, scene=missing, frames=[1, 2])
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert stderr.strip() == (
        f"gpuflow: chunk 0: job.scene: {missing} does not exist; upload the scene there or"
        " fix the URL."
    )
    assert stdout == ""
    store = store_for(missing, s3_server.settings())
    assert store.list(s3_server.url("pod-renders", tmp_path.name)) == []


def test_a_stopped_pod_chunk_keeps_the_frames_blender_saved(s3_server, tmp_path):
    """SIGTERM (the pod stopped) after the first frame is in storage: Blender is stopped,
    every frame it saved is uploaded and reported, each report matching the object."""
    from gpuflow.tasks.render.output import FrameRecord
    from gpuflow.tasks.render.pod_chunk import record_of
    from gpuflow.tasks.storage import store_for

    blend = make_scene(tmp_path / "long.blend", frames=400, size=96)
    scene = s3_server.url("pod-scenes", f"{tmp_path.name}.blend")
    store = store_for(scene, s3_server.settings())
    store.upload_file(scene, blend)
    proc = pod_chunk(tmp_path, s3_server, scene=scene, frames=list(range(1, 401)))
    assert proc.stdout is not None
    records: list[FrameRecord] = []
    for line in proc.stdout:
        said = record_of(line.rstrip("\n"))
        if isinstance(said, FrameRecord):
            records.append(said)
            if len(records) == 1:
                proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert 1 <= len(records) < 400
    stored = {o.url: o for o in store.list(s3_server.url("pod-renders", tmp_path.name))}
    assert sorted(stored) == sorted(r.url for r in records)
    for record in records:
        assert record.size == stored[record.url].size
        assert record.sha256 == store.checksum(record.url)


def test_a_pod_chunk_s_lines_stay_whole_beside_another_writer_of_its_log(s3_server, tmp_path):
    """In a pod the node's sampler writes to the same log as the chunk program: every line
    either of them writes stays whole, so each frame is counted (a frame line cut by a
    sample was a frame lost)."""
    from gpuflow.tasks.render.output import FRAME_MARK, FrameRecord
    from gpuflow.tasks.render.pod_chunk import record_of
    from gpuflow.tasks.storage import store_for

    blend = make_scene(tmp_path / "short.blend", frames=40, size=8)
    scene = s3_server.url("pod-scenes", f"{tmp_path.name}.blend")
    store_for(scene, s3_server.settings()).upload_file(scene, blend)
    sample = b'@@gpuflow-sample {"t": 1.0, "host": {"cpu_percent": 99.0}, "gpus": []}\n'
    noisy = f"import os, time\nwhile True:\n    os.write(1, {sample!r})\n    time.sleep(1e-4)"
    read_end, write_end = os.pipe()
    noise = subprocess.Popen([sys.executable, "-c", noisy], stdout=write_end)
    samples, kept = 0, []  # the samples are counted, not kept

    def read() -> None:
        nonlocal samples
        for line in os.fdopen(read_end, errors="replace"):
            if line == sample.decode():
                samples += 1
            else:
                kept.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        frames = list(range(1, 41))
        proc = pod_chunk(tmp_path, s3_server, stdout=write_end, scene=scene, frames=frames)
        os.close(write_end)
        assert proc.wait(timeout=240) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        noise.kill()
        noise.wait()
    reader.join(timeout=60)
    assert samples > 100 and len(kept) > 40
    assert [line for line in kept if "@@gpuflow-sample" in line] == []  # none cut another
    records = [record_of(line.rstrip("\n")) for line in kept if line.startswith(FRAME_MARK)]
    assert sorted(r.frame for r in records if isinstance(r, FrameRecord)) == frames
