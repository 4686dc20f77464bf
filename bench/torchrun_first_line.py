"""A 2-node torchrun job's first line: `gpuflow run` with `launcher: torchrun` vs the same
script started by hand with torchrun under srun, on the Slurm test cluster (started and
stopped here; needs root): seconds from the command to the line rank 0 prints once the
process group is up (every rank met), over --rounds rounds (medians printed side by side).
The Prefect API is one kept API, started before the first round (not counted).

    sudo python bench/torchrun_first_line.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
GPUFLOW = [sys.executable, "-m", "gpuflow"]
MARK = "gpuflow-bench-ranks-met"
SCRIPT = f"""
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    print("{MARK}", dist.get_world_size(), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def seconds_to_mark(command: list[str], env: dict) -> float:
    started = time.monotonic()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen, lines = None, []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if MARK in line and seen is None:
            seen = time.monotonic() - started
    if proc.wait(timeout=600) != 0 or seen is None:
        raise SystemExit("the run failed:\n" + "".join(lines[-30:]))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the Slurm test cluster needs root")
    root = Path(tempfile.mkdtemp(prefix="gpuflow-torchrun-bench-"))
    code = root / "code"
    code.mkdir()
    (code / "met.py").write_text(SCRIPT)
    testbed = ROOT / "scripts" / "slurm-testbed.sh"
    subprocess.run(["bash", str(testbed), "up", "--dir", str(root / "slurm")], check=True)
    env = dict(os.environ, SLURM_CONF=str(root / "slurm" / "slurm.conf"))
    env |= {"GPUFLOW_HOME": str(root / "home"), "GPUFLOW_API_IDLE_S": "3600"}
    raw = {
        "name": "torchrun-bench",
        "job": {
            "kind": "command",
            "command": ["python", "met.py"],
            "workdir": str(code),
            "launcher": "torchrun",
            "ranks_per_node": 1,
        },
        "resources": {"gpus": 1, "nodes": 2, "gpu_product": "H100"},
        "placement": {"backend": "slurm", "workspace_root": str(root / "shared")},
        "limits": {"max_duration": "10m"},
        "metrics": {"plot": False},
    }
    spec = root / "job.yaml"
    spec.write_text(yaml.safe_dump(raw))
    by_hand = [
        "srun", "-p", "gpu", "-N2", "--ntasks-per-node=1", "--gres=gpu:h100:1", "-t", "10",
        f"--chdir={code}", "bash", "-c",
        f"exec {sys.executable} -m torch.distributed.run --nnodes=2 --node-rank=$SLURM_NODEID"
        " --nproc-per-node=1 --master-addr=127.0.0.1 --master-port=$((20000 + SLURM_JOB_ID % 20000))"
        " met.py",
    ]  # fmt: skip
    gpuflow_s: list[float] = []
    bare_s: list[float] = []
    try:
        seconds_to_mark([*GPUFLOW, "run", str(spec)], env)  # starts the kept API; not counted
        for _ in range(args.rounds):
            gpuflow_s.append(seconds_to_mark([*GPUFLOW, "run", str(spec)], env))
            bare_s.append(seconds_to_mark(by_hand, env))
    finally:
        subprocess.run(["bash", str(testbed), "down", "--dir", str(root / "slurm")], check=False)
    a, b = statistics.median(gpuflow_s), statistics.median(bare_s)
    print(f"rounds: {args.rounds}; median seconds to rank 0's line once 2 nodes' ranks met")
    print(f"  gpuflow run (launcher: torchrun, workdir): {a:6.2f} s")
    print(f"  srun + torchrun by hand:                   {b:6.2f} s")
    print(f"  gpuflow's own cost:                        {a - b:6.2f} s ({a / b:.2f}x)")
    print(f"  all rounds: gpuflow={gpuflow_s} bare={bare_s}")


if __name__ == "__main__":
    main()
