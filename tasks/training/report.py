"""What a training run shows: a loss and throughput curve, its final numbers, its links."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step = {row["step"]: row for row in rows}  # a resumed run logs some steps again
    return [by_step[s] for s in sorted(by_step)]


def curve_png(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Draw loss (and eval loss) and samples/s against step; None for fewer than 2 points."""
    if len(rows) < 2:
        return None
    steps = [r["step"] for r in rows]
    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 6), dpi=100, sharex=True)
    loss_ax.plot(steps, [r["loss"] for r in rows], label="train loss")
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if evals:
        loss_ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    loss_ax.set_title(title)
    speed_ax.plot(steps, [r["samples_per_s"] for r in rows], color="tab:green")
    speed_ax.set_ylabel("samples/s")
    speed_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def summary(outputs: Path, out_dir: Path, title: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Return table rows and markdown lines for a finished (or stopped) training run."""
    rows_in = read_metrics(outputs / "train_metrics.jsonl")
    png = curve_png(rows_in, out_dir / "training.png", title)
    result_path = outputs / "result.json"
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    rows, lines = [], []
    if rows_in:
        last = rows_in[-1]
        rows += [
            {"metric": "train.final_loss", "value": last["loss"]},
            {"metric": "train.last_step", "value": last["step"]},
        ]
        if last.get("eval_loss") is not None:
            rows.append({"metric": "train.eval_loss", "value": last["eval_loss"]})
    if png:
        lines.append(f"- loss and throughput curve: `{png}`")
    if result.get("weights"):
        lines.append(
            f"- final weights: {result['weights']} (manifest {result['weights_manifest']})"
        )
        lines.append(f"- checkpoints: {result['checkpoints']}")
    return rows, lines
