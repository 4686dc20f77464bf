"""The `gpuflow` command.

Exit codes: 0 the job completed; 1 the job (or its preflight) failed; 2 invalid input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuflow import session

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
SMOKE_JOB = Path(__file__).resolve().parent / "smoke.yaml"


def _run(path: str | dict) -> int:
    """Run a job spec (a path or a dict) through its flow; read and check it first, before
    any API is started when the checks need none."""
    from tasks import placement
    from tasks.errors import InvalidSpec
    from tasks.spec import load_spec

    try:
        spec = load_spec(path)
        checked = not placement.needs_api(spec)
        if checked:
            spec = _checked(spec)
    except InvalidSpec as exc:
        return _invalid(exc)
    return session.with_api(lambda api: _run_spec(spec, api, checked))


def _checked(spec):
    """Return the spec with its placement applied, once every check before provisioning
    passed (InvalidSpec otherwise)."""
    from tasks import placement, secrets
    from tasks.compute import get_backend
    from tasks.jobs import check_job

    spec, _ = placement.resolve(spec)
    get_backend(spec.placement.backend).check(spec)
    check_job(spec)
    secrets.resolve(spec.secret_env)
    return spec


def _invalid(exc: Exception) -> int:
    print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
    return EXIT_INVALID


def _run_spec(spec, api, checked: bool) -> int:
    from tasks.errors import GpuflowError, InvalidSpec

    try:
        spec = spec if checked else _checked(spec)
    except InvalidSpec as exc:
        return _invalid(exc)
    from flows.pipeline import gpu_pipeline

    flow = gpu_pipeline
    if spec.job.kind == "render":
        from flows.render import render as flow
    if spec.job.kind == "hpc":
        from flows.hpc import hpc as flow
    state = flow(spec, return_state=True)
    link = api.run_link(str(state.state_details.flow_run_id))
    if state.is_completed():
        _print_summary(state.result())
        if link:
            print(f"  flow run: {link}")
        return EXIT_OK
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, InvalidSpec):
        return _invalid(exc)
    if state.is_cancelled():
        print(f"gpuflow: cancelled: {state.message}", file=sys.stderr)
    else:
        reason = str(exc) if isinstance(exc, GpuflowError) else (state.message or state.name)
        print(f"gpuflow: {state.name.lower()}: {reason}", file=sys.stderr)
    if link:
        print(f"gpuflow: flow run: {link}", file=sys.stderr)
    return EXIT_FAILED


def _print_summary(result) -> None:
    metrics = result.metrics
    print(f"\n{result.name}: completed (preflight {result.preflight})")
    job = metrics.job
    if "world_size" in job:
        speed = job.get("images_per_s") or job.get("tokens_per_s")
        unit = "images/s" if "images_per_s" in job else "tokens/s"
        print(
            f"  trained {job['steps']} steps on {job['world_size']} rank(s) ({job['device']}): {job['samples_per_s']} samples/s, {speed} {unit}"
        )
        if "eval_loss" in job:
            accuracy = job.get("eval_accuracy")
            top1 = f", top-1 accuracy {100 * accuracy:.1f}%" if accuracy is not None else ""
            print(f"  eval at step {job['eval_step']}: loss {job['eval_loss']:.4f}{top1}")
        print(f"  weights: {job['weights']}")
    if "frames_rendered" in job:
        print(
            f"  rendered {job['frames_rendered']} frames ({job['frames_skipped']} already in"
            f" storage) in {job['chunks']} chunk(s), {job['frames_per_s']} frames/s -> {job['output']}"
        )
    if "atom_steps_per_s" in job:
        print(
            f"  md: {job['atoms']} atoms x {job['steps']} steps on {job['ranks']} rank(s)"
            f" ({job['device']}): {job['atom_steps_per_s']:.4g} atom-steps/s,"
            f" {job['ns_per_day']:.4g} ns/day (argon), energy drift"
            f" {job['energy_drift_per_atom']:.2e} per atom"
        )
        if "gpu_vs_cpu_speedup" in job:
            print(f"  GPU vs CPU: {job['gpu_vs_cpu_speedup']:.1f}x on {job['gpu_name']}")
    if "tflops" in metrics.job:
        print(
            f"  matmul: {metrics.job['tflops']} TFLOP/s on {metrics.job['device']} ({metrics.job['dtype']})"
        )
    print(
        f"  duration {metrics.duration_s:.1f} s, {metrics.samples} samples, cost ${metrics.cost_usd:.4f}"
    )
    if metrics.note:
        print(f"  note: {metrics.note}")
    print(f"  artifacts: {result.artifacts_dir}")


def _preflight(path: str | None, as_json: bool) -> int:
    from tasks import preflight
    from tasks.errors import InvalidSpec
    from tasks.spec import load_spec

    try:
        spec = (
            load_spec(path)
            if path
            else load_spec({"job": {"kind": "matmul"}, "resources": {"gpus": 1, "allow_cpu": True}})
        )
    except InvalidSpec as exc:
        print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    facts = preflight.inspect(str(Path.cwd()), spec.job.torch)
    count = min(spec.resources.gpus, len(facts.nvml.gpus))
    report = preflight.verdict(spec, facts, [g.index for g in facts.nvml.gpus[:count]])
    if as_json:
        print(report.model_dump_json(indent=2))
    else:
        for check in report.checks:
            print(f"[{check.level:4}] {check.name}: {check.message}")
        print(f"verdict: {report.verdict}")
    return EXIT_FAILED if report.verdict == "fail" else EXIT_OK


def _prepare(source: str, output: str, shard_size: str, aws_credentials: str | None) -> int:
    from tasks.errors import InvalidSpec
    from tasks.storage import S3Settings, StorageError, check_writable
    from tasks.training.prepare import check_request

    try:
        check_request(source, output, shard_size)
    except InvalidSpec as exc:
        return _invalid(exc)

    def body(api) -> int:
        from flows.datasets import prepare_dataset

        try:
            settings = S3Settings.from_block(aws_credentials) if aws_credentials else None
            check_writable(output, settings, "output")
        except (InvalidSpec, StorageError) as exc:
            return _invalid(exc)
        state = prepare_dataset(source, output, shard_size, aws_credentials, return_state=True)
        if state.is_completed():
            result = state.result()
            print(
                f"{result.samples} samples in {result.shards} shards ({result.written} written,"
                f" {result.skipped} unchanged)"
            )
            print(f"index: {result.index_url}")
            link = api.run_link(str(state.state_details.flow_run_id))
            if link:
                print(f"flow run: {link}")
            return EXIT_OK
        exc = state.result(raise_on_failure=False)
        if isinstance(exc, InvalidSpec):
            return _invalid(exc)
        print(f"gpuflow: {state.name.lower()}: {exc}", file=sys.stderr)
        return EXIT_FAILED

    return session.with_api(body)


def _render_spec(args: argparse.Namespace) -> dict:
    """Return the job spec the `render` options describe."""
    scene = args.scene
    if "://" not in scene:
        scene = str(Path(scene).expanduser().absolute())
    job: dict = {"kind": "render", "scene": scene, "output": args.out, "chunk": args.chunk}
    if args.allow_missing_files:
        job["missing_files"] = "warn"
    options = ("frames", "engine", "device", "samples", "resolution_percentage", "file_format")
    return _spec_from(args, job, (*options, "max_workers", "blender", "pattern"))


def _spec_from(args: argparse.Namespace, job: dict, options: tuple[str, ...]) -> dict:
    """Return a job spec: `job` plus the `options` given on the command line, with the
    name, GPUs (CPU allowed) and S3 credentials block every job command takes."""
    job = job | {o: getattr(args, o) for o in options if getattr(args, o) is not None}
    spec: dict = {
        "name": args.name,
        "job": job,
        "resources": {"gpus": args.gpus, "allow_cpu": True},
    }
    if args.aws_credentials:
        spec["storage"] = {"aws_credentials": args.aws_credentials}
    return spec


def _hpc_spec(args: argparse.Namespace) -> dict:
    """Return the job spec the `hpc` options describe: the program after --, else MD."""
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    job: dict = {"kind": "hpc", "ranks": args.ranks, "gpus_per_rank": args.gpus_per_rank}
    if program:
        job["program"] = program
    else:
        md = {"atoms": args.atoms, "steps": args.steps}
        md |= {
            k: getattr(args, k) for k in ("density", "temperature") if getattr(args, k) is not None
        }
        job["md"] = md
    if args.oversubscribe:
        job["oversubscribe"] = True
    return _spec_from(args, job, ("build", "output", "slots", "mpirun", "inputs"))


def _mpijob(spec: dict, image: str) -> int:
    """Print the MPIJob manifest for `spec` as YAML; exit 2 when it has no MPIJob shape."""
    import uuid

    import yaml

    from tasks.errors import InvalidSpec
    from tasks.hpc.mpijob import MpiJobError, build
    from tasks.spec import load_spec

    try:
        manifest = build(load_spec(spec), image, str(uuid.uuid4()))
    except (InvalidSpec, MpiJobError) as exc:
        print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print(yaml.safe_dump(manifest, sort_keys=False), end="")
    return EXIT_OK


def _hpc_demo() -> int:
    """Run the MD workload on up to two ranks of this machine through the hpc flow."""
    import os

    from tasks import nvml

    gpus = len(nvml.query().gpus)
    ranks = min(2, gpus) if gpus else min(2, os.cpu_count() or 1)
    where = f"{ranks} GPU(s)" if gpus else "the CPU (no GPU seen)"
    print(
        f"molecular dynamics: 2048 Lennard-Jones atoms, 500 steps, {ranks} MPI rank(s) on {where}"
    )
    job = {"kind": "hpc", "ranks": ranks, "md": {"atoms": 2048, "steps": 500}}
    if gpus:
        job["gpus_per_rank"] = 1
    return _run({"name": "hpc-demo", "job": job, "resources": {"gpus": ranks if gpus else 0}})


def _render_demo() -> int:
    """Build a small animated scene with Blender and render it to $GPUFLOW_HOME/renders."""
    from tasks.compute.local import gpuflow_home, resolve_program

    blender = resolve_program("blender")
    if blender is None:
        print(
            "gpuflow: the render demo needs Blender; install it (apt-get install blender) or"
            " run `bash scripts/demo.sh render`.",
            file=sys.stderr,
        )
        return EXIT_INVALID
    from tasks.render.scene import demo_scene

    home = gpuflow_home()
    scene = home / "demo" / "turning-cube.blend"
    if not scene.is_file():
        demo_scene(blender, scene, 24, 96)
    out = f"file://{home / 'renders' / 'demo'}"
    print(f"rendering {scene} (24 frames) to {out}")
    return _run(
        {
            "name": "render-demo",
            "job": {"kind": "render", "scene": str(scene), "output": out, "frames": "1-24"},
            "resources": {"gpus": 1, "allow_cpu": True},
        }
    )


def _blocks_init() -> int:
    """Register gpuflow's block types and create the default documents that are missing."""
    from tasks.platform.blocks_setup import init_blocks

    def body(api) -> int:
        for slug, name, what in init_blocks():
            print(f"{what:>10}  {slug}{'/' + name if name else ''}")
        return EXIT_OK

    return session.with_api(body)


