"""GPU acceptance check: what gpuflow does on a real GPU, in one table.

Preflight on the real driver; NVML readings (what gpuflow's sampler records) against
nvidia-smi, taken at the same moments under load; matmul TFLOP/s in bf16 and fp32 and the
share of the GPU's peak; 50 training steps of the built-in CNN with AMP (and FSDP on a
GPU), straight and stopped half-way at a checkpoint then resumed from it, compared
bitwise; a Cycles render of 4 frames on the GPU (OptiX, else CUDA) against the CPU; the
MD kernel's GPU/CPU speedup. On a host with no GPU it says so, runs the CPU parts and
exits 0. Uses the Prefect API in PREFECT_API_URL when set, else Prefect's test harness.

    bash scripts/gpu-check.sh [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Dense peak TFLOP/s (bf16 tensor core, fp32 non-tensor) from NVIDIA's data sheets.
PEAKS = {
    "H200": (989.4, 66.9),
    "H100 80GB HBM3": (989.4, 66.9),
    "H100 PCIe": (756.0, 51.2),
    "A100": (312.0, 19.5),
    "L40S": (362.1, 91.6),
    "L4": (121.0, 30.3),
    "A10G": (70.0, 31.2),
}
ROWS: list[tuple[str, str, str]] = []  # (check, result, verdict)


def row(check: str, result: str, verdict: str) -> None:
    ROWS.append((check, result, verdict))
    print(f"[gpu-check] {check}: {result} [{verdict}]", flush=True)


def step(check: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A check that fails is a row with its reason; the next check still runs."""

    def wrap(body: Callable[..., None]) -> Callable[..., None]:
        def guarded(*args: Any) -> None:
            try:
                body(*args)
            except Exception as exc:
                row(check, f"{type(exc).__name__}: {str(exc)[:300]}", "FAIL")

        return guarded

    return wrap


def gpus() -> tuple[list[str], str]:
    """Return the GPU names the driver reports, or [] and why there are none."""
    from gpuflow.tasks import nvml

    status = nvml.query()
    return [gpu.name for gpu in status.gpus], status.reason


def peak(name: str) -> tuple[float, float] | None:
    return next((p for key, p in PEAKS.items() if key in name), None)


@step("preflight")
def check_preflight(on_gpu: bool) -> None:
    argv = [sys.executable, "-m", "gpuflow", "preflight", "--json"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    for check in report["checks"]:
        level = check["level"]
        verdict = "ok" if level == "pass" or (level == "warn" and not on_gpu) else level.upper()
        row(f"preflight {check['name']}", check["message"], verdict)


@step("NVML vs nvidia-smi")
def check_nvml_vs_smi(work: Path) -> None:
    from gpuflow.tasks.metrics.sampler import Sampler

    load = matmul_process("bfloat16", 25)
    pairs: list[tuple[dict[str, Any], list[float]]] = []
    query = "utilization.gpu,memory.used,power.draw"
    smi = ["nvidia-smi", "-i", "0", f"--query-gpu={query}", "--format=csv,noheader,nounits"]

    def beside(sample: dict[str, Any]) -> None:  # nvidia-smi at the moment of each sample
        if sample["gpus"] and len(pairs) < 10:
            out = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout
            pairs.append((sample["gpus"][0], [float(v) for v in out.split(",")]))

    time.sleep(5)  # past the load's warm-up
    with Sampler(work / "samples.jsonl", [0], interval_s=1.0, on_sample=beside):
        deadline = time.monotonic() + 60
        while len(pairs) < 10 and time.monotonic() < deadline:
            time.sleep(0.2)
    load.wait(timeout=120)
    fields = [
        ("utilisation %", "DCGM_FI_DEV_GPU_UTIL", 0, lambda a, b: abs(a - b) <= 2.0),
        ("memory MiB", "DCGM_FI_DEV_FB_USED", 1, lambda a, b: abs(a - b) <= 0.02 * max(b, 1)),
        ("power W", "DCGM_FI_DEV_POWER_USAGE", 2, lambda a, b: abs(a - b) <= 0.02 * max(b, 1)),
    ]
    for label, field, column, close in fields:
        ours = statistics.median(p[0].get(field, float("nan")) for p in pairs)
        theirs = statistics.median(p[1][column] for p in pairs)
        verdict = "ok" if close(ours, theirs) else "FAIL"
        row(f"NVML {label}", f"{ours:.1f} vs nvidia-smi {theirs:.1f} ({len(pairs)} pairs)", verdict)


def matmul_process(dtype: str, seconds: float) -> subprocess.Popen:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-matmul-"))
    argv = [sys.executable, "-m", "gpuflow.tasks.kinds.matmul_run", "--dtype", dtype]
    argv += ["--seconds", str(seconds)]
    env = dict(os.environ, GPUFLOW_OUTPUT_DIR=str(out))
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


@step("matmul")
def check_matmul(names: list[str], seconds: float) -> None:
    for dtype in ("bfloat16", "float32") if names else ("float32",):
        proc = matmul_process(dtype, seconds)
        out, _ = proc.communicate(timeout=600)
        result = json.loads(out.strip().splitlines()[-1])
        text = f"{result['tflops']:.2f} TFLOP/s on {result['device']} ({result['dtype']})"
        known = peak(names[0]) if names else None
        if known:
            top = known[0] if result["dtype"] == "bfloat16" else known[1]
            text += f", {100 * result['tflops'] / top:.0f}% of the {top:g} TFLOP/s peak"
        elif names:
            text += f" (no peak figure for {names[0]})"
        row(f"matmul {dtype}", text, "ok" if result["tflops"] > 0 else "FAIL")


@contextlib.contextmanager
def prefect_api() -> Iterator[None]:
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=240):
        yield


