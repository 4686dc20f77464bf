"""The job's own figures (metrics.from_log): a pattern that backtracks without end is
turned off with one sentence instead of holding gpuflow; lines are cut before matching."""

import json
import threading

from gpuflow.tasks.metrics.logmetrics import LINE_CHARS, LogMetrics


def test_a_pattern_that_never_ends_is_turned_off_and_the_others_go_on(tmp_path):
    said: list[str] = []
    rows = tmp_path / "rows.jsonl"
    read = LogMetrics([r"^(?P<x>a|aa)+$", r"loss (?P<loss>[\d.]+)"], rows, warn=said.append)
    done = threading.Event()

    def feed() -> None:
        read("a" * 40 + "!")  # 2**40 ways to split: Python's re would take hours
        read("a" * 40 + "!")  # the pattern is off now: no second wait
        read("step 3 loss 0.25")
        done.set()

    threading.Thread(target=feed, daemon=True).start()
    assert done.wait(120), "a pattern without end held the line reader"
    assert said == [
        "metrics.from_log[0] '^(?P<x>a|aa)+$' took over 0.25 s on one line of the job's"
        " output and is off for the rest of this run; rewrite it without nested repeats such"
        " as (a+)+ or (a|aa)+."
    ]
    assert read.last == {"loss": 0.25}
    assert [json.loads(line)["loss"] for line in rows.read_text().splitlines()] == [0.25]


def test_only_the_start_of_a_long_line_is_read(tmp_path):
    read = LogMetrics([r"loss (?P<loss>[\d.]+)"], tmp_path / "rows.jsonl")
    read("loss 1.5 " + "x" * 10 * LINE_CHARS)
    read("x" * LINE_CHARS + " loss 2.5")  # past the cut: not a figure
    assert read.last == {"loss": 1.5} and read.rows == 1
