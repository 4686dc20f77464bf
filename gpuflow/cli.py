"""The `gpuflow` command.

Exit codes: 0 the job completed; 1 the job (or its preflight) failed; 2 invalid input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
SMOKE_JOB = Path(__file__).resolve().parent / "smoke.yaml"


def _run(path: str) -> int:
    from tasks import placement
    from tasks.compute import get_backend
    from tasks.errors import GpuflowError, InvalidSpec
    from tasks.spec import load_spec

    try:
        spec, _ = placement.resolve(load_spec(path))
        get_backend(spec.placement.backend).check(spec)
        from tasks.jobs import check_job

        check_job(spec)
        from tasks import secrets

        secrets.resolve(spec.secret_env)
    except InvalidSpec as exc:
        print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:  # reading blocks or limits failed: the API is unreachable
        return _api_failed(exc)

    from flows.pipeline import gpu_pipeline

    try:
        state = gpu_pipeline(spec, return_state=True)
    except Exception as exc:  # the engine itself failed: most often the API is unreachable
        return _api_failed(exc)
    if state.is_completed():
        result = state.result()
        _print_summary(result)
        return EXIT_OK
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, InvalidSpec):
        print(f"gpuflow: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if state.is_cancelled():
        print(f"gpuflow: cancelled: {state.message}", file=sys.stderr)
        return EXIT_FAILED
    reason = str(exc) if isinstance(exc, GpuflowError) else (state.message or state.name)
    print(f"gpuflow: {state.name.lower()}: {reason}", file=sys.stderr)
    return EXIT_FAILED


def _api_failed(exc: Exception) -> int:
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value() or "the ephemeral API"
    print(
        f"gpuflow: could not run the pipeline against {api} ({type(exc).__name__});"
        " start that Prefect server or unset PREFECT_API_URL.",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _print_summary(result) -> None:
    metrics = result.metrics
    print(f"\n{result.name}: completed (preflight {result.preflight})")
    job = metrics.job
    if "steps" in job:
        speed = job.get("images_per_s") or job.get("tokens_per_s")
        unit = "images/s" if "images_per_s" in job else "tokens/s"
        print(
            f"  trained {job['steps']} steps on {job['world_size']} rank(s) ({job['device']}): {job['samples_per_s']} samples/s, {speed} {unit}"
        )
        print(f"  weights: {job['weights']}")
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
    from flows.datasets import prepare_dataset
    from tasks.errors import InvalidSpec

    state = prepare_dataset(source, output, shard_size, aws_credentials, return_state=True)
    if state.is_completed():
        result = state.result()
        print(
            f"{result.samples} samples in {result.shards} shards ({result.written} written, {result.skipped} unchanged)"
        )
        print(f"index: {result.index_url}")
        return EXIT_OK
    exc = state.result(raise_on_failure=False)
    print(
        f"gpuflow: {'invalid input: ' if isinstance(exc, InvalidSpec) else ''}{exc}",
        file=sys.stderr,
    )
    return EXIT_INVALID if isinstance(exc, InvalidSpec) else EXIT_FAILED


def _reap(dry_run: bool) -> int:
    import psutil

    from tasks.compute.local import LocalBackend

    backend = LocalBackend()
    reaped = 0
    for cluster in backend.list_owned({"gpuflow.io/owner": "gpuflow"}):
        record = backend._read_record(cluster.name) or {}
        pid = record.get("orchestrator_pid")
        if pid and psutil.pid_exists(pid):
            continue  # its run is still going
        print(f"{'would reap' if dry_run else 'reaping'} {cluster.name} ({cluster.workspace})")
        if not dry_run:
            print(json.dumps(backend.teardown(cluster).model_dump()))
        reaped += 1
    print(f"{reaped} leftover cluster(s)")
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
    commands.add_parser("demo", help="run the GPU smoke job (matmul TFLOP/s) on this machine")
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
    reap = commands.add_parser("reap", help="tear down what killed runs left on this host")
    reap.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args.job)
    if args.command == "demo":
        return _run(str(SMOKE_JOB))
    if args.command == "preflight":
        return _preflight(args.job, args.json)
    if args.command == "prepare-dataset":
        return _prepare(args.source, args.output, args.shard_size, args.aws_credentials)
    return _reap(args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
