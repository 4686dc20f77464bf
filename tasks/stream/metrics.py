"""A stream session's figures in Prometheus' text format, pushed by its replica to the
run's Pushgateway as the group `stream-REPLICA` every couple of seconds while clients
watch (and once more as each leaves): per client its frame rate, bitrate, dropped
frames, and each phase's p50/p95/p99 milliseconds (capture to display, input to photon,
render, encode, send, decode, draw; the label is `phase`: `stage` names the push group)."""

from __future__ import annotations

from gpuflow.tasks.metrics.prometheus import family
from gpuflow.tasks.stream.model import StreamFigures

QUANTILES = (("0.5", "p50"), ("0.95", "p95"), ("0.99", "p99"))


def exposition(clients: list[StreamFigures], run: dict[str, str]) -> str:
    """Return the text of one replica's push: each of its clients' figures so far."""
    latency = []
    for done in clients:
        stages = {
            "capture_to_display": done.capture_to_display,
            "input_to_photon": done.input_to_photon,
            **done.stages,
        }
        for stage, figures in stages.items():
            for quantile, field in QUANTILES:
                value = getattr(figures, field)
                if value is not None:
                    labels = run | {"client": done.client, "phase": stage, "quantile": quantile}
                    latency.append((labels, value))
    lines = [
        *family(
            "gpuflow_stream_clients",
            "Clients the replica streamed to (connected now or gone).",
            "gauge",
            [(run, len(clients))],
        ),
        *family(
            "gpuflow_stream_fps",
            "Frames per second shown on the client's page.",
            "gauge",
            [(run | {"client": c.client}, c.fps) for c in clients],
        ),
        *family(
            "gpuflow_stream_bitrate_kbps",
            "The client's stream, in kbit/s.",
            "gauge",
            [(run | {"client": c.client}, c.bitrate_kbps) for c in clients],
        ),
        *family(
            "gpuflow_stream_dropped_frames_total",
            "Frames not sent (the client was behind) or not shown (a newer one was).",
            "counter",
            [(run | {"client": c.client}, c.dropped) for c in clients],
        ),
        *family(
            "gpuflow_stream_latency_ms",
            "Milliseconds per frame by phase (label phase: capture_to_display, input_to_photon, render,"
            " encode, send, decode, draw), on the page's clock.",
            "gauge",
            latency,
        ),
    ]
    return "\n".join(lines) + "\n"
