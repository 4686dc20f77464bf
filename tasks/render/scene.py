"""The scene: fetched from storage once (cached), read by Blender once (cached), and the
render plan that follows from it. Everything here runs before anything is provisioned.

A scene is a .blend, or a folder or .zip holding the .blend and its assets with their
relative paths. Local paths are used where they are; URLs are fetched into
$GPUFLOW_HOME/cache/scenes/<key>/, keyed by URL and content, so a rerun fetches nothing.

A job in an image that renders on this host reads its scene with the image's Blender (a
container of the pinned image, the scene mounted read-only), so this host needs no Blender.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import BaseModel

from gpuflow.tasks import containers, nvml
from gpuflow.tasks.errors import InvalidSpec, TransientError
from gpuflow.tasks.fetching import fetch_prefix, relative_names
from gpuflow.tasks.host import gpuflow_home, resolve_program
from gpuflow.tasks.render import logparse
from gpuflow.tasks.render.argv import ENGINES, EXTENSIONS, FORMATS, MOVIE_FORMATS, safe_path
from gpuflow.tasks.render.frames import label, outside, parse_frames
from gpuflow.tasks.render.model import RenderJob
from gpuflow.tasks.spec import JobSpec, job_as
from gpuflow.tasks.storage import ObjectMissing, S3Settings, StorageError, store_for

INSPECT_SCRIPT = Path(__file__).with_name("blender_inspect.py")
DEMO_SCRIPT = Path(__file__).with_name("blender_demo_scene.py")
INSPECT_TIMEOUT_S = 600.0


class Reference(BaseModel):
    kind: str
    name: str
    path: str
    exists: bool


class SceneInfo(BaseModel):
    """What Blender says about the scene (see blender_inspect.py)."""

    blender: str
    scene: str
    frame_start: int
    frame_end: int
    frame_step: int = 1
    fps: float = 24.0
    engine: str
    camera: str | None
    resolution: list[int]
    file_format: str
    output: str = ""
    samples: int | None = None
    denoise: bool | None = None
    denoiser_built: bool = True
    references: list[Reference] = []
    devices: dict[str, list[str]] = {}
    load_s: float = 0.0  # Blender's start-up and scene load, measured


class InImage(BaseModel):
    """The pinned image whose Blender reads the scene here (a job in an image)."""

    ref: str  # name@digest
    user: str  # image.user
    gpus: list[int] = []  # this host's GPUs the container gets (Blender lists their devices)


class RenderPlan(BaseModel):
    """The scene on disk, what Blender said about it, and what will be rendered."""

    blend: str
    root: str = ""  # the scene as fetched: the .blend, or the folder that holds it
    info: SceneInfo
    frames: list[int]
    file_format: str
    extension: str
    engine: str
    device: str | None = None  # the Cycles device to ask for; None keeps the scene's
    warnings: list[str] = []


def cache_root() -> Path:

    return gpuflow_home() / "cache" / "scenes"


# -- fetching ----------------------------------------------------------------------------
def fetch(scene: str, s3: S3Settings | None) -> Path:
    """Return a local path for `scene` (file, folder or .zip): local paths as they are,
    URLs fetched into the cache unless the cached copy has the same content."""
    if "://" not in scene:
        path = Path(scene).expanduser().absolute()
        if not path.exists():
            raise InvalidSpec(f"job.scene: {path} does not exist; check the path.")
        return _unzipped(path) if path.suffix.lower() == ".zip" else path
    if scene.startswith("file://"):
        return fetch(urlparse(scene).path, s3)
    store = store_for(scene, s3)
    key = hashlib.sha256(scene.encode()).hexdigest()[:16]
    target = cache_root() / key
    try:
        single = store.exists(scene)
        if single:  # one object: a .blend or a .zip
            objects = [(scene, Path(urlparse(scene).path).name)]
        else:
            listed = store.list(scene)
            if not listed:
                raise ObjectMissing(f"{scene} does not exist")
            objects = relative_names(scene, listed)
        signature = json.dumps(sorted((name, store.checksum(url)) for url, name in objects))
    except ObjectMissing:
        raise InvalidSpec(
            f"job.scene: {scene} does not exist; upload the scene there or fix the URL."
        ) from None
    except StorageError as exc:
        raise InvalidSpec(f"job.scene: {exc}") from None
    stamp = target / ".gpuflow-fetched.json"
    files = target / "files"
    if not (stamp.is_file() and stamp.read_text() == signature):
        shutil.rmtree(target, ignore_errors=True)
        files.mkdir(parents=True)
        fetch_prefix(store, scene, files, objects)
        stamp.write_text(signature)
    path = files / objects[0][1] if single else files
    return _unzipped(path) if path.suffix.lower() == ".zip" else path


def _unzipped(archive: Path) -> Path:
    stat = archive.stat()
    key = hashlib.sha256(f"{archive}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / f"zip-{key}"
    if (target / ".gpuflow-unzipped").is_file():
        return target / "files"
    shutil.rmtree(target, ignore_errors=True)
    try:
        with zipfile.ZipFile(archive) as bundle:
            for member in bundle.namelist():
                resolved = (target / "files" / member).resolve()
                if not resolved.is_relative_to((target / "files").resolve()):
                    raise InvalidSpec(
                        f"job.scene: {archive.name} holds {member!r}, which points outside the"
                        " archive; rebuild the .zip with relative paths."
                    )
            bundle.extractall(target / "files")
    except zipfile.BadZipFile:
        raise InvalidSpec(
            f"job.scene: {archive.name} is not a readable .zip; upload it again."
        ) from None
    (target / ".gpuflow-unzipped").write_text("ok")
    return target / "files"


def find_blend(path: Path, blend: str | None) -> Path:
    """Return the .blend to render: `path` itself, or the one `blend` names in a folder."""
    if path.is_file():
        if blend:
            raise InvalidSpec(
                "job.blend: the scene is a single file, so there is nothing to choose;"
                " remove job.blend."
            )
        return path
    folder = path.resolve()
    if blend:
        chosen = (path / blend).resolve()  # `..`, an absolute path and links, followed
        if not chosen.is_relative_to(folder):
            raise InvalidSpec(
                f"job.blend: {blend} leads outside the scene folder; name a .blend inside it"
                " by its path relative to the folder."
            )
        if not chosen.is_file():
            raise InvalidSpec(f"job.blend: there is no {blend} in the scene folder; fix the name.")
        return chosen
    candidates = sorted(
        p for p in path.rglob("*.blend") if p.is_file() and p.resolve().is_relative_to(folder)
    )
    top = [p for p in candidates if p.parent == path]
    if len(candidates) == 1 or len(top) == 1:
        return (top or candidates)[0]
    if not candidates:
        raise InvalidSpec(f"job.scene: {path.name} holds no .blend file; upload the scene.")
    names = ", ".join(str(p.relative_to(path)) for p in candidates[:5])
    raise InvalidSpec(f"job.blend: the scene holds several .blend files ({names}); name one.")


# -- asking Blender ----------------------------------------------------------------------
def inspect(
    blender: str, blend: Path, devices: list[str], image: InImage | None = None, root: str = ""
) -> SceneInfo:
    """Return what Blender says about `blend`; InvalidSpec when it cannot read it.
    Cached by the file's size and time and the Blender program (the image's, in `image`,
    with the scene's `root` mounted)."""
    stat = blend.stat()
    where = image.ref if image else ""
    key = hashlib.sha256(
        f"{blend}:{stat.st_size}:{stat.st_mtime_ns}:{blender}:{sorted(devices)}:{where}".encode()
    ).hexdigest()[:16]
    cached = cache_root() / "inspected" / f"{key}.json"
    if cached.is_file():
        return SceneInfo.model_validate_json(cached.read_text())
    argv = [blender, "-b", safe_path(str(blend)), "--python", str(INSPECT_SCRIPT), "--", *devices]
    started = time.monotonic()
    engine, label, environ = None, "", None
    if image is not None:
        engine, label = containers.find_engine(), f"gpuflow-inspect-{os.getpid()}-{time.time_ns()}"
        reads = [root or str(blend), str(INSPECT_SCRIPT)]
        argv = _in_image(engine, image, label, argv, reads, blend.parent)
        environ = containers.engine_environ()
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=INSPECT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            cwd=blend.parent,
            env=environ,
        )
    except subprocess.TimeoutExpired:
        raise TransientError(
            f"Blender took over {INSPECT_TIMEOUT_S:.0f} s to open {blend.name}; retry, or check the scene."
        ) from None
    finally:
        if engine is not None:
            containers.remove(engine, label)  # one that outlived its client
    load_s = time.monotonic() - started
    output = done.stdout + done.stderr
    for line in output.splitlines():
        if line.startswith("GPUFLOW-SCENE "):
            info = SceneInfo.model_validate(
                {**json.loads(line.removeprefix("GPUFLOW-SCENE ")), "load_s": load_s}
            )
            if all(r.exists for r in info.references):  # else recheck: they may be uploaded
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(info.model_dump_json())
            return info
    if not re.search(r"^Blender \d", output, re.MULTILINE):  # no banner: not Blender at all
        said = " | ".join(output.splitlines()[-3:]) or "nothing"
        raise InvalidSpec(
            f"job.blender: {blender} did not start as Blender (exit {done.returncode}, it"
            f" printed: {said[:300]}); give the Blender program (--blender)."
        )
    failure = logparse.classify(
        logparse.parse(output), done.returncode if done.returncode >= 0 else None
    )
    reason = failure.message if failure else "it printed: " + " | ".join(output.splitlines()[-3:])
    raise InvalidSpec(f"job.scene: Blender could not open {blend.name}: {reason}.")