@step("training")
def check_training(names: list[str], work: Path, steps: int) -> None:
    import torch

    from gpuflow.flows.train import train
    from gpuflow.tasks.spec import load_spec
    from gpuflow.tasks.storage import FileStore
    from gpuflow.tasks.training.prepare import prepare

    dataset = f"file://{work}/dataset"
    prepare("synthetic:classify?samples=512", dataset, 200_000, FileStore())
    strategy = "fsdp" if names else "ddp"

    def spec(name: str, max_steps: int) -> Any:
        job = {"kind": "train", "dataset": dataset, "output": f"file://{work}/{name}"}
        job |= {"max_steps": max_steps, "batch_size": 32, "strategy": strategy, "amp": "auto"}
        job |= {"num_workers": 1, "log_every": 1, "schedule": "constant", "cpu_processes": 1}
        job |= {"checkpoint": {"every_steps": 5}}
        resources = {"gpus": 1} if names else {"gpus": 0}
        return load_spec({"name": f"gpu-check-{name}", "job": job, "resources": resources})

    started = time.monotonic()
    straight = train(spec("straight", steps), return_state=True)
    took = time.monotonic() - started
    if not straight.is_completed():
        row("training", f"{steps} steps failed: {straight.message}", "FAIL")
        return
    job = straight.result().metrics.job
    row(
        "training",
        f"{steps} steps on {job['device']} ({strategy}, AMP {job['amp']}):"
        f" {job['samples_per_s']:.0f} samples/s, {took:.1f} s end to end",
        "ok" if not names or job["device"] != "cpu" else "FAIL",
    )
    # Stopped part-way (a run that ends at a checkpoint), then resumed from that checkpoint
    # by a run to the end: deterministic however fast the GPU is.
    half = steps // 10 * 5
    first = train(spec("resumed", half), return_state=True)
    resumed = train(spec("resumed", steps), return_state=True) if first.is_completed() else first
    if not resumed.is_completed():
        row("checkpoint and resume", resumed.message or resumed.name, "FAIL")
        return
    ran = resumed.result().metrics.job["steps_this_attempt"]

    def weights(result: Any) -> dict[str, Any]:
        url = result.metrics.job["weights"]
        return torch.load(io.BytesIO(FileStore().read_bytes(url)), weights_only=True)

    a, b = weights(straight.result()), weights(resumed.result())
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    row(
        "checkpoint and resume",
        f"{half} steps, then {ran} more resumed from the step-{half} checkpoint: weights"
        f" {'bitwise equal' if same else 'DIFFER'} to the straight run's",
        "ok" if same and ran == steps - half else "FAIL",
    )


