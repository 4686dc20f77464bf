"""The ECS instance metadata service, as gpuflow's agent on an instance reads it: hardened
mode (a token from PUT /latest/api/token on every request, plain requests where the
instance allows them), the instance's id and private address, the preemptible instance's
termination time (a spot notice, about five minutes ahead) and the instance RAM role's
temporary credentials."""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import httpx

from gpuflow.tasks.backends.instances.notices import MetadataUnavailable, Notice, parse_time

ENDPOINT = "http://100.100.100.200"
TOKEN_TTL_S = 21600
SPOT = "/latest/meta-data/instance/spot/termination-time"


class EcsMetadata:
    def __init__(self, endpoint: str = ENDPOINT, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.http = httpx.Client(base_url=self.endpoint, timeout=timeout_s)
        self.token: str | None = None
        self.token_until = 0.0

    def _token(self) -> str | None:
        if self.token is None or time.monotonic() > self.token_until:
            try:
                answer = self.http.put(
                    "/latest/api/token",
                    headers={"X-aliyun-ecs-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                )
            except httpx.HTTPError as exc:
                raise MetadataUnavailable(
                    f"the ECS metadata service at {self.endpoint} did not answer"
                    f" ({type(exc).__name__}: {exc}); is this an ECS instance?"
                ) from None
            if answer.status_code != 200:
                return None  # normal mode: requests without a token
            self.token = answer.text
            self.token_until = time.monotonic() + TOKEN_TTL_S - 60
        return self.token

    def get(self, path: str) -> str | None:
        """The text at `path`; None where the service has nothing (404)."""
        token = self._token()
        headers = {"X-aliyun-ecs-metadata-token": token} if token else {}
        try:
            answer = self.http.get(path, headers=headers)
        except httpx.HTTPError as exc:
            raise MetadataUnavailable(
                f"the ECS metadata service at {self.endpoint} did not answer {path}"
                f" ({type(exc).__name__}: {exc})."
            ) from None
        if answer.status_code == 404:
            return None
        if answer.status_code != 200:
            raise MetadataUnavailable(
                f"the ECS metadata service answered {path} with HTTP {answer.status_code}."
            )
        return answer.text

    def instance_id(self) -> str:
        return self.get("/latest/meta-data/instance-id") or ""

    def address(self) -> str | None:
        return self.get("/latest/meta-data/private-ipv4")

    def notices(self) -> list[Notice]:
        """The preemptible instance's termination time, once ECS set it."""
        at = self.get(SPOT)
        if not at:
            return []
        now = datetime.now().astimezone()
        return [Notice(kind="spot-terminate", at=parse_time(at), seen_at=now)]

    def role_credentials(self, role: str) -> dict[str, Any]:
        """The instance RAM role's temporary credentials (AccessKeyId, AccessKeySecret,
        SecurityToken, Expiration)."""
        text = self.get(f"/latest/meta-data/ram/security-credentials/{role}")
        if not text:
            raise MetadataUnavailable(
                f"the ECS metadata service has no credentials of RAM role {role!r}; attach"
                " that role to the instance (EcsGpuFleet ram_role)."
            )
        found = json.loads(text)
        if found.get("Code", "Success") != "Success":
            raise MetadataUnavailable(f"RAM role {role!r}: {found.get('Code')}")
        return dict(found)
