"""Checks shared by the kinds that run the user's own code (command, service): the
working folder, the file a command names, the variables it expands."""

from __future__ import annotations

import re
from pathlib import Path

from gpuflow.tasks.contract import UNIT_VARIABLES, Capabilities
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.spec import CodeJob, JobSpec
from gpuflow.tasks.workdir import WorkdirError, scan, variables

# programs whose first word is the script they run: [bash, run.sh], [Rscript, fit.R]
INTERPRETER = re.compile(r"^(python[0-9.]*|bash|sh|zsh|node|Rscript|julia|perl|ruby)$")


def check_code(
    spec: JobSpec, job: CodeJob, command: list[str], known: set[str], where: Capabilities
) -> None:
    """Raise InvalidSpec for a working folder that cannot be sent, a file `command` names
    that will not be where it starts, or a `${NAME}` it will not have (`known`: the
    kind's own variables besides the spec's env and gpuflow's)."""
    if job.workdir:
        try:
            scan(Path(job.workdir), job.workdir_max)
        except WorkdirError as exc:
            raise InvalidSpec(f"{exc}.") from None
    _check_script(job, command, where, in_image=spec.image is not None)
    _check_variables(spec, [*command, *job.resume_args], known)


def _check_script(
    job: CodeJob, words: list[str], where: Capabilities, in_image: bool = False
) -> None:
    """Refuse a file the command names that will not be where the job starts: the script
    of `python train.py` or `bash run.sh`, or a program given as a relative path (./run.sh), with no
    working folder (the job starts in an empty workspace) or one that lacks it."""
    if INTERPRETER.match(Path(words[0]).name) and len(words) > 1:
        path = words[1]
        if path.startswith("-"):
            return  # the interpreter's own options (python -m, sh -c)
    elif "/" in words[0]:
        path = words[0]
    else:
        return  # a program on PATH (or in the working folder): needs() and the node check it
    if Path(path).is_absolute():
        if where.runs_here and not in_image and not Path(path).exists():
            raise InvalidSpec(f"job.command: {path} does not exist on this machine; fix the path.")
        return
    if not job.workdir:
        raise InvalidSpec(
            f"job.command: {path} is a path in the folder the job starts in, an empty"
            " workspace; set job.workdir to the folder that holds it (relative to the spec"
            " file), or give its absolute path."
        )
    if not (Path(job.workdir) / path).exists():
        raise InvalidSpec(
            f"job.command: {path} is not in job.workdir ({job.workdir}), where the job"
            " starts; fix the path, or point workdir at the folder that holds it."
        )


def _check_variables(spec: JobSpec, words: list[str], known_too: set[str]) -> None:
    """Refuse `${NAME}` in the command for a variable the job will not have, or a secret
    (the value would show in every process list of the node)."""
    known = {*spec.env, *UNIT_VARIABLES, *known_too}
    for name in variables(words):
        if name in spec.secret_env:
            raise InvalidSpec(
                f"job.command: ${{{name}}} is a secret (secret_env), and a command's words show"
                " in every process list of the node; read it from the environment in the"
                " program instead."
            )
        if name not in known:
            raise InvalidSpec(
                f"job.command: ${{{name}}} is not set for the job; gpuflow expands only the"
                " spec's env and its own variables (GPUFLOW_OUTPUT_DIR, GPUFLOW_NODE_RANK, ...);"
                " add it to env, or remove it."
            )
