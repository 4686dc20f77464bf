"""prefect.yaml is checked before anything is deployed: the project's own file passes, and
each bad input gets a sentence naming where it is."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tasks.errors import InvalidSpec
from tasks.platform.deploy import check_project, load_project, pool_templates

ROOT = Path(__file__).resolve().parent.parent
PROJECT = load_project(ROOT / "prefect.yaml")
POOLS = pool_templates()


def deployment(project: dict, name: str) -> dict:
    return next(d for d in project["deployments"] if d["name"] == name)


def test_the_projects_prefect_yaml_passes():
    names = check_project(copy.deepcopy(PROJECT), ROOT, POOLS)
    for flow in ("command", "train", "render", "hpc"):
        assert {f"{flow}-local", f"{flow}-k8s"} <= set(names)
    assert "prepare-dataset-local" in names
    render = deployment(PROJECT, "render-local")
    assert render["triggers"][0]["expect"] == ["gpuflow.scene.uploaded"]
    train = deployment(PROJECT, "train-local")
    assert train["triggers"][0]["expect"] == ["gpuflow.dataset.ready"]
    assert deployment(PROJECT, "hpc-local")["schedules"][0]["cron"] == "0 3 * * *"


def broken(change) -> dict:
    project = copy.deepcopy(PROJECT)
    change(project)
    return project


def k8s_vars(project: dict) -> dict:
    # anchors were expanded by the YAML loader: each deployment has its own copy
    return deployment(project, "render-k8s")["work_pool"]["job_variables"]


BAD = {
    "unknown job variable": (
        lambda p: k8s_vars(p).update(gpu_cout=2),
        "deployments[render-k8s].work_pool.job_variables.gpu_cout: not a variable of this work"
        " pool; did you mean 'gpu_count'?",
    ),
    "gpu_count two": (
        lambda p: k8s_vars(p).update(gpu_count="two"),
        "deployments[render-k8s].work_pool.job_variables.gpu_count: 'two' is not a whole number",
    ),
    "tolerations not a list": (
        lambda p: k8s_vars(p).update(tolerations={"key": "nvidia.com/gpu"}),
        "job_variables.tolerations: {'key': 'nvidia.com/gpu'} is not a list",
    ),
    "trigger names a missing parameter": (
        lambda p: deployment(p, "render-local")["triggers"][0]["parameters"].update(
            scene_url="{{ event.payload.scene }}"
        ),
        "deployments[render-local].triggers[0].parameters: 'scene_url' is not a parameter of"
        " the flow; it takes spec",
    ),
    "no work pool": (
        lambda p: deployment(p, "hpc-local").pop("work_pool"),
        "deployments[hpc-local].work_pool.name is missing; name the pool to run on",
    ),
    "unknown pool": (
        lambda p: deployment(p, "hpc-local")["work_pool"].update(name="gpu-pool"),
        "deployments[hpc-local].work_pool.name: 'gpu-pool' is not a pool gpuflow knows",
    ),
    "unknown parameter": (
        lambda p: deployment(p, "command-local")["parameters"].update(spek={}),
        "deployments[command-local].parameters: 'spek' is not a parameter of the flow",
    ),
    "invalid job spec": (
        lambda p: deployment(p, "hpc-local")["parameters"]["spec"]["job"].update(ranks=0),
        "deployments[hpc-local].parameters.spec: job.ranks must be at least 1",
    ),
    "missing required parameter": (
        lambda p: deployment(p, "prepare-dataset-local")["parameters"].pop("output"),
        "deployments[prepare-dataset-local].parameters: output is required",
    ),
    "not a flow": (
        lambda p: deployment(p, "hpc-local").update(entrypoint="flows/hpc.py:TEARDOWN_HOOKS"),
        "deployments[hpc-local].entrypoint: 'TEARDOWN_HOOKS' in flows/hpc.py is not a Prefect flow",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_deployments_are_named(case):
    change, sentence = BAD[case]
    with pytest.raises(InvalidSpec) as caught:
        check_project(broken(change), ROOT, POOLS)
    assert sentence in str(caught.value)


def test_the_cli_refuses_a_bad_prefect_yaml_with_exit_2(tmp_path, monkeypatch, capsys):
    import yaml

    from gpuflow.cli import main

    project = broken(BAD["unknown job variable"][0])
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(project))
    for folder in ("flows", "tasks"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    assert main(["deploy"]) == 2
    assert "gpu_cout: not a variable of this work pool" in capsys.readouterr().err
