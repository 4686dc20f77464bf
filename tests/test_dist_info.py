"""scripts/testbed/dist_info.py: gpuflow installed where the job image keeps its code, so
Prefect finds the worker type through the entry point and `gpuflow` is a program there."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from importlib.metadata import PathDistribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dist_info():
    spec = importlib.util.spec_from_file_location(
        "dist_info", ROOT / "scripts" / "testbed" / "dist_info.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_project_is_installed_where_its_code_lies_with_its_entry_points_and_program(tmp_path):
    info = _dist_info().install(ROOT / "pyproject.toml", tmp_path / "code", tmp_path / "bin")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = PathDistribution(info)
    assert (found.metadata["Name"], found.version) == ("gpuflow", project["version"])
    points = {(p.group, p.name): p.value for p in found.entry_points}
    assert points[("prefect.collections", "gpuflow")] == "gpuflow.tasks.platform.collection"
    assert points[("console_scripts", "gpuflow")] == "gpuflow.cli:command"
    program = tmp_path / "bin" / "gpuflow"
    assert program.stat().st_mode & 0o111
    first, *rest = program.read_text().splitlines()
    assert first == "#!/usr/bin/python3"  # the image's Python, not this machine's
    assert "from gpuflow.cli import command" in rest and "sys.exit(command())" in rest
    # the program runs gpuflow's CLI (here with this machine's Python)
    shown = subprocess.run(
        [sys.executable, str(program), "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert shown.returncode == 0 and "usage: gpuflow" in shown.stdout
