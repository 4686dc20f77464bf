"""Prometheus text exposition in dcgm-exporter's names and labels, and Pushgateway pushes.

Pushes go to two groups per run: stage="run" holds the live samples while the job
runs and is deleted when the run is collected; stage="summary" holds the run's totals.
A stage="run" group that stops being pushed means a run died without teardown.
"""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gpuflow.tasks.errors import TransientError
from gpuflow.tasks.metrics.sampler import GPU_FIELDS
from gpuflow.tasks.metrics.summary import RunMetrics

_HELP = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "Total energy consumption since boot (in mJ).",
}
_TYPES = {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter"}
_HOST = {
    "gpuflow_host_cpu_percent": ("cpu_percent", "Host CPU utilization (in %)."),
    "gpuflow_host_memory_used_bytes": ("memory_used_bytes", "Host memory used."),
}
_SUMMARY = {
    "gpuflow_run_duration_seconds": ("duration_s", "Wall time of the job."),
    "gpuflow_run_gpu_hours": ("gpu_hours", "GPUs held times hours."),
    "gpuflow_run_gpu_hours_idle": ("gpu_hours_idle", "GPU-hours held under 5% utilization."),
    "gpuflow_run_cost_usd": ("cost_usd", "Cost of the resources held for the job."),
    "gpuflow_run_gpu_util_mean": ("gpu_util_mean", "Mean GPU utilization over the run (in %)."),
    "gpuflow_run_gpu_memory_peak_mib": ("gpu_memory_peak_mib", "Peak framebuffer used (in MiB)."),
    "gpuflow_run_energy_joules": ("energy_j", "GPU energy used by the run (in J)."),
    "gpuflow_run_host_cpu_mean": ("host_cpu_mean", "Mean host CPU utilization (in %)."),
    "gpuflow_run_host_memory_peak_bytes": ("host_memory_peak_bytes", "Peak host memory used."),
}


def _labels(labels: dict[str, Any]) -> str:
    def esc(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def family(name: str, help_text: str, kind: str, rows: list[tuple[dict, float]]) -> list[str]:
    """Return one metric family in the text format: its HELP, TYPE and a line per row."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    return lines + [f"{name}{_labels(labels)} {float(value)}" for labels, value in rows]


def exposition(
    sample: dict[str, Any] | None,
    summary: RunMetrics | None,
    flow_run_id: str,
    job: str,
    outcome: str | None = None,
) -> str:
    """Return the Prometheus text format for a sample (GPUs and host) and/or a run summary
    (with `outcome`, "completed" or "failed", as gpuflow_run_outcome)."""
    lines: list[str] = []
    run = {"flow_run_id": flow_run_id, "job": job}
    if sample:
        host = sample["Hostname"]
        for field in GPU_FIELDS:
            rows = [
                (
                    {
                        "gpu": g["gpu"],
                        "UUID": g["UUID"],
                        "modelName": g["modelName"],
                        "Hostname": host,
                    }
                    | run,
                    g[field],
                )
                for g in sample["gpus"]
                if field in g
            ]
            if rows:
                lines += family(field, _HELP[field], _TYPES.get(field, "gauge"), rows)
        for name, (key, help_text) in _HOST.items():
            lines += family(
                name, help_text, "gauge", [({"Hostname": host} | run, sample["host"][key])]
            )
    if summary:
        for name, (attr, help_text) in _SUMMARY.items():
            value = getattr(summary, attr)
            if value is not None:
                lines += family(name, help_text, "gauge", [(run, value)])
        lines += log_figures(summary.from_log, run)
        if outcome is not None:
            lines += family(
                "gpuflow_run_outcome",
                "1 for the way the run ended (label outcome: completed or failed).",
                "gauge",
                [(run | {"outcome": outcome}, 1)],
            )
    return "\n".join(lines) + "\n"


def log_figures(figures: dict[str, float], run: dict[str, str]) -> list[str]:
    """Return the family of a job's own figures (metrics.from_log), one series per name."""
    if not figures:
        return []
    return family(
        "gpuflow_job_metric",
        "A figure the job printed, read by metrics.from_log (label name: its group's name).",
        "gauge",
        [(run | {"name": name}, value) for name, value in sorted(figures.items())],
    )


def group_url(gateway: str, job: str, flow_run_id: str, stage: str) -> str:
    """Return the Pushgateway URL of one run's group for `stage` ("run" or "summary")."""
    quote = urllib.parse.quote
    return (
        f"{gateway.rstrip('/')}/metrics/job/{quote(job, safe='')}"
        f"/flow_run_id/{quote(flow_run_id, safe='')}/stage/{stage}"
    )


def without_credentials(url: str) -> tuple[str, dict[str, str]]:
    """Return `url` without a user:password part, and the Basic authorization header that
    carries it instead (none without one): error text names the bare URL only."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, {}
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    bare = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return bare, {"Authorization": f"Basic {token}"}


def _send(url: str, method: str, body: bytes | None, timeout_s: float) -> None:
    url, auth = without_credentials(url)
    headers = {"Content-Type": "text/plain; version=0.0.4"} if body is not None else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers | auth)
    gateway = url.split("/metrics/", 1)[0]
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            pass
    except urllib.error.HTTPError as exc:
        raise TransientError(
            f"the Pushgateway at {gateway} refused the metrics ({exc.code}): {exc.read()[:200]!r}"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise TransientError(f"could not reach the Pushgateway at {gateway}: {exc}") from None


def push(gateway: str, text: str, flow_run_id: str, job: str, stage: str = "summary") -> str:
    """PUT `text` as the run's `stage` group (replacing it); return the group URL."""
    url = group_url(gateway, job, flow_run_id, stage)
    _send(url, "PUT", text.encode(), timeout_s=10.0)
    return url


def delete(gateway: str, flow_run_id: str, job: str, stage: str = "run") -> None:
    """Delete the run's `stage` group (the live samples once the run is over)."""
    _send(group_url(gateway, job, flow_run_id, stage), "DELETE", None, timeout_s=10.0)


class LivePush:
    """Sampler callback: pushes the newest sample every `interval_s`; failures are logged
    once and never stop the job."""

    def __init__(self, gateway: str, flow_run_id: str, job: str, interval_s: float, warn) -> None:
        self.gateway, self.flow_run_id, self.job = gateway, flow_run_id, job
        self.interval_s = interval_s
        self.warn = warn
        self.pushes = 0
        self._last = 0.0
        self._warned = False

    stage = "run"  # the run's group it replaces

    def text(self, sample: dict[str, Any]) -> str:
        return exposition(sample, None, self.flow_run_id, self.job)

    def __call__(self, sample: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        try:
            push(self.gateway, self.text(sample), self.flow_run_id, self.job, self.stage)
            self.pushes += 1
        except TransientError as exc:
            if not self._warned:
                self._warned = True
                self.warn("live metrics not pushed: %s", exc)


class LiveLogPush(LivePush):
    """Line-sink callback: pushes the newest of the job's own figures (metrics.from_log)
    every `interval_s` as the run's `log` group."""

    stage = "log"

    def text(self, sample: dict[str, Any]) -> str:
        run = {"flow_run_id": self.flow_run_id, "job": self.job}
        return "\n".join(log_figures(sample, run)) + "\n"
