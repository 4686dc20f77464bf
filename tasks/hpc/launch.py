"""Run an HPC job in its workspace: fetch the inputs, run the build step, start mpirun with
every rank wrapped by gpuflow.tasks.hpc.rank, name the first rank that failed, upload the outputs.

The backend runs this as the job's command, in the job's own process group: a stop
(SIGTERM to the group) reaches mpirun directly, which stops its ranks; this process only
waits for it. Failures that are the job's, not gpuflow's, go to outputs/error.txt as one
sentence that the run stage reports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

from gpuflow.tasks.errors import ERROR_FILE
from gpuflow.tasks.fetching import UnsafeKey, fetch_prefix, relative_names
from gpuflow.tasks.hpc import mpi
from gpuflow.tasks.hpc.model import HpcJob
from gpuflow.tasks.storage import S3Settings, StorageError, join, store_for

STATUS_DIR = "ranks"
BUILD_TAIL = 15  # lines of a failed build shown in the error


class JobError(Exception):
    """The job cannot go on; the message is the sentence the user sees."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def hosts_for(
    job: HpcJob, gpus_here: int, names: list[str] | None = None, cpus: int | None = None
) -> list[mpi.Host]:
    """Return the hosts to run on: the job's, else one per node `names` (default: this
    host) with `job.slots` each (default: the node's CPU cores, or one slot per rank's
    GPUs when the ranks own GPUs)."""
    if job.hosts:
        return list(job.hosts)
    slots = job.slots or cpus or os.cpu_count() or 1
    if job.gpus_per_rank and not job.slots:
        slots = max(1, gpus_here // job.gpus_per_rank)
    return [mpi.Host(name=name, slots=slots, gpus=gpus_here) for name in names or ["localhost"]]


def program_argv(job: HpcJob) -> list[str]:
    """Return what each rank runs: the job's program, or the MD workload under mpi4py's
    runner (an exception on one rank aborts them all instead of leaving a hang)."""
    if job.md is not None:
        settings = job.md.model_dump_json()
        return [
            sys.executable,
            "-m",
            "mpi4py",
            "-m",
            "gpuflow.tasks.hpc.md_run",
            "--settings",
            settings,
        ]
    assert job.program is not None
    return list(job.program)


def fetch_inputs(job: HpcJob, workspace: Path) -> int:
    """Download each input (an object, or every object under a prefix) into the workspace;
    return how many files arrived."""

    count = 0
    for url in job.inputs:
        store = store_for(url, S3Settings.from_env())
        if store.exists(url):
            store.download_file(url, workspace / url.rsplit("/", 1)[-1])
            count += 1
            continue
        objects = store.list(url + "/")
        if not objects:
            raise JobError(f"job.inputs: {url} holds nothing; check the URL", 2)
        try:
            count += len(fetch_prefix(store, url, workspace, relative_names(url, objects)))
        except UnsafeKey as exc:
            raise JobError(f"job.inputs: {exc}", 2) from None
    return count


def build(job: HpcJob, workspace: Path) -> None:
    """Run the build step in the workspace, streaming its output; JobError with its last
    lines when it fails."""
    if not job.build:
        return
    tail: deque[str] = deque(maxlen=BUILD_TAIL)
    print(f"build: {' '.join(job.build)}", flush=True)
    try:
        proc = subprocess.Popen(
            job.build,
            cwd=workspace,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    except OSError as exc:
        raise JobError(
            f"job.build: {job.build[0]!r} cannot be started ({exc.strerror}); install it or fix"
            " the build command",
            127,
        ) from None
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip("\n")
        tail.append(line)
        print(f"build| {line}", flush=True)
    code = proc.wait()
    if code != 0:
        last = " | ".join(line for line in tail if line.strip())
        raise JobError(
            f"job.build: `{' '.join(job.build)}` failed (exit {code}); last lines: {last}",
            code if code > 0 else 128 - code,
        )


def resolve(program: str, workspace: Path) -> str:
    """Return the program as mpirun should start it; JobError when it is not there."""
    if "/" in program:
        path = Path(program) if Path(program).is_absolute() else workspace / program
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
        where = "" if Path(program).is_absolute() else " in the workspace (after inputs and build)"
        raise JobError(
            f"job.program: {program!r} was not found{where} or is not executable; check the"
            " path, job.inputs and job.build",
            127,
        )
    found = shutil.which(program)
    if found is None:
        raise JobError(
            f"job.program: {program!r} was not found on PATH; install it or give its path", 127
        )
    return found


def first_failure(status_dir: Path) -> dict | None:
    """Return the record of the rank that failed first: the earliest non-zero exit or
    signal. Ranks stopped by mpirun after it (SIGTERM, SIGKILL) follow it in time."""
    records = []
    for path in status_dir.glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    failed = [r for r in records if r.get("exit_code") not in (0, None) or r.get("signal")]
    return min(failed, key=lambda r: r["ended"]) if failed else None


def describe(record: dict, ranks: int) -> str:
    """Return one sentence naming the failed rank, its host, and its exit code or signal."""
    how = (
        f"was killed by signal {record['signal']} ({_signal_name(record['signal'])})"
        if record.get("signal")
        else f"exited with code {record['exit_code']}"
    )
    return (
        f"MPI rank {record['rank']} of {ranks} on {record['host']} {how}; mpirun stopped the"
        " other ranks. See that rank's lines in the log."
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_mpi(job: HpcJob, workspace: Path, hosts: list[mpi.Host] | None = None) -> int:
    """Start mpirun over `hosts` (default: this one) and wait for it; return its exit
    code, with the first failed rank written to the error file."""
    if hosts is None:
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        hosts = hosts_for(job, len(visible))
    status_dir = workspace / STATUS_DIR
    shutil.rmtree(status_dir, ignore_errors=True)
    (workspace / "hostfile").write_text(mpi.hostfile(hosts))
    program = program_argv(job)
    program[0] = resolve(program[0], workspace)
    wrapped = [
        sys.executable,
        "-m",
        "gpuflow.tasks.hpc.rank",
        "--status-dir",
        str(status_dir),
        "--gpus-per-rank",
        str(job.gpus_per_rank),
        "--",
        *program,
    ]
    ranks_here = mpi.place(job.ranks, hosts)[0]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, ranks_here))))
    mpirun = shutil.which(job.mpirun) or job.mpirun
    argv = mpi.mpirun_argv(
        wrapped,
        job.ranks,
        hosts,
        mpi.exported(env),
        as_root=os.geteuid() == 0,
        oversubscribe=job.oversubscribe,
        mpirun=mpirun,
        hostfile_path=str(workspace / "hostfile"),
    )
    argv[1:1] = job.mpirun_args
    print(f"mpirun: {job.ranks} rank(s) on {', '.join(h.name for h in hosts)}", flush=True)
    child = subprocess.Popen(argv, cwd=workspace, env=env, stdin=subprocess.DEVNULL)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # mpirun got it too: wait
    code = child.wait()
    if code == 0:
        return 0
    record = first_failure(status_dir)
    if record is not None:
        raise JobError(describe(record, job.ranks), code if code > 0 else 128 - code)
    raise JobError(
        f"mpirun exited with code {code} before any rank reported; see its lines in the log",
        code if code > 0 else 128 - code,
    )


