"""prefect.yaml, checked before anything is deployed: each deployment names a work pool and
an entrypoint that is a flow; its parameters and its triggers' parameters are that flow's;
its job variables are the pool's, with the right types; job specs in parameters are valid.
Prefect itself ignores unknown job variables and takes any parameter names.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpuflow.tasks import yamlfile
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline import plugins as _plugins  # noqa: F401 - kinds and backends are read
from gpuflow.tasks.platform.k8s_worker import WORKER_TYPE
from gpuflow.tasks.platform.pool_template import check_job_variables, default_gpu_template
from gpuflow.tasks.spec import load_spec

LOCAL_POOL = "gpuflow-local"
GPU_K8S_POOL = "gpuflow-gpu-k8s"
IMAGE_VARIABLE = "GPUFLOW_IMAGE"
_ENV_PLACEHOLDER = re.compile(r"\{\{\s*\$(\w+)\s*\}\}")


def pool_templates() -> dict[str, tuple[str, dict[str, Any]]]:
    """Return gpuflow's pools: name -> (worker type, base job template)."""
    from prefect.workers.process import ProcessWorker

    return {
        LOCAL_POOL: ("process", ProcessWorker.get_default_base_job_template()),
        GPU_K8S_POOL: (WORKER_TYPE, default_gpu_template()),
    }


def load_project(path: Path) -> dict[str, Any]:
    """Return prefect.yaml as a mapping; InvalidSpec when it is not one."""
    if not path.exists():
        raise InvalidSpec(f"{path}: no such file; run from the project folder")
    project = yamlfile.read(path, "prefect.yaml")  # aliases bounded, errors one sentence
    if not isinstance(project, dict) or not isinstance(project.get("deployments"), list):
        raise InvalidSpec(f"{path}: has no deployments list; add deployments: [...]")
    return json.loads(json.dumps(project))  # YAML aliases share one object: give each its own


def flow_parameters(root: Path, entrypoint: str, where: str) -> inspect.Signature:
    """Return the signature of the flow `entrypoint` names: path/to/file.py:function (under
    `root`) or package.module:function (imported, as Prefect does)."""
    path, _, name = entrypoint.rpartition(":")
    if not path or not name:
        raise InvalidSpec(
            f"{where}.entrypoint: {entrypoint!r} is neither path/to/file.py:flow_function nor"
            " package.module:flow_function; write one of them."
        )
    if path.endswith(".py"):
        module_path = root / path
        if not module_path.is_file():
            raise InvalidSpec(
                f"{where}.entrypoint: {entrypoint!r} names {module_path}, which is not a file;"
                " fix the path (it is read from the project folder)."
            )
        spec = importlib.util.spec_from_file_location(
            f"_gpuflow_entry_{module_path.stem}", module_path
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(root))  # as Prefect loads it: the project's own packages first
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise InvalidSpec(
                f"{where}.entrypoint: {path} could not be imported ({type(exc).__name__}:"
                f" {exc}); fix it, or install what it imports."
            ) from None
        finally:
            sys.path.remove(str(root))
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise InvalidSpec(
                f"{where}.entrypoint: {entrypoint!r}: module {path!r} cannot be imported"
                f" ({exc}); fix the name, or install the package that has it."
            ) from None
    flow = getattr(module, name, None)
    if flow is None or not hasattr(flow, "fn"):
        raise InvalidSpec(f"{where}.entrypoint: {name!r} in {path} is not a Prefect flow")
    return inspect.signature(flow.fn)


