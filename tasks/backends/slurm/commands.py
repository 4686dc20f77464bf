"""How gpuflow's Slurm commands reach the cluster: the Slurm client on this machine (with
the SLURM_CONF it is given, or the client's own default), or a login node over SSH (a key,
a known host key, nothing asked interactively). Every failure is named with the command
and what Slurm (or ssh) said, never a traceback."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from gpuflow.tasks.errors import InvalidSpec, ProvisionError
from gpuflow.tasks.host import job_environ
from gpuflow.tasks.ssh import SSH_FAILED, Endpoint, SshTarget

# Every Slurm command gpuflow runs answers within this (slurmctld down: it says so sooner).
TIMEOUT_S = 60.0


def check_client() -> None:
    """Raise InvalidSpec when this machine has no Slurm client, or SLURM_CONF names a file
    that is not there."""
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        raise InvalidSpec(
            "placement.backend: slurm needs the Slurm client (sbatch, srun, squeue, scancel) on"
            " this machine, and it has none; install slurm-client, run gpuflow on the"
            " cluster's login node, or give the SlurmCluster block a login_host."
        )
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        raise InvalidSpec(
            f"SLURM_CONF: {conf} does not exist; point SLURM_CONF at the cluster's slurm.conf,"
            " or unset it to use the client's own."
        )


def said(stderr: str) -> str:
    """Return Slurm's error lines as one sentence, without the program's prefix."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    text = "; ".join(line.split("error: ", 1)[-1] for line in lines[-3:])
    return text or "no message"


class LocalClient:
    """The Slurm client on this machine."""

    where = "the Slurm client here"
    remote = False

    def describe(self) -> str:
        conf = os.environ.get("SLURM_CONF")
        return f"{self.where}, " + (f"SLURM_CONF={conf}" if conf else "with its own configuration")

    def check(self) -> None:
        check_client()

    def answer(self, argv: list[str]) -> subprocess.CompletedProcess:
        """Run a Slurm command; return how it ended (ProvisionError when it did not)."""
        return _ran(argv, argv)

    def run(self, argv: list[str], check: bool = True) -> str:
        """Return what a Slurm command printed; with `check`, ProvisionError naming the
        command and Slurm's own words when it fails or does not answer."""
        done = self.answer(argv)
        if check and done.returncode != 0:
            raise ProvisionError(f"`{argv[0]}` failed: {said(done.stderr)}")
        return done.stdout

    def start(self, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
        """Start a Slurm command (srun) with `env` added to this process's environment."""
        return subprocess.Popen(
            argv,
            env={**job_environ(), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def make_dir(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def put_file(self, source: Path, path: str) -> None:
        """Copy a file of this machine to `path` on the cluster's shared file system."""
        shutil.copyfile(source, path)

    def remove_dir(self, path: str) -> bool:
        """Remove a folder and what it holds; return True when it was there."""
        there = Path(path).is_dir()
        shutil.rmtree(path, ignore_errors=True)
        return there


class LoginNode(LocalClient):
    """The cluster's login node over SSH (gpuflow.tasks.ssh: key only, its host key
    checked, one connection shared by a run's commands)."""

    remote = True

    def __init__(
        self,
        host: str,
        user: str,
        port: int = 22,
        key: str | None = None,
        known_hosts: str | None = None,
        key_name: str | None = None,
    ) -> None:
        self.host, self.user, self.port, self.key_name = host, user, port, key_name
        self.where = f"the login node {user}@{host}:{port} over SSH"
        self.target = SshTarget(
            Endpoint(host, user, port),
            "the login node",
            key=key,
            known_hosts=known_hosts,
            key_name=key_name,
            fields={"key": "ssh_key", "known_hosts": "known_hosts", "address": "login_host"},
        )

    def describe(self) -> str:
        return self.where

    def close(self) -> None:
        """End the shared connection and remove the key."""
        self.target.close()

    def _ssh(self, remote: str) -> list[str]:
        return self.target.argv(remote)

    def check(self) -> None:
        """Raise InvalidSpec when the login node cannot be reached as configured (refused
        key, unknown or changed host key, no answer) or has no Slurm client."""
        if shutil.which("ssh") is None:
            raise InvalidSpec(
                "login_host: reaching the Slurm cluster over SSH needs ssh on this machine;"
                " install openssh-client."
            )
        done = _ran(["ssh"], self._ssh("command -v sbatch squeue srun scancel"))
        if done.returncode == SSH_FAILED:
            raise InvalidSpec(self._ssh_failure(done.stderr))
        if done.returncode != 0:
            raise InvalidSpec(
                f"login_host: {self.where} has no Slurm client (sbatch, srun, squeue, scancel"
                " on its PATH); name the cluster's login node."
            )

    def _ssh_failure(self, stderr: str) -> str:
        """Return what went wrong reaching the login node, in one sentence with its fix."""
        return self.target.failure(stderr)

    def answer(self, argv: list[str]) -> subprocess.CompletedProcess:
        done = _ran(argv, self._ssh(shlex.join(argv)))
        if done.returncode == SSH_FAILED:
            raise ProvisionError(self._ssh_failure(done.stderr))
        return done

    def start(self, argv: list[str], env: Mapping[str, str]) -> subprocess.Popen:
        """Start a Slurm command on the login node; its variables go through ssh's standard
        input (read by the remote shell before it starts the command), never its command
        line, where the login node's other users would see them."""
        remote = f". /dev/stdin; exec {shlex.join(argv)}"
        proc = subprocess.Popen(
            self._ssh(remote),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdin is not None
        script = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())
        proc.stdin.write(script.encode())
        proc.stdin.close()
        return proc

    def make_dir(self, path: str) -> None:
        self.run(["mkdir", "-p", "--", path])

    def put_file(self, source: Path, path: str) -> None:
        """Send a file of this machine to `path` on the login node, through ssh's input."""
        with open(source, "rb") as data:
            done = subprocess.run(
                self._ssh(shlex.join(["sh", "-c", 'cat > "$1"', "put", path])),
                stdin=data,
                capture_output=True,
                check=False,
            )
        if done.returncode == SSH_FAILED:
            raise ProvisionError(self._ssh_failure(done.stderr.decode(errors="replace")))
        if done.returncode != 0:
            raise ProvisionError(
                f"could not write {path} on {self.where}: {said(done.stderr.decode(errors='replace'))}"
            )

    def remove_dir(self, path: str) -> bool:
        done = self.answer(["sh", "-c", 'test -d "$1" && rm -rf -- "$1"', "rm", path])
        return done.returncode == 0


def _ran(argv: list[str], command: list[str]) -> subprocess.CompletedProcess:
    """Run `command` (which runs `argv` here or on the login node) and return how it ended;
    ProvisionError when it did not answer or could not start."""
    try:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ProvisionError(
            f"`{argv[0]}` did not answer within {TIMEOUT_S:.0f} s: the cluster's slurmctld is"
            " busy or unreachable from here"
        ) from None
    except OSError as exc:
        raise ProvisionError(f"`{argv[0]}` could not be started: {exc.strerror}") from None


HERE = LocalClient()
