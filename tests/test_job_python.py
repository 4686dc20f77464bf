"""The Python a command job runs: named at preflight, torch checked as that Python imports
it (not gpuflow's), job.python to run gpuflow's own or a named one; bad values refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuflow.cli import main
from gpuflow.tasks.spec import load_spec


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A folder whose `python` is an interpreter with nothing installed (no torch)."""
    venv = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin"


def _preflight(tmp_path, capsys, job: str) -> tuple[int, str]:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: py\njob: {job}\n")
    code = main(["preflight", str(spec)])
    return code, capsys.readouterr().out


def test_preflight_names_the_jobs_python_and_checks_torch_with_it(
    bare_python, tmp_path, capsys, monkeypatch, gpuflow_home
):
    monkeypatch.setenv("PATH", f"{bare_python}:/usr/bin:/bin")
    job = "{kind: command, command: [python, -c, pass], torch: true}"
    code, out = _preflight(tmp_path, capsys, job)
    assert code == 1, out
    assert f"[pass] python: the job runs {bare_python}/python" in out
    assert (
        f"[fail] torch: job.command: the job's Python {bare_python}/python cannot import torch"
        " (ModuleNotFoundError: No module named 'torch'); install torch for it, or set"
        f" job.python: gpuflow to run the Python gpuflow runs from ({sys.executable}), or the"
        " path of another." in out
    )
    job = "{kind: command, command: [python, -c, pass], torch: true, python: gpuflow}"
    code, out = _preflight(tmp_path, capsys, job)
    assert code == 0, out
    assert f"[pass] python: the job runs {sys.executable}" in out
    assert f"(as {sys.executable} imports it)" in out


def test_job_python_replaces_only_the_leading_python():
    spec = load_spec(
        {"job": {"kind": "command", "command": ["python3", "t.py"], "python": "gpuflow"}}
    )
    assert spec.job.argv() == [sys.executable, "t.py"]
    named = {"kind": "command", "command": ["python", "t.py"], "python": "/opt/py/bin/python3"}
    assert load_spec({"job": named}).job.argv() == ["/opt/py/bin/python3", "t.py"]


@pytest.mark.parametrize(
    ("job", "said"),
    [
        (
            {"command": ["python", "t.py"], "python": "python3"},
            "job.python: 'python3' is neither gpuflow nor an absolute path",
        ),
        (
            {"command": ["bash", "t.sh"], "python": "gpuflow"},
            "job.python: names the Python of a command that starts with python, and this one"
            " starts with 'bash'",
        ),
    ],
)
def test_a_bad_job_python_is_one_sentence(job, said):
    from gpuflow.tasks.errors import InvalidSpec

    with pytest.raises(InvalidSpec) as raised:
        load_spec({"job": {"kind": "command", **job}})
    assert said in str(raised.value)


def test_a_python_not_on_the_jobs_path_is_refused_before_anything_is_made(
    tmp_path, capsys, monkeypatch, gpuflow_home
):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, out = _preflight(tmp_path, capsys, "{kind: command, command: [python, t.py]}")
    said = out + capsys.readouterr().err
    assert code == 1, said
    assert (
        "[fail] program: job.command: 'python' was not found here; install it or give its full"
        " path (or job.python: gpuflow, the Python gpuflow runs from)." in said
    )
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.pipeline.checks import check_spec

    with pytest.raises(InvalidSpec) as refused:  # what `gpuflow run` says before it makes anything
        check_spec(load_spec({"job": {"kind": "command", "command": ["python", "t.py"]}}))
    assert str(refused.value) == (
        "job.command: 'python' was not found on PATH or is not executable; install it or give"
        " its full path (or job.python: gpuflow, the Python gpuflow runs from)."
    )
