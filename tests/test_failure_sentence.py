"""The run stage's failure sentence, as a table: what stopped the job, what the diagnosis
table knows of its last lines or its error file, else its code and last lines."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpuflow.tasks.contract import JobResult
from gpuflow.tasks.pipeline.failure import failure_sentence

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def _result(**fields) -> JobResult:
    now = datetime.now(UTC)
    return JobResult(
        **{"exit_code": 0, "started_at": now, "ended_at": now, "duration_s": 1.0} | fields
    )


CASES = [
    # (result fields, stopped_by, error file text, context, the sentence or None)
    ({}, "max_duration", None, {}, None),
    (
        {"exit_code": None, "signal": 15, "timed_out": True},
        "max_duration",
        None,
        {},
        "the job ran past limits.max_duration (90 s) and was stopped; raise"
        " limits.max_duration or make the job shorter.",
    ),
    (
        {"exit_code": None, "signal": 15, "timed_out": True},
        "max_cost_usd",
        None,
        {},
        "the job ran past limits.max_cost_usd (90 s) and was stopped; raise"
        " limits.max_cost_usd or make the job shorter.",
    ),
    (
        {"exit_code": 1, "log_tail": ["step 3", OOM]},
        "max_duration",
        None,
        {"peak_gpu_memory_mib": 80000.0, "batch_size": 512},
        "the job failed (exit 1): the GPU ran out of memory (it tried to allocate 2.00 GiB",
    ),
    (
        {"exit_code": 1, "log_tail": ["step 3"]},
        "max_duration",
        OOM,  # the cause is in the job's error file, not its log
        {},
        "the job failed (exit 1): the GPU ran out of memory",
    ),
    (
        {"exit_code": None, "signal": 9},
        "max_duration",
        None,
        {},
        "the job failed (signal 9): the job was killed by SIGKILL, most often the"
        " out-of-memory killer;",
    ),
    (
        {"exit_code": None, "signal": 11},
        "max_duration",
        None,
        {},
        "the job failed (signal 11): the program crashed (segmentation fault)",
    ),
    (
        {"exit_code": None, "signal": 10},  # a signal the table knows nothing of
        "max_duration",
        None,
        {},
        "the job was killed by signal 10; see the last lines of its log.",
    ),
    (
        {"exit_code": 2},
        "max_duration",
        "ValueError: job.lr must be positive",
        {},
        "the job failed (exit 2): ValueError: job.lr must be positive",
    ),
    (
        {"exit_code": 3, "log_tail": ["a", "b", "c", "d"]},
        "max_duration",
        None,
        {},
        "the job exited with code 3; last lines: b | c | d",
    ),
]


@pytest.mark.parametrize(("fields", "stopped_by", "reason", "context", "expected"), CASES)
def test_the_failure_sentence_of_each_end(fields, stopped_by, reason, context, expected):
    sentence = failure_sentence(_result(**fields), 90.0, stopped_by, reason, context)
    if expected is None:
        assert sentence is None
    else:
        assert sentence is not None and sentence.startswith(expected), sentence


def test_the_out_of_memory_sentence_says_what_the_run_knows():
    sentence = failure_sentence(
        _result(exit_code=1, log_tail=[OOM]),
        90.0,
        "max_duration",
        None,
        {"peak_gpu_memory_mib": 80000.0, "batch_size": 512},
    )
    assert sentence is not None and "512" in sentence and "batch_size" in sentence
