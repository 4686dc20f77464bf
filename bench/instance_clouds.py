"""The instance backends side by side, AWS EC2, Alibaba Cloud ECS and Tencent Cloud CVM, on
their test beds:

- offers: seconds until the ranked table is there for one job (`gpuflow offers`' work,
  in this process): each cloud alone, and a pool of the three ranked in USD;
- launch to first line: seconds from `provision` being called until the first line a unit
  printed on the new instance is back here, per provider (one instance; the instance's
  real boot, minutes on either cloud, is not in it: instances are booted here at once).

moto's EC2 and S3 (as OSS and COS too) and the fake ECS and CVM (tests/fakes/) run on
127.0.0.1, the instances' user-data runs here (tests/e2e/instances.py, alibaba_bed.py).
The API round trips are loopback's, so the figures compare gpuflow's own work per cloud
(how many calls each makes, and what it does between them), not the clouds' latency.

    python bench/instance_clouds.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from moto_server import start_moto  # noqa: E402

KEYS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GPUFLOW_HOME", tempfile.mkdtemp(prefix="gpuflow-bench-"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for key in [k for k in os.environ if k.startswith(("AWS_", "ALIBABA_CLOUD_"))]:
        del os.environ[key]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    mock = subprocess.run(
        ["bash", str(ROOT / "scripts" / "imds-mock.sh"), "path"],
        capture_output=True, text=True, check=True,
    ).stdout.split()[-1]  # fmt: skip
    moto, endpoint = start_moto()
    try:
        from prefect.testing.utilities import prefect_test_harness

        from tests.fakes.alibaba_ecs import FakeEcs
        from tests.fakes.tencent_cvm import FakeCvm

        with (
            prefect_test_harness(server_startup_timeout=120),
            FakeEcs("bench", "bench") as ecs,
            FakeCvm("bench", "bench") as cvm,
        ):
            offers, first = measure(endpoint, mock, ecs, cvm, args.rounds)
    finally:
        moto.terminate()
        moto.wait(10)
    print(f"{'offers for one job':28}{'median s':>10}{'min s':>8}{'ratio':>8}")
    base = statistics.median(offers["ec2"])
    for name, times in offers.items():
        median = statistics.median(times)
        print(f"{name:28}{median:10.3f}{min(times):8.3f}{median / base:8.2f}")
    print(f"{'launch to first line':28}{'median s':>10}{'min s':>8}{'ratio':>8}")
    base = statistics.median(first["ec2"])
    for name, times in first.items():
        median = statistics.median(times)
        print(f"{name:28}{median:10.3f}{min(times):8.3f}{median / base:8.2f}")


def measure(endpoint: str, mock: str, ecs, cvm, rounds: int) -> tuple[dict, dict]:
    import boto3
    import yaml
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from gpuflow.blocks import (
        AlibabaCredentials,
        CvmGpuFleet,
        Ec2GpuFleet,
        EcsGpuFleet,
        GpuPriceTable,
        TencentCredentials,
    )
    from gpuflow.commands.offers import offers
    from gpuflow.tasks.backends.registry import get_backend
    from gpuflow.tasks.contract import WorkUnit, owner_labels
    from gpuflow.tasks.kinds import registry  # noqa: F401 - registers the kinds' job models
    from gpuflow.tasks.runscope import run_scope
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.alibaba_bed import PlayedEcs
    from tests.e2e.instances import PlayedInstances

    params = {"endpoint_url": endpoint, "region_name": "us-east-1", **KEYS}
    boto3.client("s3", **params).create_bucket(Bucket="bench")
    ec2 = boto3.client("ec2", **params)
    AwsCredentials(
        **KEYS, region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=endpoint),
    ).save("bench-aws", overwrite=True)  # fmt: skip
    install = f"GPUFLOW_PYTHON={sys.executable}"
    Ec2GpuFleet(
        families=["g6"],
        aws_credentials="bench-aws",
        image_id=ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"],
        control_prefix="s3://bench/control",
        install=install,
        boot_timeout_s=300,
    ).save("bench-fleet", overwrite=True)
    AlibabaCredentials(access_key_id="bench", access_key_secret="bench").save(
        "bench-aliyun", overwrite=True
    )
    EcsGpuFleet(
        families=["ecs.gn6i", "ecs.gn7i"],
        credentials="bench-aliyun",
        ram_role="bench",
        vpc_id="vpc-bench",
        vswitches={"cn-hangzhou-i": "vsw-i", "cn-hangzhou-j": "vsw-j"},
        image_id="ubuntu",
        control_prefix="s3://bench/control-ecs",
        endpoint=ecs.endpoint,
        oss_endpoint=endpoint,
        oss_region="us-east-1",
        install=install,
        boot_timeout_s=300,
    ).save("bench-ecs", overwrite=True)
    TencentCredentials(secret_id="bench", secret_key="bench").save("bench-tc", overwrite=True)
    CvmGpuFleet(
        families=["GN7", "GN10Xp"],
        credentials="bench-tc",
        cam_role="bench",
        vpc_id="vpc-bench",
        subnets={"ap-guangzhou-3": "subnet-3", "ap-guangzhou-4": "subnet-4"},
        security_group="sg-bench",
        image_id="img-bench",
        control_prefix="s3://bench/control-cvm",
        endpoint=cvm.endpoint,
        cos_endpoint=endpoint,
        cos_region="us-east-1",
        install=install,
        boot_timeout_s=300,
    ).save("bench-cvm", overwrite=True)
    GpuPriceTable(usd_per_unit={"CNY": 0.14}).save("bench-cny", overwrite=True)
    places = {
        "ec2": {"backend": "ec2", "block": "bench-fleet", "market": "on-demand"},
        "alibaba": {
            "backend": "alibaba",
            "block": "bench-ecs",
            "market": "on-demand",
            "price_table": "bench-cny",
        },
        "tencent": {
            "backend": "tencent",
            "block": "bench-cvm",
            "market": "on-demand",
            "price_table": "bench-cny",
        },
    }
    folder = Path(tempfile.mkdtemp(prefix="instance-clouds-"))
    jobs = {}
    for name, placement in [*places.items(), ("pool of the three", list(places.values()))]:
        raw = {
            "name": "bench",
            "job": {"kind": "command", "command": ["true"]},
            "resources": {"gpus": 1},
            "placement": placement,
        }
        path = folder / f"{len(jobs)}.yaml"
        path.write_text(yaml.safe_dump(raw))
        jobs[name] = path
    offer_times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(rounds):
        for name, path in jobs.items():
            started = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                assert offers(str(path)) == 0
            offer_times[name].append(time.perf_counter() - started)

    profile = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    profile["AWS_DEFAULT_REGION"] = "us-east-1"
    first: dict[str, list[float]] = {name: [] for name in places}
    with (
        PlayedInstances(ec2, mock, folder / "ec2", profile),
        PlayedEcs(ecs, folder / "ecs"),
        PlayedEcs(cvm, folder / "cvm", "GPUFLOW_CVM_METADATA_ENDPOINT"),
    ):
        for round_ in range(rounds):
            for name, placement in places.items():
                spec = load_spec(
                    {
                        "job": {"kind": "command", "command": ["true"]},
                        "resources": {"gpus": 1},
                        "placement": placement,
                    }
                )
                with run_scope():
                    backend = get_backend(name, spec.placement)
                    seen: list[float] = []
                    started = time.perf_counter()
                    cluster = backend.provision(spec, owner_labels(f"bench-{name}-{round_}", "b"))
                    try:
                        unit = WorkUnit(name="main", command=["echo", "first line"])

                        def tail(
                            stream: str, line: str, seen: list = seen, started: float = started
                        ) -> None:
                            if "first line" in line and not seen:
                                seen.append(time.perf_counter() - started)

                        backend.run(cluster, unit, {}, 300, tail)
                    finally:
                        backend.teardown(cluster)
                first[name].append(seen[0])
    return offer_times, first


if __name__ == "__main__":
    main()
