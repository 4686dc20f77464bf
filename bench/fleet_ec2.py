"""An elastic EC2 fleet on moto (instances played as test-bed hosts, tests/e2e/fleet_bed.py),
with each instance's boot delayed by --boot-s (default 60 s: what a real GPU instance
takes to boot, start sshd and run its user-data, at the least):

1. Time to a run's first line on a fleet with no instance (it grows by a new one, which
   boots) vs on the same fleet right after (a warm instance, no launch).
2. Scale-down: the scaler run every --period-s; seconds from the last run's end to its
   instance's end, against idle_duration_s + one period.

    sudo python bench/fleet_ec2.py [--boot-s 60] [--idle-s 20] [--period-s 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--boot-s", type=float, default=60.0)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--period-s", type=float, default=5.0)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-fleet-ec2-"))
    os.environ["GPUFLOW_HOME"] = str(scratch / "home")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.pop(key, None)

    from prefect.testing.utilities import prefect_test_harness

    from tests.conftest import serve_s3
    from tests.e2e.fleet_bed import fleet_bed

    with (
        serve_s3("127.0.0.1", scratch) as s3,
        fleet_bed(scratch / "bed", []) as bed,
        prefect_test_harness(server_startup_timeout=120),
    ):
        run(s3, bed, args)


def run(s3, bed: dict, args: argparse.Namespace) -> None:
    import boto3
    from prefect.blocks.system import Secret

    from gpuflow.blocks import Ec2GpuFleet, GpuFleet
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.backends import registry
    from gpuflow.tasks.backends.ec2.catalog import gpu_types
    from gpuflow.tasks.backends.fleet.backend import FleetBackend
    from gpuflow.tasks.backends.fleet.growth import scale
    from gpuflow.tasks.pipeline.heartbeat import heartbeats_sent_by_gpuflow
    from gpuflow.tasks.spec import load_spec
    from tests.conftest import save_aws_block
    from tests.e2e.fleet_bed import PlayedFleetInstances

    assert registry  # an elastic fleet's clouds
    params = {
        "endpoint_url": s3.endpoint,
        "region_name": "us-east-1",
        "aws_access_key_id": s3.key_id,
        "aws_secret_access_key": s3.secret,
    }
    ec2 = boto3.client("ec2", **params)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    Ec2GpuFleet(
        region="us-east-1",
        families=["g6"],
        aws_credentials=save_aws_block(s3, "bench-aws"),
        image_id=image,
        control_prefix=f"s3://{s3.bucket}/control",
        boot_timeout_s=args.boot_s + 120,
    ).save("bench-ec2", overwrite=True)
    net = bed["address"].rsplit(".", 1)[0]
    vpc = ec2.create_vpc(CidrBlock=f"{net}.0/24")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"{net}.0/24", AvailabilityZone="us-east-1a")
    Secret(value=bed["key"]).save("bench-fleet-key", overwrite=True)
    GpuFleet(
        ssh_key="bench-fleet-key",
        lease_s=10,
        ec2={
            "block": "bench-ec2",
            "nodes": {"min": 0, "max": 2},
            "instance_types": ["g6.xlarge"],
            "user": "root",
            "subnet": subnet["Subnet"]["SubnetId"],
            "idle_duration_s": args.idle_s,
            "grow_after_s": 0,
        },
    ).save("bench-elastic", overwrite=True)
    products = {t.instance_type: (t.gpus, t.product) for t in gpu_types(ec2, ["g6"])}
    profile = {"AWS_ACCESS_KEY_ID": s3.key_id, "AWS_SECRET_ACCESS_KEY": s3.secret}
    first_line = str(bed["dir"] / "first-line")
    spec = load_spec(
        {
            "name": "bench",
            "job": {"kind": "command", "command": ["sh", "-c", f"date +%s.%N > {first_line}"]},
            "resources": {"gpus": 1},
            "placement": {"backend": "fleet", "fleet": "bench-elastic", "gpu_wait": "10m"},
        }
    )
    with (
        PlayedFleetInstances(ec2, bed, products, profile, boot_s=args.boot_s),
        heartbeats_sent_by_gpuflow(),
    ):
        figures = {}
        for label in ("new instance", "warm instance"):
            start = time.time()
            state = gpu_pipeline(spec, return_state=True)
            assert state.is_completed(), state.message
            figures[label] = float(Path(first_line).read_text()) - start
        ended_at = time.time()
        backend = FleetBackend("bench-elastic")
        periods = 0
        while backend.nodes().instances():  # the scaler on a fixed cadence, as scheduled
            periods += 1
            time.sleep(max(0.0, ended_at + periods * args.period_s - time.time()))
            scale(backend, lambda _line: None)
        gone = time.time() - ended_at
    new, warm = figures["new instance"], figures["warm instance"]
    print(f"simulated boot: {args.boot_s:.0f} s (the played instance's host appears then)")
    print(f"{'to the first line':22}{'new instance':>14}{'warm instance':>15}")
    print(f"{'seconds':22}{new:14.2f}{warm:15.2f}")
    print(f"a warm fleet saves {new - warm:.1f} s per run (ratio {new / warm:.1f})")
    print(
        f"scale-down: the idle instance ended {gone:.1f} s after the last run, within"
        f" idle_duration {args.idle_s:.0f} s + one period {args.period_s:.0f} s ="
        f" {args.idle_s + args.period_s:.0f} s: {gone <= args.idle_s + args.period_s}"
        f" ({periods} scaler periods)"
    )


if __name__ == "__main__":
    main()
