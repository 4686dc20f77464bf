"""Slots of the Prefect global concurrency limit `gpu`, held with a lease.

The lease is taken through the client directly (not `concurrency()`), because it
must outlive the provision task and be released by teardown, possibly in another
process. If the orchestrator dies the lease expires and the slots come back.
"""

from __future__ import annotations

import logging
import threading
import time
from uuid import UUID

from gpuflow.tasks.api_client import api_client
from gpuflow.tasks.errors import CapacityError, ProvisionError, TransientError

LIMIT_NAME = "gpu"
LEASE_SECONDS = 120.0
logger = logging.getLogger(__name__)
_renewers: dict[str, threading.Event] = {}


def limit_exists() -> bool:
    """Return True when the Prefect API has a global concurrency limit named `gpu`."""
    from prefect.exceptions import ObjectNotFound

    with api_client() as client:
        try:
            client.read_global_concurrency_limit_by_name(LIMIT_NAME)
            return True
        except ObjectNotFound:
            return False


def acquire(slots: int, wait_s: float, strict: bool, holder_run_id: str | None) -> str | None:
    """Return a lease id for `slots` GPU slots, or None when no `gpu` limit exists (not strict).

    Waits up to `wait_s` for free slots, then raises CapacityError (retryable).
    """
    import httpx

    deadline = time.monotonic() + wait_s
    body_holder = None
    if holder_run_id:
        from prefect.client.schemas.objects import ConcurrencyLeaseHolder

        try:
            body_holder = ConcurrencyLeaseHolder(type="flow_run", id=UUID(holder_run_id))
        except ValueError:
            body_holder = None  # not a flow run id (a run outside Prefect's engine)
    with api_client() as client:
        while True:
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=[LIMIT_NAME],
                    slots=slots,
                    mode="concurrency",
                    lease_duration=LEASE_SECONDS,
                    holder=body_holder,
                )
            except httpx.HTTPStatusError as exc:
                status = exc.response.status_code
                if status == 423:
                    retry_after = float(exc.response.headers.get("Retry-After", "1") or 1)
                    if time.monotonic() + retry_after > deadline:
                        raise CapacityError(
                            f"all slots of the Prefect concurrency limit '{LIMIT_NAME}' are taken;"
                            " wait for other GPU runs to finish or raise the limit"
                        ) from None
                    time.sleep(min(retry_after, 5.0))
                    continue
                if status == 422:
                    raise ProvisionError(
                        f"the Prefect concurrency limit '{LIMIT_NAME}' is smaller than the {slots}"
                        f" GPUs asked for; raise it with `prefect gcl update {LIMIT_NAME} --limit N`"
                    ) from None
                raise TransientError(
                    f"the Prefect API refused the GPU slot request ({status})"
                ) from None
            except httpx.TransportError as exc:
                raise TransientError(
                    f"could not reach the Prefect API for GPU slots: {exc}"
                ) from None
            payload = response.json()
            if not payload.get("limits"):
                if strict:
                    raise ProvisionError(
                        f"the Prefect concurrency limit '{LIMIT_NAME}' does not exist; create it with"
                        f" `prefect gcl create {LIMIT_NAME} --limit N` or unset strict_gpu_limit"
                    )
                return None
            lease_id = str(payload["lease_id"])
            _start_renewer(lease_id)
            return lease_id


def _start_renewer(lease_id: str) -> None:
    stop = threading.Event()
    _renewers[lease_id] = stop

    def renew() -> None:
        with api_client() as client:
            while not stop.wait(LEASE_SECONDS / 3):
                try:
                    client.renew_concurrency_lease(UUID(lease_id), lease_duration=LEASE_SECONDS)
                except Exception as exc:
                    logger.warning("renewing GPU slot lease %s failed: %s", lease_id, exc)

    threading.Thread(target=renew, name=f"gpu-lease-{lease_id[:8]}", daemon=True).start()


def release(lease_id: str) -> bool:
    """Release the lease's slots; return False when it was already gone."""
    stop = _renewers.pop(lease_id, None)
    if stop is not None:
        stop.set()
    import httpx

    with api_client() as client:
        try:
            client.release_concurrency_slots_with_lease(UUID(lease_id))
            return True
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 404:
                return False
            raise


def slots_in_use() -> int | None:
    """Return the `gpu` limit's active slots as the API sees them (None: no such limit)."""
    from prefect.exceptions import ObjectNotFound

    with api_client() as client:
        try:
            return client.read_global_concurrency_limit_by_name(LIMIT_NAME).active_slots
        except ObjectNotFound:
            return None
