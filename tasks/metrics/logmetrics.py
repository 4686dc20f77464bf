"""A job's own figures, read from its output lines (spec `metrics.from_log`): each regex
with named groups that matches a line makes a row of numbers (`step`, `loss`, ...), kept
on this machine as they come (`rows_file`), pushed live to a Pushgateway when one is set, and
drawn, tabled and summed up at collect.

Patterns are matched by the `regex` engine (the syntax of Python's `re`) with a time bound
per line, on the line's first LINE_CHARS characters: a pattern that backtracks without end
('(a+)+$' on 'aaaa…!') is turned off for the run with one sentence in its log, instead of
holding the interpreter (Python's `re` can be stopped by nothing, Ctrl-C included)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import regex

from gpuflow.tasks.host import gpuflow_home, make_dirs

LOG_METRICS = "log_metrics.jsonl"  # its name among the run's artifacts
STEP_NAMES = ("step", "iteration", "iter", "epoch", "batch")  # drawn along x when captured
TABLE_ROWS = 500  # the most rows the table artifact shows (the file keeps every one)
LINE_CHARS = 4096  # the most of one line a pattern sees
MATCH_BOUND_S = 0.25  # the most one pattern may take on one line before it is turned off


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None


class LogMetrics:
    """A line sink: rows of figures from the lines its regexes match, into `path`
    (JSON lines, `t`: seconds since the run stage began), the newest value of each
    figure in `last`; `push` (throttled by the caller) gets `last` after each row."""

    def __init__(
        self,
        patterns: list[str],
        path: Path,
        push: Callable[[dict[str, float]], None] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.patterns: list[regex.Pattern[str] | None] = [regex.compile(p) for p in patterns]
        self.path, self.push, self.warn = path, push, warn
        self.last: dict[str, float] = {}
        self.rows = 0
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        line = line[:LINE_CHARS]
        for index, pattern in enumerate(self.patterns):
            if pattern is None:
                continue
            try:
                found = pattern.search(line, timeout=MATCH_BOUND_S)
            except TimeoutError:
                self.patterns[index] = None
                if self.warn is not None:
                    self.warn(
                        f"metrics.from_log[{index}] {pattern.pattern!r} took over"
                        f" {MATCH_BOUND_S:g} s on one line of the job's output and is off for"
                        " the rest of this run; rewrite it without nested repeats such as"
                        " (a+)+ or (a|aa)+."
                    )
                continue
            if found is None:
                continue
            row = {
                name: value
                for name, text in found.groupdict().items()
                if (value := _number(text)) is not None
            }
            if not row:
                continue
            with self._lock:
                self.last.update(row)
                self.rows += 1
                with open(self.path, "a") as out:
                    t = round(time.monotonic() - self._started, 3)
                    out.write(json.dumps({"t": t, **row}) + "\n")
                last = dict(self.last)
            if self.push is not None:
                self.push(last)


def rows_file(flow_run_id: str) -> Path:
    """Return where a run's rows are kept on this machine until collect takes them."""
    return make_dirs(gpuflow_home() / "log-metrics") / f"{flow_run_id}.jsonl"


def read_rows(path: Path) -> list[dict[str, float]]:
    """Return the rows a run's LogMetrics kept (none when it kept none)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short when the run stage was stopped
    return rows


def last_values(rows: list[dict[str, float]]) -> dict[str, float]:
    """Return the newest value of each figure over `rows`."""
    last: dict[str, float] = {}
    for row in rows:
        last.update({k: v for k, v in row.items() if k != "t"})
    return last


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the rows for a table artifact: every row up to TABLE_ROWS, else evenly
    spaced ones, the last always in; each with every column any row has, in the order
    they first came (None where a row has none: the UI takes its columns from one row)."""
    if len(rows) > TABLE_ROWS:
        step = len(rows) / (TABLE_ROWS - 1)
        rows = [rows[int(i * step)] for i in range(TABLE_ROWS - 1)] + [rows[-1]]
    columns = list(dict.fromkeys(name for row in rows for name in row))
    return [{name: row.get(name) for name in columns} for row in rows]


def curves_png(rows: list[dict[str, float]], path: Path, title: str) -> Path | None:
    """Draw each figure of `rows` (one panel each) along its step figure, or the time;
    None for fewer than 2 rows."""
    if len(rows) < 2:
        return None
    from gpuflow.tasks.metrics.plot import figure

    names = list(dict.fromkeys(k for row in rows for k in row if k != "t"))
    x_name = next((n for n in STEP_NAMES if n in names), "t")
    drawn = [n for n in names if n != x_name][:6] or names[:1]
    fig = figure(8, 2.2 * len(drawn))
    axes = fig.subplots(len(drawn), 1, squeeze=False)
    for ax, name in zip(axes[:, 0], drawn, strict=True):
        points = [(row[x_name], row[name]) for row in rows if x_name in row and name in row]
        if points:
            ax.plot(*zip(*points, strict=True), marker="." if len(points) < 50 else None)
        ax.set_ylabel(name)
    axes[-1, 0].set_xlabel("seconds since start" if x_name == "t" else x_name)
    axes[0, 0].set_title(f"{title}: from the job's log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
