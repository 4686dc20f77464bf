"""A job in its image: what the image adds to a trivial run, against the engine's own run,
and an image's pull from a local registry, cold and warm.

    sudo python bench/image_start.py [--rounds 5]

Needs what the container tests need (root, podman, skopeo; scripts/setup.sh). A registry
on loopback (tests/e2e/imagebed.py) holds the tests' Python image (140 MB). Printed side
by side, medians of --rounds:

- `true` bare, and `podman run --rm IMAGE true` (the engine's own run, warm store);
- `gpuflow run` of `true` on this machine bare, and in the image (warm store, the kept
  temporary API: the second command's cost);
- the image's share: gpuflow in the image less gpuflow bare, against the engine's own run
  less bare `true` (goal: at most 1.2x);
- the pull of the image from the registry into an empty store of its own (cold: every
  layer fetched and unpacked) and again (warm: the manifest checked, nothing fetched).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    return elapsed


def main() -> None:
    from tests.e2e.imagebed import registry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, registry(Path(tmp) / "reg", images=("py",)) as bed:
        work = Path(tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env |= bed.env | {"GPUFLOW_HOME": str(work / "home"), "PREFECT_HOME": str(work / "ph")}
        env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("GPUFLOW_API_IDLE_S", None)  # the temporary API kept between commands
        ref = bed.ref("py")
        bare_job, image_job = work / "bare.yaml", work / "image.yaml"
        bare_job.write_text("name: bare\njob: {kind: command, command: [true]}\n")
        image_job.write_text(f"name: img\nimage: {ref}\njob: {{kind: command, command: [true]}}\n")
        run = [sys.executable, "-m", "gpuflow", "run"]
        podman = ["podman", "run", "--rm", "--network", "host", ref, "true"]
        rows: dict[str, list[float]] = {k: [] for k in ("pull, cold", "pull, warm")}
        for round_ in range(args.rounds):  # a store of its own each round: nothing shared
            store = work / f"store{round_}"
            own = ["--root", str(store / "root"), "--runroot", str(store / "run")]
            pull = ["podman", *own, "--storage-driver", "vfs", "pull", "-q", ref]
            rows["pull, cold"].append(timed(pull, env))
            rows["pull, warm"].append(timed(pull, env))
            subprocess.run(["podman", *own, "--storage-driver", "vfs", "rmi", "--all", "--force"],
                           env=env, capture_output=True)  # fmt: skip
            subprocess.run(["rm", "-rf", str(store)], capture_output=True)
        timed([*run, str(bare_job)], env)  # the kept API started, bytecode written
        timed([*run, str(image_job)], env)
        names = ("true, bare", "podman run", "gpuflow run, bare", "gpuflow run, in the image")
        rows |= {k: [] for k in names}
        for _ in range(args.rounds):
            rows["true, bare"].append(timed(["true"], env))
            rows["podman run"].append(timed(podman, env))
            rows["gpuflow run, bare"].append(timed([*run, str(bare_job)], env))
            rows["gpuflow run, in the image"].append(timed([*run, str(image_job)], env))
        median = {k: statistics.median(v) for k, v in rows.items()}
        print(f"{'':28} {'median s':>9} {'min s':>7} {'max s':>7}")
        for name, values in rows.items():
            print(f"{name:28} {median[name]:9.3f} {min(values):7.3f} {max(values):7.3f}")
        engine = median["podman run"] - median["true, bare"]
        ours = median["gpuflow run, in the image"] - median["gpuflow run, bare"]
        print(
            f"\nthe image's share: gpuflow {ours:.3f} s, the engine's own run {engine:.3f} s:"
            f" {ours / engine:.2f}x (goal: at most 1.2x)"
        )
        subprocess.run([*run[:3], "reap"], env=env, capture_output=True)


if __name__ == "__main__":
    main()