def _in_image(
    engine: containers.Engine,
    image: InImage,
    label: str,
    argv: list[str],
    reads: list[str],
    workdir: Path,
) -> list[str]:
    """The engine command that runs `argv` once in the image, what it reads mounted
    read-only at its own path, with the image's GPUs, as the run's units run."""
    described = containers.inspect(engine, image.ref)
    if described is None:
        raise InvalidSpec(
            f"image: {image.ref!r} is no longer in {engine.name}'s store here; run again to pull it."
        )
    args = containers.RunArgs(
        name=label,
        cluster=label,
        image=containers.pinned_from(image.ref, described).image_id or image.ref,
        command=argv,
        env_names=[],
        env_values={},
        mounts=[],
        read_only=list(dict.fromkeys(reads)),
        workdir=str(workdir),
        user=containers.user_of(image.user),
        gpus=image.gpus,
    )
    return containers.run_argv(engine, args)


def in_image(spec: JobSpec, here: bool) -> InImage | None:
    """The image whose Blender works here for `spec` (None: this host's Blender)."""
    if not here or spec.image is None:
        return None
    gpus = list(range(len(nvml.query().gpus))) if spec.resources.gpus else []
    return InImage(ref=spec.image.pinned, user=spec.image.user, gpus=gpus)


def program_of(spec: JobSpec, here: bool) -> str:
    """The Blender that renders: job.blender in the image (looked up there when it was
    pinned), else this host's."""
    job = job_as(spec, RenderJob)
    return job.blender if in_image(spec, here) else blender_program(job)