@step("a job in its image")
def check_image(names: list[str]) -> None:
    """The image path's GPUs (image:): a job in a container of an image sees the GPU it
    was given (CDI with podman and the NVIDIA Container Toolkit, --gpus with docker).
    The image: GPUFLOW_GPU_CHECK_IMAGE, else the first one the engine already has (nothing
    outside this machine is pulled)."""
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks import containers
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.spec import load_spec

    if not names:
        row(
            "a job in its image",
            "no GPU here: the container path is the tests' (fake CDI)",
            "skipped",
        )
        return
    try:
        engine = containers.find_engine()
    except InvalidSpec as exc:
        row("a job in its image", str(exc), "skipped")
        return
    image = os.environ.get("GPUFLOW_GPU_CHECK_IMAGE")
    if not image:
        listed = engine.run("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
        image = next((i for i in listed if "<none>" not in i), None)
    if not image:
        row(
            "a job in its image",
            f"{engine.name} has no image; set GPUFLOW_GPU_CHECK_IMAGE",
            "skipped",
        )
        return
    show = (
        "(nvidia-smi -L 2>/dev/null || ls /dev/nvidia*; echo CUDA=$CUDA_VISIBLE_DEVICES)"
        ' > "$GPUFLOW_OUTPUT_DIR/gpus.txt"'
    )
    spec = load_spec(
        {
            "name": "gpu-check-image",
            "image": {"ref": image, "pull": "never"},
            "job": {"kind": "command", "command": ["sh", "-c", show]},
            "resources": {"gpus": 1},
        }
    )
    state = gpu_pipeline(spec, return_state=True)
    if not state.is_completed():
        row("a job in its image", f"{image} by {engine.name}: {state.message}", "FAIL")
        return
    said = Path(state.result().artifacts_dir, "outputs", "gpus.txt").read_text()
    tail = " | ".join(said.split("\n"))
    seen = "GPU 0:" in tail or "/dev/nvidia0" in tail
    row("a job in its image", f"{image} by {engine.name}: {tail[:240]}", "ok" if seen else "FAIL")


@step("render")
def check_render(names: list[str], work: Path) -> None:
    from gpuflow.flows.render import render
    from gpuflow.tasks.host import resolve_program
    from gpuflow.tasks.render.scene import demo_scene
    from gpuflow.tasks.spec import load_spec

    blender = resolve_program("blender")
    if blender is None:
        row("render", "Blender is not installed (apt-get install blender)", "skipped")
        return
    scene = demo_scene(blender, work / "cube.blend", frames=4, size=128)
    times: dict[str, float] = {}
    for device in ["OPTIX", "CUDA", "CPU"] if names else ["CPU"]:
        job = {"kind": "render", "scene": str(scene), "output": f"file://{work}/frames-{device}"}
        job |= {"device": device, "frames": "1-4"}
        raw = {"name": f"gpu-check-{device.lower()}", "job": job}
        raw["resources"] = {"gpus": 1} if device != "CPU" else {"gpus": 0}
        started = time.monotonic()
        try:
            state = render(load_spec(raw), return_state=True)
        except Exception as exc:  # a device this Blender or driver does not offer
            row(f"render {device}", str(exc)[:200], "skipped")
            continue
        if not state.is_completed():
            row(f"render {device}", state.message or state.name, "FAIL")
            continue
        times[device] = time.monotonic() - started
        row(f"render {device}", f"4 frames in {times[device]:.1f} s", "ok")
    gpu = next((d for d in ("OPTIX", "CUDA") if d in times), None)
    if gpu and "CPU" in times:
        row("render speedup", f"{gpu} {times['CPU'] / times[gpu]:.1f}x the CPU", "ok")


@step("MD")
def check_md(names: list[str], atoms: int, steps: int) -> None:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-md-"))
    settings = {"atoms": atoms, "steps": steps, "thermo_every": steps, "compare_cpu": bool(names)}
    settings["cpu_steps"] = max(5, steps // 4)
    env = dict(os.environ, GPUFLOW_OUTPUT_DIR=str(out))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if not names:
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [sys.executable, "-m", "gpuflow.tasks.hpc.md_run", "--settings", json.dumps(settings)]
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
    result = json.loads((out / "result.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    text = f"{atoms} atoms, {result['atom_steps_per_s']:.3g} atom-steps/s"
    if names and "gpu_vs_cpu_speedup" in result:
        text += f"; GPU/CPU speedup {result['gpu_vs_cpu_speedup']:.1f}x"
        text += " (OpenACC ports of such kernels report about 15x on an A100)"
    row("MD", text, "ok")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (the CPU path in CI)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    os.environ.setdefault("GPUFLOW_HOME", str(work / "home"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    started = time.monotonic()
    names, why = gpus()
    if names:
        row("GPUs", f"{len(names)} x {names[0]}", "ok")
    else:
        row("GPUs", f"no GPU here ({why}): the GPU checks are skipped, the CPU parts run", "ok")
    check_preflight(bool(names))
    if names and shutil.which("nvidia-smi"):
        check_nvml_vs_smi(work)
    elif names:
        row("NVML vs nvidia-smi", "nvidia-smi is not installed", "skipped")
    check_matmul(names, 3.0 if args.quick else 10.0)
    with prefect_api():
        check_training(names, work, 20 if args.quick and not names else 50)
        check_render(names, work)
        check_image(names)
    check_md(names, 2000 if args.quick else 32000, 20 if args.quick else 200)
    shutil.rmtree(work, ignore_errors=True)
    width = max(len(check) for check, _, _ in ROWS)
    print(f"\n{'check':{width}}  {'verdict':8}  result")
    for check, result, verdict in ROWS:
        print(f"{check:{width}}  {verdict:8}  {result}")
    failed = [check for check, _, verdict in ROWS if verdict == "FAIL"]
    print(f"\n{len(ROWS) - len(failed)} of {len(ROWS)} rows ok or skipped in", end=" ")
    print(
        f"{time.monotonic() - started:.0f} s; {'failed: ' + ', '.join(failed) if failed else 'no failure'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