def check_project(
    project: dict[str, Any],
    root: Path,
    pools: dict[str, tuple[str, dict[str, Any]]],
    only: set[str] | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Return the names of the deployments on the pools in `only` (default: all) after
    checking each; InvalidSpec on the first problem. `env` resolves {{ $NAME }} in images."""

    env = dict(os.environ) if env is None else env
    names = []
    for i, deployment in enumerate(project["deployments"]):
        name = deployment.get("name") or f"#{i}"
        where = f"deployments[{name}]"
        pool = (deployment.get("work_pool") or {}).get("name")
        if not pool:
            raise InvalidSpec(
                f"{where}.work_pool.name is missing; name the pool to run on ({', '.join(pools)})"
            )
        if pool not in pools:
            raise InvalidSpec(
                f"{where}.work_pool.name: {pool!r} is not a pool gpuflow knows; use one of"
                f" {', '.join(pools)} or create it first"
            )
        if only is not None and pool not in only:
            continue
        variables = deployment["work_pool"].get("job_variables") or {}
        check_job_variables(pools[pool][1], variables, f"{where}.work_pool.job_variables")
        if pool == GPU_K8S_POOL:
            check_image(f"{where}.work_pool.job_variables.image", variables.get("image"), env)
        signature = flow_parameters(root, str(deployment.get("entrypoint", "")), where)
        accepted = set(signature.parameters)
        parameters = deployment.get("parameters") or {}
        _known_parameters(f"{where}.parameters", parameters, accepted)
        required = {
            p.name for p in signature.parameters.values() if p.default is inspect.Parameter.empty
        }
        missing = sorted(required - set(parameters))
        if missing:
            raise InvalidSpec(f"{where}.parameters: {', '.join(missing)} is required; add it")
        if "spec" in parameters:
            try:
                load_spec(parameters["spec"])
            except InvalidSpec as exc:
                raise InvalidSpec(f"{where}.parameters.spec: {exc}") from None
        for t, trigger in enumerate(deployment.get("triggers") or []):
            if not trigger.get("expect"):
                raise InvalidSpec(f"{where}.triggers[{t}].expect: name the event(s) that start it")
            _known_parameters(
                f"{where}.triggers[{t}].parameters", trigger.get("parameters") or {}, accepted
            )
        names.append(name)
    return names


def check_image(where: str, image: Any, env: dict[str, str]) -> str:
    """Return the job image a Kubernetes deployment names, its {{ $NAME }} resolved from
    `env`; InvalidSpec when it is missing, unset or a placeholder."""
    fix = (
        f"set {IMAGE_VARIABLE} to a registry path and tag you can push to (the image is built"
        " from infra/docker/Dockerfile), or deploy only the local pool with"
        f" `gpuflow deploy --pool {LOCAL_POOL}`"
    )
    if not isinstance(image, str) or not image.strip():
        raise InvalidSpec(f"{where}: the job image is missing; {fix}")
    unset = [n for n in _ENV_PLACEHOLDER.findall(image) if not env.get(n, "").strip()]
    if unset:
        raise InvalidSpec(f"{where}: {unset[0]} is not set; {fix}")
    resolved = _ENV_PLACEHOLDER.sub(lambda m: env[m.group(1)].strip(), image)
    repository = resolved.rsplit("@", 1)[0]
    if "example" in re.split(r"[/.:]", repository) or any(c in resolved for c in "<>{} "):
        raise InvalidSpec(f"{where}: {resolved!r} is a placeholder, not an image; {fix}")
    return resolved


def _known_parameters(where: str, parameters: dict[str, Any], accepted: set[str]) -> None:
    unknown = sorted(set(parameters) - accepted)
    if unknown:
        raise InvalidSpec(
            f"{where}: {unknown[0]!r} is not a parameter of the flow; it takes"
            f" {', '.join(sorted(accepted))}"
        )


def prefect_deploy(
    root: Path,
    env: dict[str, str] | None = None,
    names: list[str] | None = None,
    prefect_file: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run `prefect deploy` in `root` for `names` (default: all), after check_project;
    return the finished call."""
    which = [a for n in names for a in ("--name", n)] if names is not None else ["--all"]
    file = ["--prefect-file", str(prefect_file)] if prefect_file else []
    return subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", *which, *file],
        cwd=root,
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
