"""prefect.yaml is checked before anything is deployed: the project's own file passes, and
each bad input gets a sentence naming where it is."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform.deploy import check_project, load_project, pool_templates

ROOT = Path(__file__).resolve().parent.parent
PROJECT = load_project(ROOT / "prefect.yaml")
POOLS = pool_templates()
ENV = {"GPUFLOW_IMAGE": "registry.internal/ml/gpuflow-job:0.1"}


def deployment(project: dict, name: str) -> dict:
    return next(d for d in project["deployments"] if d["name"] == name)


def test_the_projects_prefect_yaml_passes():
    names = check_project(copy.deepcopy(PROJECT), ROOT, POOLS, env=ENV)
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
    "a module flow that is not there": (
        lambda p: deployment(p, "hpc-local").update(entrypoint="gpuflow.flows.hcp:hpc"),
        "deployments[hpc-local].entrypoint: 'gpuflow.flows.hcp:hpc': module 'gpuflow.flows.hcp'"
        " cannot be imported (No module named 'gpuflow.flows.hcp'); fix the name, or install"
        " the package that has it.",
    ),
    "a file that is not there": (
        lambda p: deployment(p, "hpc-local").update(entrypoint="flows/hcp.py:hpc"),
        "deployments[hpc-local].entrypoint: 'flows/hcp.py:hpc' names",
    ),
    "no function": (
        lambda p: deployment(p, "hpc-local").update(entrypoint="gpuflow.flows.hpc"),
        "deployments[hpc-local].entrypoint: 'gpuflow.flows.hpc' is neither"
        " path/to/file.py:flow_function nor package.module:flow_function; write one of them.",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_deployments_are_named(case):
    change, sentence = BAD[case]
    with pytest.raises(InvalidSpec) as caught:
        check_project(broken(change), ROOT, POOLS, env=ENV)
    assert sentence in str(caught.value)


FIX = (
    "set GPUFLOW_IMAGE to a registry path and tag you can push to (the image is built from"
    " infra/docker/Dockerfile), or deploy only the local pool with"
    " `gpuflow deploy --pool gpuflow-local`"
)
BAD_IMAGES = {
    "unset": ({}, None, "GPUFLOW_IMAGE is not set; " + FIX),
    "empty": ({"GPUFLOW_IMAGE": "  "}, None, "GPUFLOW_IMAGE is not set"),
    "the old placeholder": (
        ENV,
        "ghcr.io/example/gpuflow:latest",
        "'ghcr.io/example/gpuflow:latest' is a placeholder, not an image; " + FIX,
    ),
    "an example registry": (
        {"GPUFLOW_IMAGE": "registry.example.com/ml/job:1"},
        None,
        "'registry.example.com/ml/job:1' is a placeholder",
    ),
    "angle brackets": ({"GPUFLOW_IMAGE": "<your-registry>/job:1"}, None, "is a placeholder"),
    "missing": (ENV, "", "the job image is missing; " + FIX),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_a_kubernetes_deployment_without_a_real_image_is_refused(case):
    env, image, sentence = BAD_IMAGES[case]
    project = copy.deepcopy(PROJECT)
    if image is not None:
        k8s_vars(project)["image"] = image
    with pytest.raises(InvalidSpec) as caught:
        check_project(project, ROOT, POOLS, env=env)
    assert str(caught.value).startswith("deployments[")
    assert sentence in str(caught.value)


def test_the_local_pool_alone_needs_no_image():
    names = check_project(copy.deepcopy(PROJECT), ROOT, POOLS, only={"gpuflow-local"}, env={})
    assert names and all(name.endswith("-local") for name in names)


def test_kubernetes_deployments_build_and_push_the_image_they_run():
    for name in ("command-k8s", "train-k8s", "render-k8s", "hpc-k8s"):
        found = deployment(PROJECT, name)
        assert found["work_pool"]["job_variables"]["image"] == "{{ $GPUFLOW_IMAGE }}"
        (build,) = found["build"]
        (push,) = found["push"]
        step = "prefect.deployments.steps.run_shell_script"
        assert "--file infra/docker/Dockerfile" in build[step]["script"]
        assert "{{ $GPUFLOW_IMAGE }}" in build[step]["script"]
        assert push[step]["script"] == "docker push {{ $GPUFLOW_IMAGE }}"
    assert "build" not in deployment(PROJECT, "command-local")


def test_the_cli_refuses_a_bad_prefect_yaml_with_exit_2(tmp_path, monkeypatch, capsys):
    import yaml

    from gpuflow.cli import main

    project = broken(BAD["unknown job variable"][0])
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(project))
    for folder in ("flows", "tasks"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUFLOW_IMAGE", ENV["GPUFLOW_IMAGE"])
    assert main(["deploy"]) == 2
    assert "gpu_cout: not a variable of this work pool" in capsys.readouterr().err


def test_the_cli_refuses_kubernetes_deployments_without_an_image_before_deploying(
    monkeypatch, capsys
):
    from gpuflow.cli import main

    monkeypatch.delenv("GPUFLOW_IMAGE", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached
    monkeypatch.chdir(ROOT)
    assert main(["deploy"]) == 2
    err = capsys.readouterr().err
    assert "work_pool.job_variables.image: GPUFLOW_IMAGE is not set" in err
    assert err.count("\n") == 1


def _kubeconfig(path: Path, server: str) -> Path:
    import yaml

    path.write_text(
        yaml.safe_dump(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t0ken-never-shown"}}],
            }
        )
    )
    return path


def test_platform_up_with_a_cluster_checks_it_before_starting_anything(
    tmp_path, monkeypatch, capsys, gpuflow_home
):
    from gpuflow.cli import main
    from tests.conftest import free_port

    monkeypatch.delenv("GPUFLOW_IMAGE", raising=False)
    port = str(free_port())
    assert main(["platform", "up", "--port", port, "--kubeconfig", str(tmp_path / "no")]) == 2
    assert f"--kubeconfig: {tmp_path / 'no'} is not a file" in capsys.readouterr().err
    unreachable = _kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{free_port()}")
    assert main(["platform", "up", "--port", port, "--kubeconfig", str(unreachable)]) == 2
    assert "--image: name the job image" in capsys.readouterr().err
    argv = ["platform", "up", "--port", port, "--kubeconfig", str(unreachable), "--image", "r/j:1"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"the cluster in {unreachable} cannot be used: the Kubernetes API server" in err
    assert "did not answer" in err and "t0ken" not in err
    assert not (gpuflow_home / "platform" / "state.json").exists()  # nothing was started
