"""The Python API's bad input: one sentence (InvalidSpec) naming the field and the fix,
before anything is made; and `offers` asks before launching."""

from __future__ import annotations

import pytest

import gpuflow
from gpuflow import CommandJob, InvalidSpec, JobSpec, Resources, gpu_job, gpu_jobs, offers

BAD = {
    "a spec of the wrong type": (
        lambda: gpu_job(42),
        "spec: a int is not a job spec; give a JobSpec, a dict or the path of a job's YAML.",
    ),
    "a list where a spec goes": (
        lambda: gpu_job([{"job": {"kind": "command", "command": ["true"]}}]),
        "spec: a list is not a job spec; give a JobSpec, a dict or the path of a job's YAML.",
    ),
    "a YAML path that does not exist": (
        lambda: gpu_job("/nonexistent/job.yaml"),
        "spec: '/nonexistent/job.yaml' is not a file; give the path of a job's YAML, a dict,"
        " or a JobSpec.",
    ),
    "a misspelt field of a model": (
        lambda: CommandJob(comand=["true"]),
        "command is required; add it. comand: unknown field; did you mean 'command'?",
    ),
    "a misspelt section": (
        lambda: JobSpec(job=CommandJob(command=["true"]), resource={"gpus": 1}),
        "resource: unknown field; did you mean 'resources'?",
    ),
    "a value out of range": (lambda: Resources(gpus=-1), "gpus must be at least 0"),
    "a dict with a mistake": (
        lambda: gpu_job(
            {"job": {"kind": "command", "command": ["true"]}, "limits": {"max_duration": "soon"}}
        ),
        "limits.max_duration",
    ),
    "at_once below 1": (
        lambda: gpu_jobs([{"job": {"kind": "command", "command": ["true"]}}], at_once=0),
        "at_once: 0 is below 1; give at least 1, or None for all.",
    ),
    "at_once a string": (
        lambda: gpu_jobs([{"job": {"kind": "command", "command": ["true"]}}], at_once="2"),
        "at_once: '2' is not a whole number; give how many jobs run together (1 or more), or"
        " None for all.",
    ),
    "at_once a fraction": (
        lambda: gpu_jobs([{"job": {"kind": "command", "command": ["true"]}}], at_once=1.5),
        "at_once: 1.5 is not a whole number;",
    ),
    "one dict to gpu_jobs": (
        lambda: gpu_jobs({"job": {"kind": "command", "command": ["true"]}}),
        "specs: gpu_jobs takes a list of specs, not one dict; give [spec], or call gpu_job(spec).",
    ),
    "one path to gpu_jobs": (
        lambda: gpu_jobs("job.yaml"),
        "specs: gpu_jobs takes a list of specs, not one str;",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_sentence_before_anything_is_made(case, gpuflow_home):
    call, sentence = BAD[case]
    with pytest.raises(InvalidSpec) as caught:
        call()
    assert str(caught.value).startswith(sentence), str(caught.value)
    assert not gpuflow_home.exists()  # nothing made: not even gpuflow's home


def test_an_unknown_keyword_argument_is_named():
    with pytest.raises(TypeError, match="unexpected keyword argument 'retries'"):
        gpu_job({"job": {"kind": "command", "command": ["true"]}}, retries=3)


def test_a_spec_from_yaml_and_from_models_are_the_same(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: eval\njob: {kind: command, command: [python, eval.py]}\nresources: {gpus: 2}\n"
    )
    built = JobSpec(
        name="eval", job=CommandJob(command=["python", "eval.py"]), resources=Resources(gpus=2)
    )
    assert gpuflow.job_spec(path) == built == gpuflow.job_spec(built.model_dump())


def test_offers_asks_every_candidate_before_launching(fake_nvml, gpuflow_home):
    spec = {"job": {"kind": "command", "command": ["true"]}, "resources": {"gpus": 1}}
    [(candidate, found)] = offers(spec)
    assert candidate.name == "local" and candidate.error == ""
    assert found[0].can_start and found[0].gpus_free == 2
    assert not (gpuflow_home / "workspaces").exists() or not any(
        (gpuflow_home / "workspaces").iterdir()
    )


def test_ls_shows_each_run_by_a_start_of_its_id_no_other_recent_run_shares():
    """Runs made in the same minute share their ids' first 8 characters (a UUIDv7 begins
    with its time): each is shown by as much as tells it apart, never less than 8."""
    from gpuflow.tasks.platform.runs import short_id

    ids = [
        "019af3a1-7c2e-7aaa-8000-000000000001",
        "019af3a1-7c2f-7bbb-8000-000000000002",
        "019af3a2-0000-7ccc-8000-000000000003",
    ]
    shown = [short_id(i, ids) for i in ids]
    assert shown == ["019af3a1-7c2e", "019af3a1-7c2f", "019af3a2"]
    assert all(sum(other.startswith(s) for other in ids) == 1 for s in shown)
