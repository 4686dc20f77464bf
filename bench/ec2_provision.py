"""EC2 provision to agents ready, on moto (orchestration cost only): seconds from
`Ec2Backend.provision` being called until every instance's agent has said it is ready, for
1 and 8 instances, and teardown until EC2 describes them all as terminated.

moto's EC2, S3 and Secrets Manager run on 127.0.0.1; each instance is booted here by
running its real user-data (tests/e2e/instances.py), which starts gpuflow's agent against
its own metadata mock. What is measured is gpuflow's side (offers, secret, security group,
RunInstances, waiting on the mailbox) plus the agents' start on this machine; an instance's
real boot (minutes on AWS) is not in it.

    python bench/ec2_provision.py [--counts 1,8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from moto_server import start_moto  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--counts", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("GPUFLOW_HOME", tempfile.mkdtemp(prefix="gpuflow-bench-"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[key]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    mock = subprocess.run(
        ["bash", str(ROOT / "scripts" / "imds-mock.sh"), "path"],
        capture_output=True, text=True, check=True,
    ).stdout.split()[-1]  # fmt: skip
    moto, endpoint = start_moto()
    try:
        from prefect.testing.utilities import prefect_test_harness

        with prefect_test_harness(server_startup_timeout=120):
            rows = measure(endpoint, mock, [int(c) for c in args.counts.split(",")], args.rounds)
    finally:
        moto.terminate()
        moto.wait(10)
    print(f"{'instances':>9}{'provision->ready s':>20}{'per instance s':>16}{'teardown s':>12}")
    for count, ready, down in rows:
        print(f"{count:9}{ready:20.2f}{ready / count:16.2f}{down:12.2f}")
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(
            f"ratio {last[0]} vs {first[0]} instance(s): provision x{last[1] / first[1]:.2f}"
            f" for x{last[0] / first[0]:.0f} the instances; teardown x{last[2] / first[2]:.2f}"
        )


def measure(endpoint: str, mock: str, counts: list[int], rounds: int) -> list[tuple]:
    import boto3
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from gpuflow.blocks.ec2_fleet import Ec2GpuFleet
    from gpuflow.tasks.backends.ec2.backend import Ec2Backend
    from gpuflow.tasks.contract import owner_labels
    from gpuflow.tasks.kinds import registry  # noqa: F401 - registers the kinds' job models
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.instances import PlayedInstances

    keys = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    params = {"endpoint_url": endpoint, "region_name": "us-east-1", **keys}
    boto3.client("s3", **params).create_bucket(Bucket="bench")
    ec2 = boto3.client("ec2", **params)
    AwsCredentials(
        **keys, region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=endpoint),
    ).save("bench-aws", overwrite=True)  # fmt: skip
    Ec2GpuFleet(
        families=["g6"],
        aws_credentials="bench-aws",
        image_id=ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"],
        control_prefix="s3://bench/control",
        install=f"GPUFLOW_PYTHON={sys.executable}",
        boot_timeout_s=300,
    ).save("bench-fleet", overwrite=True)
    profile = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
    profile["AWS_DEFAULT_REGION"] = "us-east-1"
    rows = []
    root = Path(tempfile.mkdtemp(prefix="ec2-bench-"))
    with PlayedInstances(ec2, mock, root, profile):
        for count in counts:
            ready, down = [], []
            for round_ in range(rounds):
                spec = load_spec(
                    {
                        "job": {"kind": "command", "command": ["true"]},
                        "resources": {"gpus": 1, "gpu_product": "L4", "nodes": count},
                        "placement": {
                            "backend": "ec2",
                            "block": "bench-fleet",
                            "market": "on-demand",
                        },
                    }
                )
                backend = Ec2Backend("bench-fleet")
                started = time.perf_counter()
                cluster = backend.provision(spec, owner_labels(f"bench-{count}-{round_}", "bench"))
                ready.append(time.perf_counter() - started)
                started = time.perf_counter()
                backend.teardown(cluster)
                down.append(time.perf_counter() - started)
            rows.append((count, min(ready), min(down)))
    shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
