"""gpuflow's agent on an ECS instance (gpuflow.tasks.backends.instances.agent) with what is
Alibaba Cloud's: the metadata service, OSS through its S3-compatible API and ECS's own
DeleteInstance, both with the instance RAM role's temporary credentials (no key on the
instance); the run's secret is an object of its mailbox.

    python -m gpuflow.tasks.backends.alibaba.agent --config <base64 JSON, no secrets in it>
"""

from __future__ import annotations

import os
import sys

from gpuflow.tasks.backends.alibaba.metadata import ENDPOINT, EcsMetadata
from gpuflow.tasks.backends.alibaba.settings import EcsFleet, ecs_client
from gpuflow.tasks.backends.instances import agent
from gpuflow.tasks.backends.instances.agent import AgentConfig, RoleNode


class AlibabaNode(RoleNode):
    """An ECS instance's cloud, reached with its RAM role's temporary credentials."""

    metadata: EcsMetadata

    def __init__(self, config: AgentConfig) -> None:
        endpoint = os.environ.get("GPUFLOW_ECS_METADATA_ENDPOINT", ENDPOINT)
        super().__init__(config, EcsMetadata(endpoint))

    def role_keys(self) -> tuple[str, str, str | None]:
        found = self.metadata.role_credentials(self.config.cloud.get("ram_role", ""))
        return found["AccessKeyId"], found["AccessKeySecret"], found.get("SecurityToken") or None

    def terminate(self, instance_id: str) -> None:
        from alibabacloud_ecs20140526 import models

        fleet = EcsFleet(region=self.config.region)
        client = ecs_client(fleet, self.current_keys(), self.config.cloud.get("ecs_endpoint"))
        client.delete_instance(models.DeleteInstanceRequest(instance_id=instance_id, force=True))


def main(argv: list[str] | None = None) -> int:
    return agent.main(argv, "gpuflow.tasks.backends.alibaba.agent", AlibabaNode)


if __name__ == "__main__":
    sys.exit(main())
