"""What a training run shows: a loss and throughput curve, its final numbers, its links."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuflow.tasks.metrics.plot import figure
from gpuflow.tasks.outputs import read_result
from gpuflow.tasks.pictures import picture
from gpuflow.tasks.training.profile import PROFILE_DIR, read
from gpuflow.tasks.training.result import TrainResult


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Return one row per step: the train record and the eval record of a step merged (a
    resumed run logs some steps again; the later record wins)."""
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def curve_png(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Draw loss, eval loss (and top-1 accuracy) and samples/s against step; None for
    fewer than 2 training points."""
    train = [r for r in rows if "loss" in r]
    if len(train) < 2:
        return None
    steps = [r["step"] for r in train]
    fig = figure(8, 6)
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    handles = loss_ax.plot(steps, [r["loss"] for r in train], label="train loss")
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if evals:
        handles += loss_ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    accuracy = [(r["step"], 100 * r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    if accuracy:
        acc_ax = loss_ax.twinx()
        handles += acc_ax.plot(
            *zip(*accuracy, strict=True), "s--", color="tab:red", label="eval top-1 accuracy %"
        )
        acc_ax.set_ylabel("accuracy %")
        acc_ax.set_ylim(0, 100)
    loss_ax.set_ylabel("loss")
    loss_ax.legend(handles=handles, loc="best")
    loss_ax.set_title(title)
    speed_ax.plot(steps, [r["samples_per_s"] for r in train], color="tab:green")
    speed_ax.set_ylabel("samples/s")
    speed_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    return path


def summary(outputs: Path, out_dir: Path, title: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Return table rows and markdown lines for a finished (or stopped) training run."""
    rows_in = read_metrics(outputs / "train_metrics.jsonl")
    png = curve_png(rows_in, out_dir / "training.png", title)
    result = read_result(outputs / "result.json", TrainResult)
    rows, lines = [], []
    train = [r for r in rows_in if "loss" in r]
    if train:
        rows += [
            {"metric": "train.final_loss", "value": train[-1]["loss"]},
            {"metric": "train.last_step", "value": train[-1]["step"]},
        ]
    evals = [r for r in rows_in if "eval_loss" in r]
    if evals:
        last = evals[-1]
        rows += [
            {"metric": "train.eval_loss", "value": last["eval_loss"]},
            {"metric": "train.eval_step", "value": last["step"]},
        ]
        score = f"eval loss {last['eval_loss']:.4f}"
        if "eval_accuracy" in last:
            rows.append({"metric": "train.eval_accuracy", "value": last["eval_accuracy"]})
            score += f", top-1 accuracy {100 * last['eval_accuracy']:.1f}%"
        lines.append(f"- {score} at step {last['step']} ({len(evals)} evaluation(s))")
    if png:
        lines.append(picture("loss and throughput curve", png))
    if result is not None and result.weights:
        lines.append(f"- final weights: {result.weights} (manifest {result.weights_manifest})")
        lines.append(f"- checkpoints: {result.checkpoints}")
    lines += profile_lines(outputs, out_dir)
    return rows, lines


def profile_lines(outputs: Path, out_dir: Path) -> list[str]:
    """Return what a profiled run's summary says: the steps' split and where the trace is."""

    profiled = read(outputs)
    if profiled is None:
        return []
    ops, steps = profiled
    trace = out_dir / "outputs" / PROFILE_DIR / "trace.json"
    if not trace.is_file():
        trace = outputs / PROFILE_DIR / "trace.json"
    wait = sum(s["data_wait_ms"] for s in steps)
    compute = sum(s["compute_ms"] for s in steps)
    share = 100 * wait / (wait + compute) if wait + compute else 0.0
    lines = [
        f"- profile of {len(steps)} step(s): data wait {wait:.1f} ms ({share:.0f}%), compute"
        f" {compute:.1f} ms; trace `{trace}` (open it in Perfetto)"
    ]
    if ops:
        lines.append(
            f"- top operator by self time: {ops[0]['operator']} ({ops[0]['self_cpu_ms']} ms CPU)"
        )
    return lines
