"""Count what runs in this process ask of the Prefect API: HTTP requests by method and
route (ids folded to {id}) and events sent, from the client side. For benches:

    with ApiCalls() as calls:
        ... runs ...
    print(calls.table(runs=64))
"""

from __future__ import annotations

import collections
import re
import threading
from typing import Any

_ID = re.compile(r"/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ApiCalls:
    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> ApiCalls:
        import httpx
        from prefect.events.clients import PrefectEventsClient

        calls = self

        def counted_send(original):
            def send(client, request, *args, **kwargs):
                calls._note_request(request)
                return original(client, request, *args, **kwargs)

            return send

        def counted_async_send(original):
            async def send(client, request, *args, **kwargs):
                calls._note_request(request)
                return await original(client, request, *args, **kwargs)

            return send

        async def emit(client, event, _original=PrefectEventsClient._emit):
            with calls._lock:
                calls.events[event.event] += 1
            return await _original(client, event)

        for owner, name, wrap in (
            (httpx.Client, "send", counted_send),
            (httpx.AsyncClient, "send", counted_async_send),
        ):
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, wrap(getattr(owner, name)))
        self._undo.append((PrefectEventsClient, "_emit", PrefectEventsClient._emit))
        PrefectEventsClient._emit = emit
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def _note_request(self, request: Any) -> None:
        path = _ID.sub("/{id}", request.url.path)
        with self._lock:
            self.requests[f"{request.method} {path}"] += 1

    def table(self, runs: int) -> str:
        """Return the counts per run, most first."""
        writes = sum(n for k, n in self.requests.items() if not k.startswith("GET"))
        lines = [
            f"per run: {sum(self.requests.values()) / runs:.1f} requests"
            f" ({writes / runs:.1f} writes), {sum(self.events.values()) / runs:.1f} events"
        ]
        for key, count in self.requests.most_common(15):
            lines.append(f"  {count / runs:6.1f}  {key}")
        for key, count in self.events.most_common(8):
            lines.append(f"  {count / runs:6.1f}  event {key}")
        return "\n".join(lines)
