"""Prometheus text exposition in dcgm-exporter's names and labels, and a Pushgateway push."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from tasks.errors import TransientError
from tasks.metrics.sampler import GPU_FIELDS
from tasks.metrics.summary import RunMetrics

_HELP = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "Total energy consumption since boot (in mJ).",
}
_TYPES = {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter"}
_SUMMARY = {
    "gpuflow_run_duration_seconds": ("duration_s", "Wall time of the job."),
    "gpuflow_run_gpu_hours": ("gpu_hours", "GPUs held times hours."),
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


def exposition(
    last_sample: dict[str, Any] | None, summary: RunMetrics, flow_run_id: str, job: str
) -> str:
    """Return the Prometheus text format for the last GPU sample and the run's summary."""
    lines: list[str] = []
    gpus = last_sample["gpus"] if last_sample else []
    host = last_sample["Hostname"] if last_sample else ""
    for field in GPU_FIELDS:
        rows = [g for g in gpus if field in g]
        if not rows:
            continue
        lines += [f"# HELP {field} {_HELP[field]}", f"# TYPE {field} {_TYPES.get(field, 'gauge')}"]
        for gpu in rows:
            labels = {
                "gpu": gpu["gpu"],
                "UUID": gpu["UUID"],
                "modelName": gpu["modelName"],
                "Hostname": host,
                "flow_run_id": flow_run_id,
                "job": job,
            }
            lines.append(f"{field}{_labels(labels)} {gpu[field]}")
    for name, (attr, help_text) in _SUMMARY.items():
        value = getattr(summary, attr)
        if value is None:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        lines.append(f"{name}{_labels({'flow_run_id': flow_run_id, 'job': job})} {float(value)}")
    return "\n".join(lines) + "\n"


def push(gateway: str, text: str, flow_run_id: str, job: str, timeout_s: float = 10.0) -> str:
    """PUT `text` to the Pushgateway group job/<job>/flow_run_id/<id>; return the group URL."""
    quote = urllib.parse.quote
    url = f"{gateway.rstrip('/')}/metrics/job/{quote(job, safe='')}/flow_run_id/{quote(flow_run_id, safe='')}"
    request = urllib.request.Request(
        url, data=text.encode(), method="PUT", headers={"Content-Type": "text/plain; version=0.0.4"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if response.status >= 300:
                raise TransientError(f"the Pushgateway at {gateway} answered {response.status}")
    except urllib.error.HTTPError as exc:
        raise TransientError(
            f"the Pushgateway at {gateway} refused the metrics ({exc.code}): {exc.read()[:200]!r}"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise TransientError(f"could not reach the Pushgateway at {gateway}: {exc}") from None
    return url
