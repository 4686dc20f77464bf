"""Maintenance: `preflight` (is this host fit for a job?) and `reap` (what killed runs left)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuflow.commands.common import EXIT_FAILED, EXIT_OK, invalid, load_job_spec, number


def add(commands: Any) -> list[tuple[str, str]]:
    pre = commands.add_parser(
        "preflight", description="Check this host: GPUs, driver, CUDA, torch, disk."
    )
    pre.add_argument("job", nargs="?", help="check for this job spec (default: a 1-GPU torch job)")
    pre.add_argument("--json", action="store_true", help="print the report as JSON")
    pre.set_defaults(handler=lambda args: preflight(args.job, args.json))
    reap_parser = commands.add_parser(
        "reap", description="Tear down what killed runs left on this host."
    )
    reap_parser.add_argument("--dry-run", action="store_true")
    reap_parser.add_argument(
        "--backend",
        default="local",
        help="any registered backend (a wrong name is told the list): local: this host's"
        " leftovers; kubernetes: objects of runs that are over; ec2: instances of runs that"
        " are over; slurm: jobs of runs that are over (SLURM_CONF); fleet: what dead runs left"
        " on the hosts of the fleet --block names",
    )
    reap_parser.add_argument(
        "--namespace", help="kubernetes: the namespace (default: kubeconfig's)"
    )
    reap_parser.add_argument(
        "--block",
        help="ec2: the Ec2GpuFleet block (region, credentials; default: AWS_*); slurm: the"
        " SlurmCluster block (its login node; default: the Slurm client here); fleet: the"
        " GpuFleet",
    )
    reap_parser.set_defaults(
        handler=lambda args: reap(args.dry_run, args.backend, args.namespace, args.block)
    )
    recl = commands.add_parser(
        "reclaim",
        description="Cancel runs whose GPUs stayed idle, from what Prometheus holds of their"
        " live samples (runs tagged gpuflow.io/keep are spared).",
    )
    recl.add_argument("--prometheus", required=True, help="e.g. http://127.0.0.1:9090")
    recl.add_argument(
        "--below-pct", type=number(0, 100, float), default=5.0, help="idle under this %% (5)"
    )
    recl.add_argument("--window", default="15m", help="idle this long: warned (15m)")
    recl.add_argument("--grace", default="10m", help="then this much longer: cancelled (10m)")
    recl.add_argument("--dry-run", action="store_true", help="say what would go; cancel nothing")
    recl.set_defaults(
        handler=lambda args: reclaim(
            args.prometheus, args.below_pct, args.window, args.grace, args.dry_run
        )
    )
    return [
        ("preflight", "check this host: GPUs, driver, CUDA, torch, disk"),
        ("reap", "tear down what killed runs left on this host"),
        ("reclaim", "cancel runs whose GPUs stayed idle (from Prometheus)"),
    ]


def reclaim(prometheus: str, below_pct: float, window: str, grace: str, dry_run: bool) -> int:
    """Print what one reclaim pass found, and what it cancelled (or would)."""
    from gpuflow import session
    from gpuflow.tasks.errors import InvalidSpec, TransientError
    from gpuflow.tasks.platform import reclaim as reclaiming

    try:
        settings = reclaiming.check(prometheus, below_pct, window, grace)
    except InvalidSpec as exc:
        return invalid(exc)

    def one_pass(api: Any) -> int:
        try:
            reclaiming.reclaim_pass(settings, dry_run, lambda line, _loud: print(line))
        except TransientError as exc:
            session.fail(str(exc))
            return EXIT_FAILED
        return EXIT_OK

    return session.with_api(one_pass, temporary=False)


def _in_image(spec: Any) -> Callable[[list[str]], list[str]]:
    """Where preflight asks the job's Python: in its image (pulled and pinned here, as a
    run would: one sentence when it cannot be had), else on this machine."""
    if spec.image is None:
        return list
    from gpuflow.tasks import nvml
    from gpuflow.tasks.backends import imaging
    from gpuflow.tasks.pipeline.checks import check_spec

    spec, _ = check_spec(spec)
    image = imaging.plan(spec)
    assert image is not None
    gpus = [g.index for g in nvml.query().gpus][: spec.resources.gpus]
    return lambda argv: imaging.probe_here(image, "gpuflow-preflight", str(Path.cwd()), gpus, argv)


def preflight(path: str | None, as_json: bool) -> int:
    """Print this host's preflight report for the job at `path` (default: a 1-GPU job)."""
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.kinds.registry import kind_of
    from gpuflow.tasks.pipeline import preflight as checks

    default = {"job": {"kind": "matmul"}, "resources": {"gpus": 1, "allow_cpu": True}}
    try:
        spec = load_job_spec(path) if path else load_job_spec(default)
    except InvalidSpec as exc:
        return invalid(exc)
    from gpuflow.tasks.backends.registry import get_backend

    try:
        backend = get_backend(spec.placement.backend, spec.placement)
    except InvalidSpec as exc:
        return invalid(exc)
    if not backend.capabilities.runs_here:  # the job's machines are elsewhere: say where and how
        try:
            rows = backend.describe(spec)
        except InvalidSpec as exc:
            return invalid(exc)
        for row in rows:
            print(f"[{row['level']:4}] {row['name']}: {row['message']}")
        verdict = "fail" if any(r["level"] == "fail" for r in rows) else "pass"
        print(f"verdict: {verdict}")
        return EXIT_FAILED if verdict == "fail" else EXIT_OK
    kind = kind_of(spec)
    try:
        where = _in_image(spec)
    except InvalidSpec as exc:
        return invalid(exc)
    facts = checks.inspect(
        str(Path.cwd()), kind.uses_torch(spec), python=kind.interpreter(spec), where=where
    )
    count = min(spec.resources.gpus, len(facts.nvml.gpus))
    report = checks.verdict(spec, facts, [g.index for g in facts.nvml.gpus[:count]])
    if as_json:
        print(report.model_dump_json(indent=2))
    else:
        if (python := kind.interpreter(spec)) is not None:
            print(f"[pass] python: the job runs {python}")
        for check in report.checks:
            print(f"[{check.level:4}] {check.name}: {check.message}")
        print(f"verdict: {report.verdict}")
    return EXIT_FAILED if report.verdict == "fail" else EXIT_OK