def upload_outputs(job: HpcJob, outputs: Path) -> int:
    """Upload everything under the outputs folder to job.output; return how many files."""
    if not job.output or not outputs.is_dir():
        return 0

    store = store_for(job.output, S3Settings.from_env())
    files = [p for p in sorted(outputs.rglob("*")) if p.is_file()]
    for path in files:
        store.upload_file(join(job.output, str(path.relative_to(outputs))), path)
    return len(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job-json", required=True)
    parser.add_argument("--hosts-json", help="the hosts and slots (default: this host)")
    args = parser.parse_args(argv)
    job = HpcJob.model_validate_json(args.job_json)
    hosts = (
        [mpi.Host.model_validate(h) for h in json.loads(args.hosts_json)]
        if args.hosts_json
        else None
    )
    workspace = Path(os.environ.get("GPUFLOW_WORKSPACE", ".")).resolve()
    outputs = Path(os.environ.get("GPUFLOW_OUTPUT_DIR", workspace / "outputs"))
    outputs.mkdir(parents=True, exist_ok=True)
    (outputs / ERROR_FILE).unlink(missing_ok=True)
    code = 0
    try:
        if hosts and os.environ.get("GPUFLOW_MPI_HOSTFILE"):
            # a backend that places the nodes itself (the MPI Operator) names them in a hostfile
            hosts = mpi.renamed(hosts, Path(os.environ["GPUFLOW_MPI_HOSTFILE"]).read_text())
        if job.inputs:
            print(f"inputs: {fetch_inputs(job, workspace)} file(s) fetched", flush=True)
        build(job, workspace)
        code = run_mpi(job, workspace, hosts)
    except (JobError, StorageError, mpi.LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        (outputs / ERROR_FILE).write_text(str(exc))
        code = exc.code if isinstance(exc, JobError) else 2
    finally:
        if job.output:
            print(f"outputs: {upload_outputs(job, outputs)} file(s) to {job.output}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
