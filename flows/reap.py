"""reap: remove what gpuflow runs left on a backend once their flow run is over (or their
gpuflow is gone), on a schedule; the same as `gpuflow reap --backend ...`."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from gpuflow.tasks.platform import reap as reaping


@flow(name="reap")
def reap(
    backend: str = "ec2",
    block: str | None = None,
    namespace: str | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Reap one backend's leftovers and publish what went (or would go) as an artifact.
    `backend`: any registered backend (local, kubernetes, ec2, slurm, fleet and those
    registered later; another name fails in one sentence listing them); `block`: the
    Ec2GpuFleet (ec2), the SlurmCluster (slurm: its login node) or the GpuFleet (fleet);
    `namespace`: the Kubernetes namespace."""

    logger = get_run_logger()
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        logger.info(line)

    done = reaping.reap(dry_run, say, backend, block, namespace)
    counts = ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in done.items()
    )
    create_markdown_artifact(
        key=f"gpuflow-reap-{backend}",
        markdown="\n".join(
            [
                f"# reap {backend}{' (dry run)' if dry_run else ''}",
                "",
                *(f"- {s}" for s in said),
                "",
                counts,
            ]
        ),
        description=f"What gpuflow's reaper {'would remove' if dry_run else 'removed'} on {backend}",
    )
    return done
