"""Submit a deployment run from CI and say how it ended, with distinct exit codes:
0 completed; 1 failed, crashed or cancelled; 2 invalid input (unknown deployment or
parameter, a job spec that does not validate); 3 still running when the wait timed out.
`prefect deployment run --watch` exits 1 both for a failure and for a timeout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from gpuflow.tasks import yamlfile
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline import plugins as _plugins  # noqa: F401 - kinds and backends are read
from gpuflow.tasks.spec import load_spec

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_TIMEOUT = 0, 1, 2, 3


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """Return parameters from k=v pairs: v as JSON when it parses, @file as YAML/JSON from
    that file, else the plain string."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise InvalidSpec(f"--param {pair!r}: write name=value (value may be JSON or @file)")
        if raw.startswith("@"):
            try:
                params[key] = yamlfile.read(Path(raw[1:]), "a YAML or JSON file")
            except InvalidSpec as exc:
                raise InvalidSpec(f"--param {key}: {exc}") from None
            continue
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def ui_link(flow_run_id: Any) -> str:
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value() or "(no UI URL set)"
    return f"{base}/runs/flow-run/{flow_run_id}"


def _complain(message: str) -> None:
    print(message, file=sys.stderr)


def submit(
    name: str,
    params: dict[str, Any],
    wait: bool,
    timeout_s: float,
    say: Any = print,
    complain: Any = _complain,
) -> int:
    """Start a run of deployment `name` (flow-name/deployment-name) with `params` over its
    defaults; with `wait`, follow it until it ends or `timeout_s` passes."""
    from prefect.exceptions import ObjectNotFound

    from gpuflow.tasks.api_client import api_client

    with api_client() as client:
        try:
            deployment = client.read_deployment_by_name(name)
        except (ObjectNotFound, ValueError):
            complain(
                f"gpuflow: invalid input: deployment {name!r} does not exist; `prefect"
                " deployment ls` lists them (names are flow-name/deployment-name)"
            )
            return EXIT_INVALID
        accepted = set((deployment.parameter_openapi_schema or {}).get("properties", {}))
        unknown = sorted(set(params) - accepted)
        if unknown:
            complain(
                f"gpuflow: invalid input: {unknown[0]!r} is not a parameter of {name}; it takes"
                f" {', '.join(sorted(accepted)) or 'none'}"
            )
            return EXIT_INVALID
        if "spec" in params:
            try:
                load_spec(params["spec"])
            except InvalidSpec as exc:
                complain(f"gpuflow: invalid input: spec: {exc}")
                return EXIT_INVALID
        run = client.create_flow_run_from_deployment(deployment.id, parameters=params)
        say(f"submitted {name}: flow run {run.name} ({run.id})\n  {ui_link(run.id)}")
        if not wait:
            return EXIT_OK
        deadline = time.monotonic() + timeout_s
        state = run.state
        while time.monotonic() < deadline:
            state = client.read_flow_run(run.id).state
            if state is not None and state.is_final():
                break
            time.sleep(1.0)
        else:
            complain(
                f"gpuflow: timed out after {timeout_s:.0f} s; the run is still"
                f" {state.name if state else 'pending'}: {ui_link(run.id)}"
            )
            return EXIT_TIMEOUT
    if state.is_completed():
        say(f"completed: {run.name}")
        return EXIT_OK
    complain(f"gpuflow: {state.name.lower()}: {state.message or ''} {ui_link(run.id)}".rstrip())
    return EXIT_FAILED