def blender_program(job: RenderJob) -> str:

    program = resolve_program(job.blender)
    if program is None:
        raise InvalidSpec(
            f"job.blender: {job.blender!r} was not found; install Blender"
            " (Debian: apt-get install blender) or give its full path."
        )
    return program


# -- the plan ----------------------------------------------------------------------------
_PLANS: dict[tuple[str, str, bool], RenderPlan] = {}  # (flow run id, spec) -> plan, this process


def plan(spec: JobSpec, s3: S3Settings | None, here: bool) -> RenderPlan:
    """Return what will be rendered, after every check that needs the scene; InvalidSpec
    (one sentence naming the field and the fix) for anything that would fail later. With
    `here`, chunks render on this host (its GPUs are the job's); else on other nodes.
    Worked out once per flow run (validation, preflight and the render stage all ask)."""
    from prefect.runtime import flow_run

    run_id = flow_run.id
    key = (str(run_id), spec.model_dump_json(), here)
    if run_id and key in _PLANS:
        return _PLANS[key]
    found = _plan(spec, s3, here)
    if run_id:
        if len(_PLANS) >= 32:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = found
    return found


def _plan(spec: JobSpec, s3: S3Settings | None, here: bool) -> RenderPlan:
    job = job_as(spec, RenderJob)
    program = program_of(spec, here)
    root = fetch(job.scene, s3)
    blend = find_blend(root, job.blend)
    # in pods, the GPUs are not this host's: Blender here reads the scene, not the devices
    host_gpus = here and bool(spec.resources.gpus) and bool(nvml.query().gpus)
    gpu_devices = ["OPTIX", "CUDA", "HIP", "ONEAPI"] if host_gpus else []
    wanted = [job.device] if here and job.device and job.device != "CPU" else gpu_devices
    info = inspect(program, blend, wanted, in_image(spec, here), str(root))
    warnings: list[str] = []
    if info.camera is None:
        raise InvalidSpec(
            f"job.scene: the scene {info.scene!r} has no active camera; set one in the .blend"
            " (Scene properties > Camera) and upload it again."
        )
    frames = _frames(job, info, warnings)
    _missing_files(job, info, warnings)
    engine = _engine(job, info)
    if job.device and job.device != "CPU":
        if here and not info.devices.get(job.device):  # a pod's Blender is judged by its log
            raise InvalidSpec(
                f"job.device: Blender sees no {job.device} device on this host; run on a host"
                f" with one, choose another device, or set job.device: CPU."
            )
        if engine != "CYCLES":
            warnings.append(f"job.device {job.device} applies to Cycles only; {engine} ignores it.")
    device = job.device
    if device is None and not here and spec.resources.gpus and engine == "CYCLES":
        device = "CUDA"  # pods get NVIDIA GPUs (nvidia.com/gpu); OPTIX when job.device says
    if device is None and host_gpus and engine == "CYCLES":
        # Blender's command line renders Cycles on the CPU unless told otherwise.
        device = next((d for d in gpu_devices if info.devices.get(d)), None)
        if device is None:
            warnings.append(
                f"this Blender ({info.blender}) sees no GPU device for Cycles; rendering on the CPU."
            )
    denoise = job.denoise if job.denoise is not None else info.denoise
    if engine == "CYCLES" and denoise and not info.denoiser_built:
        raise InvalidSpec(
            f"job.denoise: this Blender ({info.blender}) was built without OpenImageDenoise but"
            " the scene denoises; set job.denoise: false or use a Blender build that has it."
        )
    file_format = FORMATS[job.file_format] if job.file_format else info.file_format
    if file_format in MOVIE_FORMATS or file_format not in EXTENSIONS:
        raise InvalidSpec(
            f"job.file_format: the scene writes {file_format}, not one image per frame;"
            " set job.file_format: PNG (or OPEN_EXR, JPEG, TIFF)."
        )
    return RenderPlan(
        blend=str(blend),
        root=str(root),
        info=info,
        frames=frames,
        file_format=file_format,
        extension=EXTENSIONS[file_format],
        engine=engine,
        device=device,
        warnings=warnings,
    )


