"""A Prefect API client that costs half a millisecond to make, not twenty.

Prefect's client builds a new TLS context for every client it makes, reading the whole
CA bundle each time (about 20 ms of CPU), even for an http:// API. gpuflow asks the API
often from threads of their own (render progress, the cancel check, GPU slots), where a
client per call is simplest: this one shares one TLS context per process, built from the
same settings Prefect's would be (PREFECT_API_TLS_INSECURE_SKIP_VERIFY,
PREFECT_API_SSL_CERT_FILE), and rebuilt if they change."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable
from typing import Any

_LOCK = threading.Lock()
_CONTEXTS: dict[tuple[bool, str | None], ssl.SSLContext] = {}


def tls_context() -> ssl.SSLContext:
    """Return the TLS context Prefect's client would build now, made once per setting."""
    import certifi
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    insecure = bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value())
    cert_file = None if insecure else (PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
    key = (insecure, cert_file)
    with _LOCK:
        context = _CONTEXTS.get(key)
        if context is None:
            if insecure:
                context = ssl.create_default_context()
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            else:
                context = ssl.create_default_context(cafile=cert_file)
            _CONTEXTS[key] = context
        return context


def api_client() -> Any:
    """Return a synchronous client of the API in the current settings (a context manager,
    as `prefect.get_client(sync_client=True)`), sharing this process's TLS context."""
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True, httpx_settings={"verify": tls_context()})


def publish(create: Callable[..., Any], **artifact: Any) -> Any:
    """Publish an artifact with `create` (prefect.artifacts' create_* functions) and return
    what it returns; None when the API fails to take it. An artifact is a report beside the
    run, not its result: an API that answers an error or times out (a busy server, many
    runs at once) is a warning that names the artifact and the cause, never the run's
    failure."""
    import httpx

    try:
        return create(**artifact)
    except (httpx.HTTPError, OSError) as exc:  # the API's answer or its absence, not a bug
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        _logger().warning(
            "the artifact %s could not be published (%s); the run goes on without it",
            artifact.get("key", "?"),
            why,
        )
        return None


def emit_run_event(
    event: str, resource: str, name: str, run_id: str, payload: dict[str, Any]
) -> bool:
    """Send Prefect event `event` about `resource` (its id, e.g. gpuflow.run.<id>, named
    `name`), related to flow run `run_id`; False when it could not be sent (the cause is
    logged at debug): an event is a report, never a reason to stop."""
    from prefect.events import emit_event

    try:
        emit_event(
            event=event,
            resource={"prefect.resource.id": resource, "prefect.resource.name": name},
            related=[
                {
                    "prefect.resource.id": f"prefect.flow-run.{run_id}",
                    "prefect.resource.role": "flow-run",
                }
            ],
            payload=payload,
        )
        return True
    except Exception:
        import logging

        logging.getLogger("gpuflow").debug("event %s not sent", event, exc_info=True)
        return False


def _logger() -> Any:
    """Return the run's logger (its lines reach the run's log), else gpuflow's."""
    import logging

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("gpuflow")


def run_log(line: str) -> None:
    """Say `line` in the run's log; outside a run (the checks before it), on stderr."""
    import sys

    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info("%s", line)
    except MissingContextError:
        print(f"[gpuflow] {line}", file=sys.stderr, flush=True)
