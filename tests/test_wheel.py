"""gpuflow installs one import name, `gpuflow`: the wheel holds exactly that package (the
repository's flows/, tasks/ and blocks/ inside it) and its dist-info, and no module of the
project imports the top-level folders by their own names, which only a checkout has."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = ("flows", "tasks", "blocks")
PROJECT = "tests/e2e/project/"  # a user's project, with its own flows/, tasks/ and blocks.py
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [*PIP_WHEEL, "--wheel-dir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [path] = out.glob("gpuflow-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_one_import_name(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    version = next(t for t in tops if t.endswith(".dist-info"))
    assert tops == {"gpuflow", version}
    points = wheel.read(f"{version}/entry_points.txt").decode()
    assert "gpuflow = gpuflow.tasks.platform.collection" in points


def test_every_source_file_is_in_the_wheel_under_gpuflow(wheel):
    tracked = subprocess.run(
        ["git", "ls-files", "gpuflow", *MAPPED], capture_output=True, text=True, cwd=ROOT
    ).stdout.split()
    wanted = set()
    for name in tracked:
        path = ROOT / name
        if path.is_symlink() or path.suffix not in (".py", ".yaml"):
            continue
        wanted.add(name if name.startswith("gpuflow/") else f"gpuflow/{name}")
    assert wanted, "no sources found"
    assert sorted(wanted - set(wheel.namelist())) == []


def _imported(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_nothing_imports_the_top_level_folders_by_their_own_names():
    """In a checkout `import tasks` would work (the repository root is on sys.path) and
    load a second copy of gpuflow.tasks; in the wheel it fails."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], capture_output=True, text=True, cwd=ROOT
    ).stdout.split()
    wrong = [
        f"{name}: {module}"
        for name in tracked
        if not (ROOT / name).is_symlink() and not name.startswith(PROJECT)
        for module in _imported(ROOT / name)
        if module.split(".")[0] in MAPPED
    ]
    assert wrong == []


def test_importing_gpuflow_imports_neither_prefect_nor_the_cli():
    """`python -m gpuflow.tasks...` on a node and `import gpuflow` stay quick; the public
    names load on first use."""
    code = (
        "import sys, gpuflow\n"
        "assert 'prefect' not in sys.modules and 'gpuflow.cli' not in sys.modules\n"
        "from gpuflow import JobSpec, gpu_job\n"
        "assert 'gpuflow.cli' not in sys.modules and 'gpuflow.commands' not in sys.modules\n"
        "print(sorted(set(gpuflow.__all__) - set(dir(gpuflow))))\n"
        "print(all(getattr(gpuflow, n).__doc__ for n in gpuflow.__all__ if n[0] != '_'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["[]", "True"]


def test_the_running_gpuflow_builds_its_own_wheel_the_same_each_time(tmp_path):
    """What an EC2 instance installs: the orchestrator's own files, one top-level name, the
    same bytes (so the same SHA-256) for the same files; pip installs it."""
    from gpuflow.tasks import own_wheel

    name, data = own_wheel.build()
    assert own_wheel.build() == (name, data)
    path = tmp_path / name
    path.write_bytes(data)
    with zipfile.ZipFile(path) as built:
        tops = {n.split("/")[0] for n in built.namelist()}
        assert "gpuflow/tasks/backends/ec2/agent.py" in built.namelist()
        assert not [n for n in built.namelist() if "__pycache__" in n or n.endswith(".pyc")]
    assert tops == {"gpuflow", name.removesuffix("-py3-none-any.whl") + ".dist-info"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "t"), str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "t" / "gpuflow" / "tasks" / "backends" / "ec2" / "agent.py").is_file()


# the modules gpuflow runs on a node in a job's image (the kinds' launchers and servers)
NODE_MODULES = (
    "gpuflow.tasks.training.launch",
    "gpuflow.tasks.hpc.launch",
    "gpuflow.tasks.hpc.rank",
    "gpuflow.tasks.render.pod_chunk",
    "gpuflow.tasks.kinds.matmul_run",
    "gpuflow.tasks.torchrun",
    "gpuflow.tasks.training.data",
)


def test_the_library_an_image_gets_imports_gpuflows_node_code_with_nothing_else(tmp_path):
    """A python3 that has only the standard library and the library on its path imports
    every module gpuflow runs on a node; the library is made once and readable by all."""
    from gpuflow.tasks import own_wheel

    folder = own_wheel.library(tmp_path / "images")
    assert own_wheel.library(tmp_path / "images") == folder  # found, not made again
    assert [p.name for p in (tmp_path / "images").iterdir()] == [folder.name]
    assert (folder / "gpuflow" / "tasks" / "spec.py").is_file()
    assert (folder / "pydantic_core").is_dir() and (folder / "yaml").is_dir()
    assert all(p.stat().st_mode & 0o004 for p in folder.rglob("*"))
    code = (
        "import importlib, sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p];"
        f" sys.path.insert(0, {str(folder)!r});"
        f" [importlib.import_module(m) for m in {NODE_MODULES!r}];"
        " import gpuflow; print(gpuflow.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith(str(folder))


def test_a_unit_runs_gpuflows_code_when_its_command_names_a_module_of_it():
    from gpuflow.tasks.backends.imaging import runs_gpuflow, version_of

    assert runs_gpuflow(["python3", "-m", "gpuflow.tasks.hpc.launch", "--job-json", "{}"])
    assert runs_gpuflow(["python3", "/w/.gpuflow-starter.py", "{}", "--", "py", "-m", "gpuflow.x"])
    assert not runs_gpuflow(["python3", "-m", "torch.distributed.run", "train.py"])
    assert not runs_gpuflow(["sh", "-c", "python -m gpuflow.tasks.x"])
    assert version_of("cpython-312-x86_64-linux-gnu") == "3.12"
    assert version_of("") == "older than 3.3"
