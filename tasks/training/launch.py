"""Launch training on one node: torchrun with one rank per visible GPU (or `cpu_processes`
CPU ranks), standalone, or joining the other nodes at one rendezvous address.

Exits with the "preempted" code when every rank saved a checkpoint and stopped on
SIGTERM, so the pipeline retries and resumes; otherwise with torchrun's own code.
The pipeline stops a job by sending SIGTERM to its whole process group: torchrun and
the ranks get it directly, so this process only waits for them (passing it on as well
would reach torchrun twice, which breaks its shutdown).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from gpuflow.tasks.errors import PREEMPTED_EXIT_CODE
from gpuflow.tasks.loading import loading
from gpuflow.tasks.training.model import PREEMPTED_MARKER, TrainJob


def ranks(job: TrainJob) -> int:
    """Return how many ranks to start: the visible GPUs, else the job's CPU processes."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else job.cpu_processes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job-json", required=True)
    parser.add_argument("--run-name", default="run")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes the job spans")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--rendezvous", help="host:port every node's torchrun meets at")
    parser.add_argument("--rendezvous-id", default="gpuflow", help="the same on every node")
    parser.add_argument(
        "--stop-grace-s",
        type=float,
        default=30.0,
        help="the job's limits.stop_grace_s: torchrun waits as long for its ranks' checkpoint",
    )
    args = parser.parse_args(argv)
    job = TrainJob.model_validate_json(args.job_json)
    with loading():  # torch: no garbage collection while it loads
        nproc = ranks(job)
    workspace = Path(os.environ.get("GPUFLOW_WORKSPACE", "."))
    for marker in workspace.glob(PREEMPTED_MARKER.format(rank="*")):
        marker.unlink(missing_ok=True)  # another node's launcher may remove it first
    env = dict(os.environ, GPUFLOW_TRAIN_JOB=args.job_json, GPUFLOW_RUN_NAME=args.run_name)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # torchrun SIGKILLs its ranks 30 s after its own SIGTERM unless told otherwise: a stop
    # gives them the job's whole grace to finish the step and write the checkpoint (a
    # torch that knows no such setting keeps its 30 s)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(max(1, math.ceil(args.stop_grace_s))))
    if args.nnodes > 1 and (interface := interface_of(node_address())):
        # the ranks talk over the interface the other nodes reach (a host's name may
        # resolve to another, or to loopback); a user's own choice stays
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    command = [
        sys.executable,
        "-m",
        "gpuflow.tasks.loading",  # torch loaded without collections (tasks/loading.py)
        "torch.distributed.run",
        *rendezvous_args(
            args.nnodes, args.node_rank, args.rendezvous, args.rendezvous_id, node_address()
        ),
        f"--nproc_per_node={nproc}",
        "-m",
        "gpuflow.tasks.loading",
        "gpuflow.tasks.training.entry",
    ]
    print(f"launching {nproc} rank(s): {'NCCL on GPUs' if _cuda() else 'gloo on CPU'}", flush=True)
    child = subprocess.Popen(command, env=env)

    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # wait for the ranks' checkpoint
    code = child.wait()
    markers = list(workspace.glob(PREEMPTED_MARKER.format(rank="*")))
    if len(markers) == nproc:
        return PREEMPTED_EXIT_CODE
    return code if code >= 0 else 128 - code


def node_address() -> str | None:
    """Return this node's address as the other nodes reach it (GPUFLOW_NODE_ADDRS, in node
    order), or None where the backend gives none."""
    addresses = [a for a in os.environ.get("GPUFLOW_NODE_ADDRS", "").split(",") if a]
    rank = int(os.environ.get("GPUFLOW_NODE_RANK", "0") or 0)
    return addresses[rank] if rank < len(addresses) else None


def interface_of(address: str | None) -> str | None:
    """Return the network interface of this machine that holds `address` (an IP, or a
    name resolved to one), or None."""
    if not address:
        return None
    import socket

    import psutil

    try:
        ip = socket.gethostbyname(address)
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addresses) and not ip.startswith("127."):
            return name
    return None


def rendezvous_args(
    nodes: int, node_rank: int, endpoint: str | None, run_id: str, address: str | None = None
) -> list[str]:
    """Return torchrun's options for one node of `nodes`: standalone on one node, else a
    c10d rendezvous at `endpoint` that every node's torchrun joins. Node 0 serves it (the
    endpoint is node 0's address on every backend): said, not guessed from host names,
    which on a host whose name does not resolve to that address would leave no one
    serving it. With `address` (this node's, as the others reach it), node 0 gives that as
    its workers' store address, not its host name."""
    if nodes == 1:
        return ["--standalone"]
    if not endpoint:
        raise SystemExit("--rendezvous host:port is needed when --nnodes is more than 1")
    return [
        f"--nnodes={nodes}",
        f"--node_rank={node_rank}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={run_id}",
        f"--rdzv_conf=is_host={'true' if node_rank == 0 else 'false'}",
        *([f"--local_addr={address}"] if address else []),
    ]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
