"""The CVM instance metadata service, as gpuflow's agent on an instance reads it: the
instance's id and private address, the spot instance's termination time (about two
minutes ahead) and the instance CAM role's temporary credentials."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import httpx

from gpuflow.tasks.backends.instances.notices import MetadataUnavailable, Notice, parse_time

ENDPOINT = "http://metadata.tencentyun.com"
SPOT = "/latest/meta-data/spot/termination-time"


class CvmMetadata:
    def __init__(self, endpoint: str = ENDPOINT, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.http = httpx.Client(base_url=self.endpoint, timeout=timeout_s)

    def get(self, path: str) -> str | None:
        """The text at `path`; None where the service has nothing (404)."""
        try:
            answer = self.http.get(path)
        except httpx.HTTPError as exc:
            raise MetadataUnavailable(
                f"the CVM metadata service at {self.endpoint} did not answer {path}"
                f" ({type(exc).__name__}: {exc}); is this a CVM instance?"
            ) from None
        if answer.status_code == 404:
            return None
        if answer.status_code != 200:
            raise MetadataUnavailable(
                f"the CVM metadata service answered {path} with HTTP {answer.status_code}."
            )
        return answer.text

    def instance_id(self) -> str:
        return self.get("/latest/meta-data/instance-id") or ""

    def address(self) -> str | None:
        return self.get("/latest/meta-data/local-ipv4")

    def notices(self) -> list[Notice]:
        """The spot instance's termination time, once CVM set it."""
        at = self.get(SPOT)
        if not at:
            return []
        now = datetime.now().astimezone()
        return [Notice(kind="spot-terminate", at=parse_time(at), seen_at=now)]

    def role_credentials(self, role: str) -> dict[str, Any]:
        """The instance CAM role's temporary credentials (TmpSecretId, TmpSecretKey, Token,
        ExpiredTime)."""
        text = self.get(f"/latest/meta-data/cam/security-credentials/{role}")
        if not text:
            raise MetadataUnavailable(
                f"the CVM metadata service has no credentials of CAM role {role!r}; bind that"
                " role to the instance (CvmGpuFleet cam_role)."
            )
        found = json.loads(text)
        if found.get("Code", "Success") != "Success":
            raise MetadataUnavailable(f"CAM role {role!r}: {found.get('Code')}")
        return dict(found)