def _frames(job: RenderJob, info: SceneInfo, warnings: list[str]) -> list[int]:
    """Return the frames to render: job.frames, else the scene's range; InvalidSpec for
    none, or for frames outside the scene's range unless the job allows them (a warning)."""
    scene_range = f"{info.frame_start}-{info.frame_end}"
    frames = (
        parse_frames(job.frames)
        if job.frames
        else list(range(info.frame_start, info.frame_end + 1, max(1, info.frame_step)))
    )
    if not frames:
        raise InvalidSpec(
            f"job.frames: the scene's range {scene_range} holds no frames; give job.frames."
        )
    stray = outside(frames, info.frame_start, info.frame_end)
    if stray:
        text = f"frames {label(stray)} are outside the scene's range {scene_range}"
        if job.frames_outside_scene == "fail":
            raise InvalidSpec(
                f"job.frames: {text}; render frames inside it, or set"
                " job.frames_outside_scene: warn to render them anyway."
            )
        warnings.append(f"{text}; rendering them as job.frames_outside_scene: warn allows.")
    return frames


def _missing_files(job: RenderJob, info: SceneInfo, warnings: list[str]) -> None:
    """Raise InvalidSpec for files the scene refers to that are not there, unless the job
    allows them (a warning)."""
    missing = [r for r in info.references if not r.exists]
    if not missing:
        return
    listed = "; ".join(f"{r.kind} {r.name!r} at {r.path}" for r in missing[:10])
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    text = f"the scene refers to files that are not there: {listed}{more}"
    if job.missing_files == "fail":
        raise InvalidSpec(
            f"job.scene: {text}; upload them with the scene (a folder or .zip keeping"
            " their relative paths), or set job.missing_files: warn."
        )
    warnings.append(f"{text}; they will render as magenta or be left out.")


