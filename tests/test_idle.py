"""IdleWatch on sample sequences: when a job's GPUs count as idle, and how often it says so."""

from __future__ import annotations

from gpuflow.tasks.metrics.idle import IdleWatch, watch_of
from gpuflow.tasks.spec import IdleGpu


def _watch(action: str = "warn", for_s: float = 10.0):
    said, sent = [], []
    watch = IdleWatch(
        IdleGpu(below_pct=5, **{"for": for_s}, action=action),
        "run-1",
        "job",
        lambda fmt, *args: said.append(fmt % args),
        sent.append,
    )
    return watch, said, sent


def _sample(t: float, *utils: float) -> dict:
    return {
        "t": t,
        "Hostname": "h",
        "gpus": [{"gpu": i, "DCGM_FI_DEV_GPU_UTIL": u} for i, u in enumerate(utils)],
    }


def test_idle_for_the_window_warns_once_and_stop_asks_to_stop():
    watch, said, sent = _watch("stop")
    for t in range(0, 30):
        watch(_sample(float(t), 1.0, 0.0))
    assert len(said) == len(sent) == 1
    assert sent[0]["idle_s"] == 10.0 and sent[0]["gpus"] == [0, 1]
    assert watch.stopped()
    assert "its GPUs (0, 1) were under 5% busy for 10 s" in watch.sentence()


def test_a_busy_gpu_keeps_the_job_busy_and_rearms_the_watch():
    watch, said, _ = _watch()
    for t in range(0, 9):
        watch(_sample(float(t), 0.0, 0.0))
    watch(_sample(9.0, 0.0, 50.0))  # one GPU busy: the job is not idle; the clock restarts
    for t in range(10, 19):
        watch(_sample(float(t), 0.0, 0.0))
    assert said == []
    for t in range(19, 40):
        watch(_sample(float(t), 0.0, 0.0))
    assert len(said) == 1  # once per idle stretch
    watch(_sample(40.0, 90.0, 0.0))
    for t in range(41, 60):
        watch(_sample(float(t), 0.0, 0.0))
    assert len(said) == 2 and not watch.stopped()  # warn never stops


def test_samples_without_gpus_say_nothing():
    watch, said, _ = _watch(for_s=1.0)
    for t in range(0, 10):
        watch({"t": float(t), "Hostname": "h", "gpus": []})
    assert said == [] and watch.idle_since is None


def test_the_watch_is_found_by_run_only_while_entered():
    watch, _, _ = _watch()
    with watch:
        assert watch_of("run-1") is watch
    assert watch_of("run-1") is None
