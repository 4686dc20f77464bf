"""An elastic fleet on each cloud side by side, AWS EC2 (moto), Alibaba Cloud ECS and
Tencent Cloud CVM (their fakes, tests/fakes/), each instance played as a host of a fleet
test bed (tests/e2e/fleet_bed.py) the moment the cloud launches it (no boot delay: what
is compared is gpuflow's own work per cloud, over loopback):

- seconds to a run's first line on a fleet with no instance (it grows by a new one) and on
  the same fleet right after (the warm instance, no launch), per cloud, and each cloud's
  against EC2's;
- the scaler's period that ends the idle instance (after idle_duration_s), per cloud.

    sudo python bench/fleet_clouds.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLOUDS = ("ec2", "alibaba", "tencent")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-fleet-clouds-"))
    os.environ["GPUFLOW_HOME"] = str(scratch / "home")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for key in [k for k in os.environ if k.startswith(("AWS_", "ALIBABA_CLOUD_", "TENCENTCLOUD_"))]:
        del os.environ[key]

    from prefect.testing.utilities import prefect_test_harness

    from tests.conftest import serve_s3
    from tests.fakes.alibaba_ecs import FakeEcs
    from tests.fakes.tencent_cvm import FakeCvm

    with (
        serve_s3("127.0.0.1", scratch) as s3,
        prefect_test_harness(server_startup_timeout=120),
        FakeEcs(s3.key_id, s3.secret) as ecs,
        FakeCvm(s3.key_id, s3.secret) as cvm,
    ):
        figures = {cloud: measure(cloud, s3, ecs, cvm, scratch, args.rounds) for cloud in CLOUDS}
    print(f"{'to the first line (s)':22}{'new':>8}{'warm':>8}{'new/warm':>10}{'new vs EC2':>12}")
    base = statistics.median(figures["ec2"]["new"])
    for cloud, times in figures.items():
        new, warm = statistics.median(times["new"]), statistics.median(times["warm"])
        print(f"{cloud:22}{new:8.2f}{warm:8.2f}{new / warm:10.1f}{new / base:12.2f}")
    print(f"{'scale-down period (s)':22}" + "".join(f"{c:>10}" for c in CLOUDS))
    print(
        f"{'median':22}" + "".join(f"{statistics.median(figures[c]['end']):10.2f}" for c in CLOUDS)
    )


def measure(cloud: str, s3, ecs, cvm, scratch: Path, rounds: int) -> dict[str, list[float]]:
    """`rounds` times: a run on the empty fleet, a run on its warm instance, the scaler
    ending the instance once idle."""
    from prefect.blocks.system import Secret

    from gpuflow.blocks import GpuFleet
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.backends.fleet.backend import FleetBackend
    from gpuflow.tasks.backends.fleet.growth import scale
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.fleet_bed import fleet_bed

    idle_s = 10.0
    with fleet_bed(scratch / f"bed-{cloud}", []) as bed:
        Secret(value=bed["key"]).save("bench-fleet-key", overwrite=True)
        section, played = _cloud(cloud, s3, ecs, cvm, bed)
        section |= {"nodes": {"min": 0, "max": 1}, "user": "root", "idle_duration_s": idle_s}
        section |= {"grow_after_s": 0}
        name = f"bench-{cloud}"
        GpuFleet(ssh_key="bench-fleet-key", lease_s=10, **{cloud: section}).save(
            name, overwrite=True
        )
        first_line = Path(bed["dir"]) / "first-line"
        spec = load_spec(
            {
                "name": "bench",
                "job": {"kind": "command", "command": ["sh", "-c", f"date +%s.%N > {first_line}"]},
                "resources": {"gpus": 1},
                "placement": {"backend": "fleet", "fleet": name, "gpu_wait": "10m"},
            }
        )
        times: dict[str, list[float]] = {"new": [], "warm": [], "end": []}
        with played:
            for _ in range(rounds):
                for label in ("new", "warm"):
                    start = time.time()
                    state = gpu_pipeline(spec, return_state=True)
                    assert state.is_completed(), (state.message, played.errors)
                    times[label].append(float(first_line.read_text()) - start)
                time.sleep(idle_s)
                backend = FleetBackend(name)
                start = time.time()
                scale(backend, lambda _line: None)
                times["end"].append(time.time() - start)
                assert not backend.nodes().instances(), "the idle instance was not ended"
            FleetBackend(name).nodes().remove_all(lambda _line: None)
    return times


def _cloud(cloud: str, s3, ecs, cvm, bed: dict):
    """The fleet's section of `cloud` (its block saved) and the player of its instances."""
    import boto3

    from gpuflow.blocks import Ec2GpuFleet
    from tests.conftest import save_aws_block
    from tests.e2e import alibaba_bed, tencent_bed
    from tests.e2e.fleet_bed import PlayedFleetInstances, PlayedFleetOnFake

    if cloud == "alibaba":
        alibaba_bed.save_blocks(ecs, s3)
        played = PlayedFleetOnFake(ecs, bed, {"ecs.gn6i-c4g1.xlarge": (1, "T4")},
                                   "GPUFLOW_ECS_METADATA_ENDPOINT")  # fmt: skip
        section = {"block": alibaba_bed.ECS_FLEET, "instance_types": ["ecs.gn6i-c4g1.xlarge"],
                   "price_table": alibaba_bed.PRICES, "ssh_from": [f"{bed['address']}/32"]}  # fmt: skip
        return section, played
    if cloud == "tencent":
        tencent_bed.save_blocks(cvm, s3)
        played = PlayedFleetOnFake(cvm, bed, {"GN7.2XLARGE32": (1, "T4")}, tencent_bed.METADATA)
        section = {"block": tencent_bed.CVM_FLEET, "instance_types": ["GN7.2XLARGE32"],
                   "price_table": tencent_bed.PRICES}  # fmt: skip
        return section, played
    params = {"endpoint_url": s3.endpoint, "region_name": "us-east-1",
              "aws_access_key_id": s3.key_id, "aws_secret_access_key": s3.secret}  # fmt: skip
    ec2 = boto3.client("ec2", **params)
    Ec2GpuFleet(
        region="us-east-1",
        families=["g6"],
        aws_credentials=save_aws_block(s3, "bench-aws"),
        image_id=ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"],
        control_prefix=f"s3://{s3.bucket}/control",
        boot_timeout_s=300,
    ).save("bench-ec2", overwrite=True)
    net = bed["address"].rsplit(".", 1)[0]
    vpc = ec2.create_vpc(CidrBlock=f"{net}.0/24")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"{net}.0/24", AvailabilityZone="us-east-1a")
    profile = {"AWS_ACCESS_KEY_ID": s3.key_id, "AWS_SECRET_ACCESS_KEY": s3.secret}
    played = PlayedFleetInstances(ec2, bed, {"g6.xlarge": (1, "L4")}, profile)
    section = {"block": "bench-ec2", "instance_types": ["g6.xlarge"],
               "subnet": subnet["Subnet"]["SubnetId"]}  # fmt: skip
    return section, played


if __name__ == "__main__":
    main()