def reap(
    dry_run: bool, backend: str = "local", namespace: str | None = None, block: str | None = None
) -> int:
    """Tear down clusters, servers and files that killed runs left; say how many."""
    from gpuflow.tasks.backends.registry import backend_class
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.platform.reap import reap as reap_leftovers

    try:
        backend_class(backend, "--backend")  # a wrong name: said before any API starts
    except InvalidSpec as exc:
        return invalid(exc)
    if backend == "local":
        return _said(reap_leftovers(dry_run))
    from gpuflow import session

    return session.with_api(
        lambda api: _said_remote(
            backend, lambda: reap_leftovers(dry_run, print, backend, block, namespace), dry_run
        )
    )


def _said(done: dict) -> int:
    print(
        f"{done['clusters']} leftover cluster(s), {done['servers']} temporary server(s),"
        f" {done['flow_runs_crashed']} flow run(s) marked Crashed, {done['files']}"
        " half-written file(s)"
    )
    return EXIT_OK


def _said_remote(backend: str, reap_it: Any, dry_run: bool) -> int:
    from gpuflow.tasks.errors import InvalidSpec, ProvisionError

    try:
        done = reap_it()
    except InvalidSpec as exc:  # no such block, a key or host key a login node refuses
        return invalid(exc)
    except ProvisionError as exc:  # the cluster did not answer
        print(f"gpuflow: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if "instances" not in done:  # a backend that rents instances says what they cost
        return _said(done)
    verb = "would terminate" if dry_run else "terminated"
    print(
        f"{verb} {done['instances']} instance(s) of {done['runs']} run(s) that are over,"
        f" ${done['hourly_usd']:.2f}/h at on-demand prices, and {done['leftovers']} other"
        " resource(s) they left (security groups, secrets)"
    )
    return EXIT_OK
