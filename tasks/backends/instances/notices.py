"""The notices that end a rented instance, as an agent on it hears them from its cloud's
metadata service: a spot (preemptible) instance's interruption notice, and a warning that
one may come (EC2's rebalance recommendation). A provider's metadata reader returns them
(`Metadata.notices`); `NoticeWatcher` polls it every `every_s` seconds (5 by default) in a
thread of its own and calls `on_notice` once per kind of notice, at once: the agent sends
the job SIGTERM, so a training saves its checkpoint and exits 75 well inside the warning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from pydantic import BaseModel

NOTICE_EVERY_S = 5.0


class MetadataUnavailable(Exception):
    """The instance's metadata service did not answer, or refused: one sentence with the cause."""


class Notice(BaseModel):
    kind: str  # "spot-terminate" | "spot-stop" | "spot-hibernate" | "rebalance"
    at: datetime  # when the action happens (spot) or the recommendation was made
    seen_at: datetime


class Metadata(Protocol):
    """An instance's metadata service as the agent reads it."""

    def instance_id(self) -> str: ...

    def address(self) -> str | None:
        """The instance's private address (None: ask the host's own name)."""
        ...

    def notices(self) -> list[Notice]:
        """The notices there now; MetadataUnavailable when the service does not answer."""
        ...


class MetadataService:
    """An instance metadata service read over HTTP (Alibaba's, Tencent's): `get` with the
    headers `headers()` gives (a token, where the service wants one), a spot instance's
    termination time at `spot_path`, the instance role's credentials as JSON."""

    name = "the metadata service"
    spot_path = ""

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        import httpx

        self.endpoint = endpoint.rstrip("/")
        self.http = httpx.Client(base_url=self.endpoint, timeout=timeout_s)

    def headers(self) -> dict[str, str]:
        return {}

    def get(self, path: str) -> str | None:
        """The text at `path`; None where the service has nothing (404)."""
        import httpx

        try:
            answer = self.http.get(path, headers=self.headers())
        except httpx.HTTPError as exc:
            raise MetadataUnavailable(
                f"{self.name} at {self.endpoint} did not answer {path}"
                f" ({type(exc).__name__}: {exc})."
            ) from None
        if answer.status_code == 404:
            return None
        if answer.status_code != 200:
            raise MetadataUnavailable(
                f"{self.name} at {self.endpoint} answered {path} with HTTP {answer.status_code}."
            )
        return answer.text

    def notices(self) -> list[Notice]:
        """The spot instance's termination time, once the cloud set it."""
        at = self.get(self.spot_path)
        if not at:
            return []
        return [
            Notice(kind="spot-terminate", at=parse_time(at), seen_at=datetime.now().astimezone())
        ]

    def role_json(self, path: str, role: str, fix: str) -> dict[str, str]:
        """The instance role's temporary credentials at `path`; MetadataUnavailable (with
        `fix`) when the role is not the instance's."""
        import json

        text = self.get(path)
        if not text:
            raise MetadataUnavailable(f"{self.name} has no credentials of role {role!r}; {fix}")
        found = json.loads(text)
        if found.get("Code", "Success") != "Success":
            raise MetadataUnavailable(f"role {role!r}: {found.get('Code')}")
        return {str(k): str(v) for k, v in found.items() if v is not None}


def parse_time(text: str) -> datetime:
    """A metadata service's time (ISO 8601, `Z` for UTC) as an aware datetime."""
    return datetime.fromisoformat(text.strip().replace("Z", "+00:00"))


class NoticeWatcher:
    """Polls the metadata service for notices in a thread; `on_notice` is called once per
    kind of notice, as soon as a poll sees it (an instance gets one interruption; a
    rebalance recommendation's time may be given anew on each read). `on_trouble` hears,
    once, that the service stopped answering (the watch goes on)."""

    def __init__(
        self,
        imds: Metadata,
        on_notice: Callable[[Notice], None],
        every_s: float = NOTICE_EVERY_S,
        on_trouble: Callable[[str], None] | None = None,
    ) -> None:
        self.imds, self.on_notice, self.every_s = imds, on_notice, every_s
        self.on_trouble = on_trouble
        self.seen: set[str] = set()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="gpuflow-notices")

    def __enter__(self) -> NoticeWatcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=self.every_s + 5)

    def _watch(self) -> None:
        troubled = False
        while not self.stopping.is_set():
            try:
                for notice in self.imds.notices():
                    if notice.kind not in self.seen:
                        self.seen.add(notice.kind)
                        self.on_notice(notice)
                troubled = False
            except MetadataUnavailable as exc:
                if not troubled and self.on_trouble is not None:
                    self.on_trouble(str(exc))
                troubled = True
            self.stopping.wait(self.every_s)
