"""A job in its image on a fleet host and on Slurm: what the image adds to a trivial run,
against the engine's own run there.

    sudo .venv/bin/python bench/image_start_remote.py [--rounds 5] [--where fleet,slurm]

Needs what the container, fleet and Slurm tests need (root, podman, skopeo, umoci, Slurm;
scripts/setup.sh). A registry (tests/e2e/imagebed.py) holds the tests' Python image; a
Prefect API of its own (prefect_test_harness) holds the blocks. Printed side by side,
medians of --rounds (every other round in the reverse order: on Slurm a run that follows
another waits for its node to leave the COMPLETING state), each after one warm-up (the
image pulled or unpacked, the host's library made):

- fleet host (scripts/fleet-testbed.sh, one host): `ssh HOST true` and `ssh HOST podman run
  --rm IMAGE true` (the engine's own run on the host, warm store); a run of `true` through
  gpuflow's pipeline placed on the fleet, bare and in the image;
- Slurm (scripts/slurm-testbed.sh): `srun true` and `srun --container=BUNDLE true` (Slurm's
  own OCI run of the bundle gpuflow unpacked); a run of `true` placed on Slurm, bare and in
  the image;
- the image's share on each: gpuflow in the image less gpuflow bare, against the engine's
  own run less the bare one (goal: at most 1.2x).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(step: Callable[[], object]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def command(argv: list[str]) -> Callable[[], None]:
    def run() -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv[:6])} failed: {done.stderr[-1500:]}")

    return run


def pipeline(raw: dict) -> Callable[[], None]:
    def run() -> None:
        from gpuflow.flows.pipeline import gpu_pipeline
        from gpuflow.tasks.spec import load_spec

        state = gpu_pipeline(load_spec(raw), return_state=True)
        if not state.is_completed():
            raise SystemExit(f"the run {raw['name']} failed: {state.message}")

    return run


def measure(rows: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    for step in rows.values():
        step()  # warm: pulled, unpacked, the library made, bytecode written
    found: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(rounds):  # every other round backwards: none always follows another
        order = list(rows.items())
        for name, step in order if round_ % 2 == 0 else reversed(order):
            found[name].append(timed(step))
    return found


def show(title: str, found: dict[str, list[float]]) -> None:
    names = list(found)
    median = {k: statistics.median(v) for k, v in found.items()}
    print(f"\n{title}\n{'':34} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, values in found.items():
        print(f"{name:34} {median[name]:9.3f} {min(values):7.3f} {max(values):7.3f}")
    engine = median[names[1]] - median[names[0]]
    ours = median[names[3]] - median[names[2]]
    print(
        f"the image's share: gpuflow {ours:.3f} s, the engine's own run {engine:.3f} s:"
        f" {ours / engine:.2f}x (goal: at most 1.2x)"
    )


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fleet(work: Path, rounds: int, api: dict[str, str]) -> None:
    from tests.e2e.fleet_bed import fleet_bed, host_entry, save_fleet
    from tests.e2e.imagebed import registry

    reg = work / "fleet-registry"
    reg.mkdir()
    conf = {"CONTAINERS_CONF": str(reg / "containers.conf")}
    host_env = {**conf, "CONTAINERS_REGISTRIES_CONF": str(reg / "registries.conf")}
    with contextlib.ExitStack() as beds:
        bed = beds.enter_context(fleet_bed(work / "fleet", ["b1:1"], host_env=host_env))
        near = beds.enter_context(registry(reg, f"{bed['address']}:0", images=("py",)))
        save_fleet(bed, "bench", [host_entry(bed, "b1")], lease_s=10)
        with environ(near.env):
            applied = subprocess.run(
                [sys.executable, "-m", "gpuflow", "fleet", "apply", "bench"],
                env={**os.environ, **api},
                capture_output=True,
                text=True,
            )
            if applied.returncode != 0:
                raise SystemExit(applied.stdout[-2000:] + applied.stderr[-2000:])
            host = bed["hosts"][0]
            key = work / "fleet-key"
            key.write_text(bed["key"])
            key.chmod(0o600)
            ssh = ["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no"]
            ssh += ["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
            ssh += ["-p", str(host.get("port", 22)), f"root@{host['address']}"]
            placement = {"backend": "fleet", "fleet": "bench"}
            job = {"kind": "command", "command": ["true"]}
            found = measure(
                {
                    "ssh HOST true": command([*ssh, "true"]),
                    "ssh HOST podman run": command(
                        [*ssh, f"podman run --rm --network host {near.ref('py')} true"]
                    ),
                    "gpuflow run, bare": pipeline(
                        {"name": "bare", "job": job, "placement": placement}
                    ),
                    "gpuflow run, in the image": pipeline(
                        {"name": "img", "job": job, "placement": placement}
                        | {"image": near.ref("py")}
                    ),
                },
                rounds,
            )
    show("a fleet host (one namespace host over SSH, podman with runc)", found)


def slurm(work: Path, rounds: int) -> None:
    from tests.e2e.imagebed import registry

    script = ROOT / "scripts" / "slurm-testbed.sh"
    folder = work / "slurm"
    subprocess.run(["bash", str(script), "up", "--dir", str(folder)], check=True, timeout=300)
    try:
        with contextlib.ExitStack() as beds:
            bed = beds.enter_context(registry(work / "slurm-registry", images=("py",)))
            beds.enter_context(environ({**bed.env, "SLURM_CONF": str(folder / "slurm.conf")}))
            root = work / "workspaces"
            placement = {"backend": "slurm", "workspace_root": str(root)}
            job = {"kind": "command", "command": ["true"]}
            limits = {"max_duration": "10m"}  # the test cluster's partitions allow 60 min
            image_run = pipeline(
                {"name": "img", "image": bed.ref("py"), "job": job, "placement": placement}
                | {"limits": limits}
            )
            image_run()  # the bundle unpacked
            (bundle,) = [p for p in (root / ".gpuflow-images").iterdir() if p.is_dir()]
            found = measure(
                {
                    "srun true": command(["srun", "-n1", "true"]),
                    "srun --container true": command(
                        ["srun", "-n1", f"--container={bundle / 'bundle'}", "true"]
                    ),
                    "gpuflow run, bare": pipeline(
                        {"name": "bare", "job": job, "placement": placement} | {"limits": limits}
                    ),
                    "gpuflow run, in the image": image_run,
                },
                rounds,
            )
    finally:
        subprocess.run(["bash", str(script), "down", "--dir", str(folder)], timeout=120)
    show("Slurm (the test cluster: slurmctld and slurmd on this machine, runc)", found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--where", default="fleet,slurm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ |= {"GPUFLOW_HOME": str(work / "home"), "PREFECT_HOME": str(work / "ph")}
        os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        from prefect.settings import PREFECT_API_URL
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness():
            api = {"PREFECT_API_URL": str(PREFECT_API_URL.value())}
            wanted = args.where.split(",")
            if "fleet" in wanted:
                fleet(work, args.rounds, api)
            if "slurm" in wanted:
                slurm(work, args.rounds)


if __name__ == "__main__":
    main()