def _platform(action: str, port: int) -> int:
    """Bring the local platform up or down, or say whether it runs."""
    from tasks.platform import local

    if action == "down":
        local.down()
        return EXIT_OK
    if action == "status":
        from tasks.platform.api import health_error

        state = local.read_state()
        if state is None:
            print("not running (`gpuflow platform up` starts it)")
            return EXIT_FAILED
        for name, entry in state["processes"].items():
            print(f"{name}: pid {entry['pid']} {'running' if local.running(entry) else 'gone'}")
        problem = health_error(state["api"], timeout_s=5)
        running = problem is None and all(local.running(p) for p in state["processes"].values())
        print(
            f"running: UI {state['ui']}"
            if running
            else f"not healthy: {problem or 'a process is gone'}"
        )
        return EXIT_OK if running else EXIT_FAILED
    from tasks.errors import GpuflowError, InvalidSpec

    try:
        local.up(port)
    except InvalidSpec as exc:
        print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except GpuflowError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _deploy() -> int:
    """Check prefect.yaml (pools, entrypoints, parameters, triggers, job variables), then
    run `prefect deploy --all` against PREFECT_API_URL."""
    from tasks.errors import InvalidSpec
    from tasks.platform import deploy

    root = Path.cwd() if (Path.cwd() / "prefect.yaml").is_file() else deploy_root()
    try:
        names = deploy.check_project(
            deploy.load_project(root / "prefect.yaml"), root, deploy.pool_templates()
        )
    except InvalidSpec as exc:
        print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID

    def body(api) -> int:
        done = deploy.prefect_deploy(root)
        print(done.stdout[-3000:], end="")
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return EXIT_FAILED
        print(f"deployed {len(names)}: {', '.join(names)}")
        return EXIT_OK

    return session.with_api(body, temporary=False)


