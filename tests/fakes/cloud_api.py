"""What the fakes of the clouds' instance APIs share (tests/fakes/alibaba_ecs.py,
tencent_cvm.py): the API's server and the instances' metadata service on loopback, the
hooks a test bed boots and powers off instances with, the calls made, and a spot notice."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class FakeCloud:
    """A cloud's API at `endpoint` and its instances' metadata at `metadata_url(id)`; a
    subclass answers the calls (`_handler`) and ends an instance (`_end`)."""

    def __init__(self) -> None:
        self.instances: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.gone_at_launch: set[tuple[str, str]] = set()  # listed in stock, none at launch
        self.quota_left: int | None = None  # GPUs the account may still start
        self.on_launch: Callable[[dict[str, Any]], None] = lambda _i: None
        self.on_delete: Callable[[dict[str, Any]], None] = lambda _i: None
        # an instance's private address (a test bed that plays instances as hosts sets it)
        self.address_of: Callable[[str], str] = lambda _id: "127.0.0.1"
        self.lock = threading.RLock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("api"))
        self.metadata_server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("metadata"))
        self.threads = [
            threading.Thread(target=s.serve_forever, daemon=True)
            for s in (self.server, self.metadata_server)
        ]

    def _handler(self, which: str) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    def _end(self, instance_id: str) -> None:
        raise NotImplementedError

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def metadata_url(self, instance_id: str) -> str:
        return f"http://127.0.0.1:{self.metadata_server.server_port}/{instance_id}"

    def __enter__(self) -> Self:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in (self.server, self.metadata_server):
            server.shutdown()
            server.server_close()

    def interrupt(self, instance_id: str, warning_s: float) -> None:
        """Give a spot instance its termination time; end it `warning_s` later."""
        at = datetime.now(UTC) + timedelta(seconds=warning_s)
        with self.lock:
            self.instances[instance_id]["termination_time"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")

        def later() -> None:
            time.sleep(warning_s)
            self._end(instance_id)

        threading.Thread(target=later, daemon=True).start()

    def actions(self) -> list[str]:
        return [action for action, _ in self.calls]

    def tags_of(self, flat: dict[str, Any]) -> dict[str, str]:
        """The tags a request's Tag.N.Key / Tag.N.Value parameters name."""
        return {
            flat[f"Tag.{n}.Key"]: flat.get(f"Tag.{n}.Value", "")
            for n in range(1, 21)
            if f"Tag.{n}.Key" in flat
        }
