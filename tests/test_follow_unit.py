"""The per-unit scaffold every backend shares (tasks/backends/base.py): follow_unit with a
fake handle (its deadline, a cancel, the grace, an end never confirmed, an interruption),
the run verb around a backend's `start`, the log tail, node samples and stopping a child."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpuflow.tasks.backends.base import (
    TAIL_LINES,
    LogTail,
    follow_unit,
    join_samples,
    stop_process,
)
from gpuflow.tasks.contract import Cluster, StopReason, UnitEnd, WorkUnit
from gpuflow.tasks.errors import ProvisionError
from tests.e2e.toy_backend import ToyBackend


class FakeUnit:
    """A unit that ends after `runs_for` polls (never: None), or whose stop ends it at once
    (`stop_ends`), or raises `fails` on its first poll; it records what was asked of it."""

    every_s = 0.0

    def __init__(
        self,
        runs_for: int | None = None,
        stop_ends: bool = True,
        ends_after_stop: int | None = None,
        fails: BaseException | None = None,
    ) -> None:
        self.runs_for, self.stop_ends, self.fails = runs_for, stop_ends, fails
        self.ends_after_stop = ends_after_stop
        self.polls = 0
        self.stopped: list[tuple[StopReason, float]] = []
        self.interrupted: list[float] = []
        self.finished: list[UnitEnd | None] = []

    def poll(self) -> UnitEnd | None:
        self.polls += 1
        if self.fails is not None:
            raise self.fails
        if self.runs_for is not None and self.polls > self.runs_for:
            return UnitEnd(exit_code=3)
        if self.stopped and self.ends_after_stop is not None:
            self.ends_after_stop -= 1
            if self.ends_after_stop < 0:
                return UnitEnd(signal=15)
        return None

    def wait(self, seconds: float) -> None:
        pass

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd | None:
        self.stopped.append((reason, grace_s))
        return UnitEnd(signal=15) if self.stop_ends else None

    def interrupt(self, grace_s: float) -> None:
        self.interrupted.append(grace_s)

    def unconfirmed(self) -> UnitEnd:
        return UnitEnd(signal=9)

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        self.finished.append(end)
        return end


def test_a_unit_that_ends_by_itself_is_not_stopped():
    unit = FakeUnit(runs_for=3)
    end = follow_unit(unit, timeout_s=3600, should_stop=lambda: False, grace_s=5, every_s=0)
    assert end == UnitEnd(exit_code=3) and unit.stopped == [] and unit.polls == 4


def test_past_its_deadline_a_unit_is_stopped_with_its_grace_and_says_timeout():
    unit = FakeUnit()
    end = follow_unit(unit, timeout_s=0, should_stop=None, grace_s=7, every_s=0)
    assert unit.stopped == [(StopReason.TIMEOUT, 7)]
    assert end.signal == 15 and end.stop == StopReason.TIMEOUT


def test_a_stop_check_cancels_the_unit():
    asked = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) >= 2

    unit = FakeUnit()
    end = follow_unit(unit, timeout_s=3600, should_stop=should_stop, grace_s=1, every_s=0)
    assert unit.stopped == [(StopReason.CANCELLED, 1)] and end.stop == StopReason.CANCELLED


def test_a_stop_whose_end_comes_later_is_polled_for_and_keeps_its_reason():
    unit = FakeUnit(stop_ends=False, ends_after_stop=2)
    end = follow_unit(unit, timeout_s=0, should_stop=None, grace_s=60, every_s=0)
    assert end == UnitEnd(signal=15, stop=StopReason.TIMEOUT)
    assert len(unit.stopped) == 1  # stopped once, however long it takes to confirm


def test_an_end_never_confirmed_after_grace_and_confirm_is_the_units_unconfirmed_end():
    unit = FakeUnit(stop_ends=False)
    end = follow_unit(unit, timeout_s=0, should_stop=None, grace_s=0, every_s=0, confirm_s=0)
    assert end == UnitEnd(signal=9, stop=StopReason.TIMEOUT) and len(unit.stopped) == 1


@pytest.mark.parametrize("raised", [KeyboardInterrupt(), ProvisionError("cannot be placed")])
def test_an_interruption_or_an_error_stops_the_unit_with_its_grace_and_propagates(raised):
    unit = FakeUnit(fails=raised)
    with pytest.raises(type(raised)):
        follow_unit(unit, timeout_s=3600, should_stop=None, grace_s=12, every_s=0)
    assert unit.interrupted == [12] and unit.stopped == []


class FakeBackend(ToyBackend):
    """The toy backend whose `start` gives a scripted unit: `run`, written once in
    UnitBackend, is what these tests follow."""

    def __init__(self, unit: FakeUnit, lines: list[str]) -> None:
        self.unit, self.lines = unit, lines

    def start(self, cluster, unit, env, timeout_s, tail):
        for line in self.lines:
            tail("stdout", line)
        return self.unit


def _cluster() -> Cluster:
    from datetime import UTC, datetime

    return Cluster(
        backend="fake",
        name="c",
        owner={},
        hostname="h",
        workspace="/w",
        created_at=datetime.now(UTC),
    )


def test_run_follows_what_start_gave_and_keeps_the_last_lines():
    seen: list[tuple[str, str]] = []
    lines = [f"line {i}" for i in range(TAIL_LINES + 5)]
    unit = FakeUnit(runs_for=1)
    result = FakeBackend(unit, lines).run(
        _cluster(), WorkUnit(name="u", command=["x"]), {}, 60, lambda s, t: seen.append((s, t))
    )
    assert result.exit_code == 3 and not result.timed_out and not result.cancelled
    assert result.log_tail == lines[-TAIL_LINES:] and len(seen) == len(lines)
    assert unit.finished == [UnitEnd(exit_code=3)]


def test_run_finishes_an_interrupted_unit_with_no_end_and_propagates():
    unit = FakeUnit(fails=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        FakeBackend(unit, []).run(
            _cluster(), WorkUnit(name="u", command=["x"]), {}, 60, lambda s, t: None, grace_s=3
        )
    assert unit.interrupted == [3] and unit.finished == [None]


def test_run_says_timed_out_for_a_unit_stopped_at_its_deadline():
    result = FakeBackend(FakeUnit(), ["a"]).run(
        _cluster(), WorkUnit(name="u", command=["x"]), {}, 0, lambda s, t: None
    )
    assert result.timed_out and result.signal == 15 and result.log_tail == ["a"]


def test_a_tail_note_goes_to_stderr_and_into_the_tail():
    seen: list[tuple[str, str]] = []
    tail = LogTail(lambda s, t: seen.append((s, t)))
    tail("stdout", "job line")
    tail.note("node lost")
    assert seen == [("stdout", "job line"), ("stderr", "node lost")]
    assert tail.lines() == ["job line", "node lost"]


def test_node_samples_join_the_runs_each_whole_and_once(tmp_path: Path):
    samples = tmp_path / "samples.jsonl"
    files = []
    for i in range(8):
        files.append(tmp_path / f"node-{i}.jsonl")
        files[-1].write_text(f'{{"node": {i}}}\n' * 50)
    threads = [threading.Thread(target=join_samples, args=(samples, f)) for f in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    join_samples(samples, b'{"node": "mailbox"}')  # bytes without a last newline
    join_samples(samples, tmp_path / "never-written.jsonl")  # nothing, no error
    lines = samples.read_text().splitlines()
    assert len(lines) == 8 * 50 + 1 and lines[-1] == '{"node": "mailbox"}'
    assert not any(f.exists() for f in files)


def test_stop_process_terms_then_kills_a_child_that_ignores_term():
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal,sys,time;signal.signal(signal.SIGTERM,signal.SIG_IGN);"
         "print('ready',flush=True);time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    assert stop_process(child, grace_s=0.2) == -9


def test_stop_process_gives_a_child_that_heeds_term_its_own_end():
    child = subprocess.Popen(["sleep", "60"])
    assert stop_process(child, grace_s=30) == -15
    assert stop_process(child, grace_s=30) == -15  # already ended: its code again