def deploy_root() -> Path:
    return Path(__file__).resolve().parent.parent


def _submit(name: str, pairs: list[str], wait: bool, timeout_s: float) -> int:
    from tasks.errors import InvalidSpec
    from tasks.platform.submit import EXIT_INVALID as INVALID
    from tasks.platform.submit import parse_params, submit

    try:
        params = parse_params(pairs)
    except InvalidSpec as exc:
        print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
        return INVALID
    return session.with_api(lambda api: submit(name, params, wait, timeout_s), temporary=False)


def _reap(dry_run: bool) -> int:
    from tasks.platform.reap import reap

    done = reap(dry_run)
    print(
        f"{done['clusters']} leftover cluster(s), {done['servers']} temporary server(s),"
        f" {done['flow_runs_crashed']} flow run(s) marked Crashed, {done['files']}"
        " half-written file(s)"
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpuflow",
        description="Run GPU work as a Prefect pipeline: provision, preflight, run, collect, teardown.",
        epilog="Exit codes: 0 completed; 1 the job or its preflight failed; 2 invalid input.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run JOB.yaml through the pipeline")
    run.add_argument("job", help="path of a job spec (YAML or JSON)")
    demo = commands.add_parser("demo", help="run a demo job on this machine")
    demo.add_argument(
        "which",
        nargs="?",
        choices=["matmul", "render", "hpc"],
        default="matmul",
        help="matmul: the GPU smoke job (TFLOP/s); render: a small Blender animation;"
        " hpc: molecular dynamics on two MPI ranks",
    )
    rend = commands.add_parser("render", help="render a Blender scene's frames to storage")
    rend.add_argument("scene", help="a .blend, folder or .zip: a local path, file:/// or s3:// URL")
    rend.add_argument("--frames", help="e.g. 1-240, 1,5,9 or 1-240x10 (default: the scene's)")
    rend.add_argument("--out", required=True, help="file:///path or s3://bucket/prefix")
    rend.add_argument("--engine", help="CYCLES, EEVEE or WORKBENCH (default: the scene's)")
    rend.add_argument("--device", help="Cycles device: CPU, CUDA, OPTIX, HIP, ONEAPI")
    rend.add_argument("--samples", type=int)
    rend.add_argument("--resolution-percentage", type=int)
    rend.add_argument("--format", dest="file_format", help="PNG, OPEN_EXR, JPEG, TIFF, ...")
    rend.add_argument("--chunk", default="auto", help="frames per Blender process, or auto")
    rend.add_argument("--workers", dest="max_workers", type=int, help="chunks at once")
    rend.add_argument("--gpus", type=int, default=1, help="GPUs to use when there are any")
    rend.add_argument("--pattern", help="frame file name, e.g. shot1/frame_####")
    rend.add_argument("--blender", help="the Blender program (default: blender on PATH)")
    rend.add_argument("--name", default="render")
    rend.add_argument("--aws-credentials", help="name of a prefect-aws AwsCredentials block")
    rend.add_argument(
        "--allow-missing-files",
        action="store_true",
        help="render although the scene refers to files that are not there",
    )
    hpc = commands.add_parser(
        "hpc",
        help="run an MPI program across ranks (default: the built-in molecular dynamics)",
        epilog="Give your program after --, e.g. gpuflow hpc --ranks 4 --build make -- ./sim",
    )
    hpc.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS (default: MD)")
    hpc.add_argument("--ranks", type=int, default=1, help="MPI processes (mpirun -np)")
    hpc.add_argument("--gpus-per-rank", type=int, default=0)
    hpc.add_argument("--gpus", type=int, default=0, help="GPUs to reserve on this host")
    hpc.add_argument("--slots", type=int, help="ranks this host takes (default: its cores)")
    hpc.add_argument("--oversubscribe", action="store_true", help="allow more ranks than slots")
    hpc.add_argument("--build", help="build step run in the workspace first, e.g. 'make -j4'")
    hpc.add_argument("--input", dest="inputs", action="append", help="file:/// or s3:// URL")
    hpc.add_argument("--out", dest="output", help="prefix the outputs folder is uploaded to")
    hpc.add_argument("--mpirun", help="the mpirun program (default: mpirun on PATH)")
    hpc.add_argument("--atoms", type=int, default=4000, help="MD: atoms")
    hpc.add_argument("--steps", type=int, default=1000, help="MD: time steps")
    hpc.add_argument("--density", type=float, help="MD: reduced density (default 0.8442)")
    hpc.add_argument("--temperature", type=float, help="MD: reduced temperature (default 0.72)")
    hpc.add_argument("--name", default="hpc")
    hpc.add_argument(
        "--mpijob",
        metavar="IMAGE",
        help="print the Kubeflow MPIJob (v2beta1) for this job, run by IMAGE, instead of running",
    )
    hpc.add_argument("--aws-credentials", help="name of a prefect-aws AwsCredentials block")
    pre = commands.add_parser("preflight", help="check this host: GPUs, driver, CUDA, torch, disk")
    pre.add_argument("job", nargs="?", help="check for this job spec (default: a 1-GPU torch job)")
    pre.add_argument("--json", action="store_true", help="print the report as JSON")
    prep = commands.add_parser(
        "prepare-dataset", help="pack files into webdataset shards in storage"
    )
    prep.add_argument(
        "source", help="a folder of files grouped by basename, or synthetic:classify?samples=N"
    )
    prep.add_argument("output", help="file:///path or s3://bucket/prefix")
    prep.add_argument("--shard-size", default="256MB")
    prep.add_argument("--aws-credentials", help="name of a prefect-aws AwsCredentials block")
    blk = commands.add_parser("blocks", help="register gpuflow's block types and default blocks")
    blk.add_argument(
        "action", choices=["init"], help="init: register types, create what is missing"
    )
    plat = commands.add_parser(
        "platform", help="a local Prefect server, pools, blocks, deployments and a worker"
    )
    plat.add_argument("action", choices=["up", "down", "status"])
    plat.add_argument("--port", type=int, default=4200, help="server port on 127.0.0.1")
    commands.add_parser("deploy", help="check prefect.yaml, then `prefect deploy --all`")
    sub = commands.add_parser(
        "submit",
        help="run a deployment from CI",
        epilog="Exit codes: 0 completed; 1 failed, crashed or cancelled; 2 invalid input;"
        " 3 still running when --timeout passed.",
    )
    sub.add_argument("deployment", help="flow-name/deployment-name")
    sub.add_argument(
        "--param", action="append", default=[], help="name=value (JSON, or @file.yaml)"
    )
    sub.add_argument("--wait", action="store_true", help="follow the run until it ends")
    sub.add_argument("--timeout", type=float, default=3600, help="seconds to wait (with --wait)")
    reap = commands.add_parser("reap", help="tear down what killed runs left on this host")
    reap.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    return session.interruptible(lambda: _dispatch(args))


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command `args` names; return its exit code."""
    if args.command == "run":
        return _run(args.job)
    if args.command == "demo":
        if args.which == "hpc":
            return _hpc_demo()
        return _render_demo() if args.which == "render" else _run(str(SMOKE_JOB))
    if args.command == "hpc":
        return _mpijob(_hpc_spec(args), args.mpijob) if args.mpijob else _run(_hpc_spec(args))
    if args.command == "render":
        return _run(_render_spec(args))
    if args.command == "preflight":
        return _preflight(args.job, args.json)
    if args.command == "prepare-dataset":
        return _prepare(args.source, args.output, args.shard_size, args.aws_credentials)
    if args.command == "blocks":
        return _blocks_init()
    if args.command == "platform":
        return _platform(args.action, args.port)
    if args.command == "deploy":
        return _deploy()
    if args.command == "submit":
        return _submit(args.deployment, args.param, args.wait, args.timeout)
    return _reap(args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
