"""`gpuflow service update SPEC`: a new version of a running service (docs/services.md):
its replicas are replaced one at a time, each drained after its successor is ready, and
the service rolls back if the new version's replica never becomes ready."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from gpuflow.commands.common import EXIT_FAILED, EXIT_INVALID, EXIT_OK, invalid, load_job_spec


def add(commands: Any) -> list[tuple[str, str]]:
    parser = commands.add_parser(
        "service",
        description="Services that run now (kind: service): a new version of one.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    update = verbs.add_parser(
        "update",
        description="Hand a new version of a running service's job (its command, probes,"
        " scaling) to it: it replaces its replicas one at a time with no failed request.",
    )
    update.add_argument("spec", help="the service's YAML spec, changed (its name finds it)")
    update.add_argument(
        "--run", default=None, help="the flow run id, where several services have the name"
    )
    update.set_defaults(handler=lambda args: _update(Path(args.spec), args.run))
    return [("service", "a running service: update (a new version, rolled out)")]


def _update(path: Path, run: str | None) -> int:
    from gpuflow.tasks.backends.local.backend import LocalBackend
    from gpuflow.tasks.contract import JOB_LABEL
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.service import versions
    from gpuflow.tasks.service.model import ServiceJob

    try:
        spec = load_job_spec(path)
    except InvalidSpec as exc:
        return invalid(exc)
    if not isinstance(spec.job, ServiceJob):
        return invalid(f"job.kind: {path} is a {spec.job.kind} job, not a service")
    running = [
        cluster
        for cluster in LocalBackend().list_owned({JOB_LABEL: spec.name})
        if (Path(cluster.workspace) / "endpoint" / versions.ANSWER).parent.is_dir()
        and (run is None or cluster.name.endswith(run))
    ]
    if not running:
        return invalid(
            f"name: no service named {spec.name} runs on this machine; start it with"
            f" `gpuflow run {path}`"
        )
    if len(running) > 1:
        names = ", ".join(c.name.removeprefix("gpuflow-") for c in running)
        return invalid(f"name: {len(running)} services named {spec.name} run ({names}); add --run")
    folder = Path(running[0].workspace) / "endpoint"
    offer = versions.propose(folder, spec.job)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        said = versions.answer_of(folder)
        if said is not None and said.offer == offer:
            if said.state == "refused":
                print(f"gpuflow: invalid input: {said.said}", file=sys.stderr)
                return EXIT_INVALID
            print(f"{spec.name}: {said.said}")
            return EXIT_OK
        time.sleep(0.1)
    print(f"gpuflow: {spec.name} did not answer within 30 s; is its run still Running?")
    return EXIT_FAILED
