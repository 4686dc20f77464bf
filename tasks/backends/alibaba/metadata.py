"""The ECS instance metadata service, as gpuflow's agent on an instance reads it: hardened
mode (a token from PUT /latest/api/token on every request, plain requests where the
instance allows them), the instance's id and private address, the preemptible instance's
termination time (a spot notice, about five minutes ahead) and the instance RAM role's
temporary credentials."""

from __future__ import annotations

import time

import httpx

from gpuflow.tasks.backends.instances.notices import MetadataService, MetadataUnavailable

ENDPOINT = "http://100.100.100.200"
TOKEN_TTL_S = 21600


class EcsMetadata(MetadataService):
    name = "the ECS metadata service"
    spot_path = "/latest/meta-data/instance/spot/termination-time"

    def __init__(self, endpoint: str = ENDPOINT, timeout_s: float = 2.0) -> None:
        super().__init__(endpoint, timeout_s)
        self.token: str | None = None
        self.token_until = 0.0

    def headers(self) -> dict[str, str]:
        if self.token is None or time.monotonic() > self.token_until:
            try:
                answer = self.http.put(
                    "/latest/api/token",
                    headers={"X-aliyun-ecs-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                )
            except httpx.HTTPError as exc:
                raise MetadataUnavailable(
                    f"{self.name} at {self.endpoint} did not answer"
                    f" ({type(exc).__name__}: {exc}); is this an ECS instance?"
                ) from None
            if answer.status_code != 200:
                return {}  # normal mode: requests without a token
            self.token = answer.text
            self.token_until = time.monotonic() + TOKEN_TTL_S - 60
        return {"X-aliyun-ecs-metadata-token": self.token}

    def instance_id(self) -> str:
        return self.get("/latest/meta-data/instance-id") or ""

    def address(self) -> str | None:
        return self.get("/latest/meta-data/private-ipv4")

    def role_credentials(self, role: str) -> dict[str, str]:
        """AccessKeyId, AccessKeySecret, SecurityToken, Expiration of the RAM role."""
        return self.role_json(
            f"/latest/meta-data/ram/security-credentials/{role}",
            role,
            "attach that RAM role to the instance (EcsGpuFleet ram_role).",
        )
