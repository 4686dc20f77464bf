"""The flow run's heartbeat, sent by gpuflow for runs it starts in this process.

Prefect's engine sends `prefect.flow-run.heartbeat` from a thread that sleeps in 1 s
steps and is joined when the flow body returns: every run it starts ends up to a second
late. A command that runs a job's flow here (`gpuflow run`, the demos, the benches)
turns Prefect's off for that flow with `heartbeats_sent_by_gpuflow()`, and the job's
stages send the same event at the same interval from a thread that stops at once
(`flow_run_heartbeat()`), so the server's crashed-run detection sees no difference.
A flow run started any other way (a worker, a direct call) keeps Prefect's own."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator

# The interval Prefect's heartbeat had before gpuflow took it over; None: not taken over.
_EVERY_S: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "gpuflow_heartbeat_every_s", default=None
)
_LOG = logging.getLogger(__name__)
THREAD_NAME = "gpuflow-flow-heartbeat"


@contextlib.contextmanager
def heartbeats_sent_by_gpuflow() -> Iterator[None]:
    """Run a flow called inside with Prefect's heartbeat off and gpuflow's on, at the
    interval the settings give Prefect's (nothing changes when they turn it off)."""
    from prefect.context import SettingsContext, get_settings_context
    from prefect.flow_engine import MINIMUM_HEARTBEAT_INTERVAL

    outer = get_settings_context()
    every_s = outer.settings.flows.heartbeat_frequency
    if every_s is None:
        yield
        return
    # The same settings with Prefect's heartbeat off, copied: Prefect's temporary_settings
    # would build them again from every source (the profiles file, ./pyproject.toml),
    # which cost each of 64 runs started at once in one process most of their start.
    flows = outer.settings.flows.model_copy(update={"heartbeat_frequency": None})
    quiet = outer.settings.model_copy(update={"flows": flows})
    token = _EVERY_S.set(max(every_s, MINIMUM_HEARTBEAT_INTERVAL))
    try:
        with SettingsContext(profile=outer.profile, settings=quiet):
            yield
    finally:
        _EVERY_S.reset(token)


@contextlib.contextmanager
def flow_run_heartbeat() -> Iterator[None]:
    """Send the current flow run's heartbeat every interval while the block runs, when
    `heartbeats_sent_by_gpuflow()` turned Prefect's off for it; stops as the block ends."""
    every_s = _EVERY_S.get()
    event = _heartbeat_event() if every_s is not None else None
    if event is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        from prefect.events import emit_event

        while not stop.is_set():
            try:
                emit_event(**event)
            except Exception:  # a lost heartbeat is Prefect's to notice, not the job's
                _LOG.debug("flow run heartbeat not sent", exc_info=True)
            stop.wait(every_s)

    thread = threading.Thread(
        target=contextvars.copy_context().run, args=(beat,), daemon=True, name=THREAD_NAME
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _heartbeat_event() -> dict | None:
    """Return the heartbeat event of the flow run in progress, as Prefect's engine builds
    it (the run, its flow, deployment and tags); None outside a flow run."""
    from prefect import __version__
    from prefect.context import FlowRunContext
    from prefect.events.related import tags_as_related_resources
    from prefect.events.schemas.events import RelatedResource

    context = FlowRunContext.get()
    run = context.flow_run if context else None
    if run is None:
        return None
    related = [
        RelatedResource.model_validate(
            {
                "prefect.resource.id": f"prefect.flow.{run.flow_id}",
                "prefect.resource.role": "flow",
                "prefect.resource.name": context.flow.name if context and context.flow else "",
            }
        )
    ]
    if run.deployment_id:
        related.append(
            RelatedResource.model_validate(
                {
                    "prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                    "prefect.resource.role": "deployment",
                }
            )
        )
    related += tags_as_related_resources(set(run.tags or []))
    return {
        "event": "prefect.flow-run.heartbeat",
        "resource": {
            "prefect.resource.id": f"prefect.flow-run.{run.id}",
            "prefect.resource.name": run.name or "",
            "prefect.version": __version__,
        },
        "related": related,
    }
