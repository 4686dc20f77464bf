"""Running a job spec through its kind's flow: what `gpuflow run`, `gpuflow render` and
`gpuflow hpc` share. Everything a run needs is checked before any Prefect API is started
when the checks need none; the kind says which flow runs it and what its summary prints."""

from __future__ import annotations

import sys
from typing import Any

from gpuflow import session
from gpuflow.commands.common import EXIT_FAILED, EXIT_OK, invalid, load_job_spec, print_link


def run_job(path: str | dict) -> int:
    """Run a job spec (a path or a dict) through its flow; read and check it first, before
    any API is started when the checks need none."""
    with session.loading():
        from gpuflow.api import checked as checked_spec
        from gpuflow.tasks import placement
        from gpuflow.tasks.errors import InvalidSpec
        from gpuflow.tasks.runscope import run_scope

    with run_scope():  # checked once, blocks and secrets read once, from here to teardown
        try:
            spec = load_job_spec(path)
            checked = not placement.needs_api(spec)
            if checked:
                spec = checked_spec(spec)
        except InvalidSpec as exc:
            return invalid(exc)
        return session.with_api(lambda api: _run_spec(spec, api, checked))


def _run_spec(spec: Any, api: Any, checked: bool) -> int:
    from gpuflow.api import checked as checked_spec
    from gpuflow.api import flow_for
    from gpuflow.tasks.errors import GpuflowError, InvalidSpec

    try:
        spec = spec if checked else checked_spec(spec)
    except InvalidSpec as exc:
        return invalid(exc)
    with session.loading():
        from gpuflow.logrelay import LogRelay
        from gpuflow.outage import OutageWatch, outage_bound_s
        from gpuflow.tasks.pipeline.heartbeat import heartbeats_sent_by_gpuflow

        flow = flow_for(spec)
    with (
        heartbeats_sent_by_gpuflow(),
        session.sentences_on_console(),
        LogRelay(api.url, session.say) as relay,
        OutageWatch(api, session.say, session.fail, outage_bound_s(), relay.spill),
    ):
        state = flow(spec, return_state=True)
    if state.is_completed():
        _print_summary(spec, state.result())
        print_link(api, state)
        return EXIT_OK
    error = state.result(raise_on_failure=False)
    if isinstance(error, InvalidSpec):
        return invalid(error)
    if state.is_cancelled():
        print(f"gpuflow: cancelled: {state.message}", file=sys.stderr)
    else:
        reason = str(error) if isinstance(error, GpuflowError) else (state.message or state.name)
        print(f"gpuflow: {state.name.lower()}: {reason}", file=sys.stderr)
    print_link(api, state, failed=True)
    return EXIT_FAILED


def _print_summary(spec: Any, result: Any) -> None:
    from gpuflow.tasks.kinds.registry import kind_of

    metrics = result.metrics
    print(f"\n{result.name}: completed (preflight {result.preflight})")
    for line in kind_of(spec).summary(metrics.job):
        print(line)
    print(
        f"  duration {metrics.duration_s:.1f} s, {metrics.samples} samples, cost ${metrics.cost_usd:.4f}"
    )
    if metrics.from_log:
        shown = ", ".join(f"{k} {v:g}" for k, v in metrics.from_log.items())
        print(f"  from the job's log ({metrics.from_log_rows} rows), last: {shown}")
    if metrics.note:
        print(f"  note: {metrics.note}")
    print(f"  artifacts: {result.artifacts_dir}")
