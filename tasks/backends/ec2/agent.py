"""gpuflow's agent on an EC2 instance (gpuflow.tasks.backends.instances.agent) with what is
EC2's: the instance metadata service (IMDSv2), S3, Secrets Manager, TerminateInstances.

    python -m gpuflow.tasks.backends.ec2.agent --config <base64 JSON, no secrets in it>
"""

from __future__ import annotations

import os
import sys
from typing import Any

from gpuflow.tasks.backends.ec2.imds import ENDPOINT, Imds
from gpuflow.tasks.backends.instances import agent
from gpuflow.tasks.backends.instances.agent import AgentConfig, UnitSpec


class AwsNode:
    """An EC2 instance's cloud, reached with the instance profile's credentials."""

    def __init__(self, config: AgentConfig) -> None:
        import boto3

        kwargs: dict[str, Any] = {"region_name": config.region}
        if config.endpoint_url:
            kwargs["endpoint_url"] = config.endpoint_url
        self.s3 = boto3.client("s3", **kwargs)
        self.ec2 = boto3.client("ec2", **kwargs)
        self.secrets = boto3.client("secretsmanager", **kwargs)
        self.metadata = Imds(os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", ENDPOINT))

    def storage(self) -> Any:
        return self.s3

    def read_secret(self, secret_id: str) -> str:
        return str(self.secrets.get_secret_value(SecretId=secret_id)["SecretString"])

    def terminate(self, instance_id: str) -> None:
        self.ec2.terminate_instances(InstanceIds=[instance_id])

    def unit_env(self) -> dict[str, str]:
        return {}  # boto3 in a unit finds the instance profile by itself


def main(argv: list[str] | None = None) -> int:
    return agent.main(argv, "gpuflow.tasks.backends.ec2.agent", AwsNode)


__all__ = ["AgentConfig", "AwsNode", "UnitSpec", "main"]

if __name__ == "__main__":
    sys.exit(main())