def _engine(job: RenderJob, info: SceneInfo) -> str:

    engine = ENGINES[job.engine] if job.engine else info.engine
    return {
        "BLENDER_EEVEE": "EEVEE",
        "BLENDER_EEVEE_NEXT": "EEVEE",
        "BLENDER_WORKBENCH": "WORKBENCH",
    }.get(engine, engine)


def preflight_checks(spec: JobSpec, s3: S3Settings | None, here: bool) -> list[dict[str, str]]:
    """Return preflight findings for a render: Blender's version and its Cycles devices
    (from the cached inspection), each as {name, level, message}."""
    job = job_as(spec, RenderJob)
    found = plan(spec, s3, here)
    devices = ", ".join(
        f"{kind}: {', '.join(names) or 'none'}" for kind, names in found.info.devices.items()
    )
    where = "" if here else f" (here it reads the scene; {job.blender} in the pods renders)"
    checks = [
        {
            "name": "blender",
            "level": "pass",
            "message": f"Blender {found.info.blender} at {program_of(spec, here)}{where};"
            f" {found.engine} on {found.device or 'the CPU'}"
            + (f"; Cycles devices seen: {devices}." if devices else "."),
        }
    ]
    wants_gpu = found.device and found.device != "CPU"
    if here and wants_gpu and not found.info.devices.get(found.device or ""):
        checks.append(
            {
                "name": "cycles-device",
                "level": "fail",
                "message": f"Blender sees no {found.device} device here; run on a host with one"
                " or set job.device: CPU.",
            }
        )
    checks += [{"name": "scene", "level": "warn", "message": w} for w in found.warnings]
    return checks


def demo_scene(
    blender: str, path: Path, frames: int = 24, size: int = 64, expr: str | None = None
) -> Path:
    """Save the demo scene (a turning, moving cube; Cycles, PNG) at `path`, then apply
    `expr` (bpy code, e.g. to change samples or engine) to it. For demos, tests, benches."""
    run: dict[str, Any] = {
        "check": True,
        "capture_output": True,
        "timeout": 300,
        "stdin": subprocess.DEVNULL,
    }
    subprocess.run(
        [blender, "-b", "--python", str(DEMO_SCRIPT), "--", str(path), str(frames), str(size)],
        **run,
    )
    if expr:
        script = f"import bpy\n{expr}\nbpy.ops.wm.save_mainfile()\n"
        subprocess.run([blender, "-b", str(path), "--python-expr", script], **run)
    return path
