"""Reaching a machine over SSH the way gpuflow does everywhere (a Slurm login node, a
fleet's hosts): a key only (BatchMode, nothing asked), the host's key checked against the
known_hosts lines it is given (StrictHostKeyChecking), an optional jump host reached the
same way, one connection shared by a run's commands (ControlMaster). Its options live in
an ssh_config file of its own (0600, in a 0700 folder), so the jump host gets the same key
and known hosts as the target. Every failure is one sentence with its fix."""

from __future__ import annotations

import atexit
import base64
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

# ssh's own failures exit with this; the remote command's codes pass through
SSH_FAILED = 255

KEY_FOLDER = "gpuflow-ssh-"  # in the temporary folder: gpuflow-ssh-<pid>-<random>


def sweep_keys() -> list[Path]:
    """Remove this user's SSH folders (key, known hosts, config) that a gpuflow process
    made and left when it was killed; return them. A folder whose process runs is kept."""
    swept = []
    for folder in Path(tempfile.gettempdir()).glob(f"{KEY_FOLDER}*-*"):
        pid = folder.name.removeprefix(KEY_FOLDER).split("-", 1)[0]
        try:
            info = folder.lstat()
        except OSError:
            continue
        if not pid.isdigit() or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        try:  # the same process made it, not a later one given the same PID
            if psutil.Process(int(pid)).create_time() <= info.st_mtime + 1:
                continue
        except psutil.Error:
            pass
        shutil.rmtree(folder, ignore_errors=True)
        swept.append(folder)
    return swept


@dataclass(frozen=True)
class Endpoint:
    """One SSH server: where it listens and as whom gpuflow logs in."""

    host: str
    user: str
    port: int = 22

    def __str__(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


def passphrase_protected(key: str) -> bool:
    """Return True when `key` (an OpenSSH or PEM private key) needs a passphrase to use."""
    if "ENCRYPTED" in key:  # PEM: "Proc-Type: 4,ENCRYPTED" or "BEGIN ENCRYPTED PRIVATE KEY"
        return True
    if "BEGIN OPENSSH PRIVATE KEY" not in key:
        return False
    body = "".join(line for line in key.splitlines() if line and "-----" not in line)
    try:
        raw = base64.b64decode(body)
    except ValueError:
        return False
    # openssh-key-v1\0, then a length-prefixed cipher name: "none" for a key without one
    magic = b"openssh-key-v1\x00"
    if not raw.startswith(magic) or len(raw) < len(magic) + 4:
        return False
    size = int.from_bytes(raw[len(magic) : len(magic) + 4], "big")
    return raw[len(magic) + 4 : len(magic) + 4 + size] != b"none"


def public_key_of(key: str) -> str:
    """Return the public key line of private `key` (no passphrase), as authorized_keys
    takes it. ValueError when ssh-keygen cannot read it."""
    with tempfile.TemporaryDirectory(prefix="gpuflow-key-") as folder:
        path = Path(folder) / "key"
        path.touch(mode=0o600)
        path.write_text(key if key.endswith("\n") else key + "\n")
        done = subprocess.run(
            ["ssh-keygen", "-y", "-f", str(path)], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        raise ValueError(f"ssh-keygen could not read the key: {done.stderr.strip()}")
    return done.stdout.strip()


class SshTarget:
    """A machine reached over SSH. `what` names it in sentences ("the login node",
    "fleet host gpu1"); `fields` names the settings a fix changes (key, known_hosts,
    address) as the user wrote them."""

    def __init__(
        self,
        endpoint: Endpoint,
        what: str,
        key: str | None = None,
        known_hosts: str | None = None,
        jump: Endpoint | None = None,
        key_name: str | None = None,
        fields: dict[str, str] | None = None,
        connect_timeout_s: int = 15,
        persist_s: int = 30,
    ) -> None:
        self.endpoint, self.what, self.jump, self.key_name = endpoint, what, jump, key_name
        self.fields = {"key": "ssh_key", "known_hosts": "known_hosts", "address": "host"}
        self.fields.update(fields or {})
        # 0700: the key stays private; named by this process, so `gpuflow reap` removes it
        # once the process is gone (a SIGKILL skips atexit)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{KEY_FOLDER}{os.getpid()}-"))
        atexit.register(self.close)
        lines = [
            "BatchMode yes",
            "StrictHostKeyChecking yes",
            f"ConnectTimeout {connect_timeout_s}",
            "ServerAliveInterval 5",
            "ServerAliveCountMax 3",
            "LogLevel ERROR",
        ]
        if key:
            key_file = self._dir / "key"
            key_file.touch(mode=0o600)
            key_file.write_text(key if key.endswith("\n") else key + "\n")
            lines += [f"IdentityFile {key_file}", "IdentitiesOnly yes"]
        if known_hosts:
            hosts_file = self._dir / "known_hosts"
            hosts_file.write_text(known_hosts if known_hosts.endswith("\n") else known_hosts + "\n")
            lines += [f"UserKnownHostsFile {hosts_file}", "GlobalKnownHostsFile /dev/null"]
        # the target: one shared connection; the jump host (when there is one): the same rules
        target = [
            f"HostName {endpoint.host}",
            f"User {endpoint.user}",
            f"Port {endpoint.port}",
            "ControlMaster auto",
            f"ControlPath {self._dir}/master",
            f"ControlPersist {persist_s}",
        ]
        if jump:
            target.append("ProxyJump gpuflow-jump")
        text = "Host gpuflow-target\n" + "".join(f"  {line}\n" for line in target)
        if jump:
            text += (
                f"Host gpuflow-jump\n  HostName {jump.host}\n  User {jump.user}\n"
                f"  Port {jump.port}\n"
            )
        text += "Host *\n" + "".join(f"  {line}\n" for line in lines)
        self._config = self._dir / "config"
        self._config.touch(mode=0o600)
        self._config.write_text(text)

    def __str__(self) -> str:
        via = f" through {self.jump}" if self.jump else ""
        return f"{self.what} {self.endpoint}{via}"

    def argv(self, remote: str) -> list[str]:
        """Return the ssh command line that runs `remote` (a shell command) there."""
        return ["ssh", "-F", str(self._config), "gpuflow-target", remote]

    def close(self) -> None:
        """End the shared connection (its master would linger) and remove the key."""
        if (self._dir / "master").exists():
            subprocess.run(
                ["ssh", "-F", str(self._config), "-O", "exit", "gpuflow-target"],
                capture_output=True,
                timeout=10,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        shutil.rmtree(self._dir, ignore_errors=True)

    def failure(self, stderr: str) -> str:
        """Return what went wrong reaching the machine (ssh's own words on `stderr`), in one
        sentence with its fix."""
        text = stderr.replace("\r", "")
        where = f"{self.what} {self.endpoint.host}:{self.endpoint.port}"
        known = self.fields["known_hosts"]
        if "IDENTIFICATION HAS CHANGED" in text or ("key for" in text and "differs" in text):
            return (
                f"{known}: {where} shows a host key other than the one {known} has for it"
                " (a changed host, or someone between); check the host's key with its"
                f" administrators and update {known}."
            )
        if "Host key verification failed" in text or ("No " in text and "host key" in text):
            return (
                f"{known}: no host key is known for {where}; put its line"
                f" (`ssh-keyscan -p {self.endpoint.port} {self.endpoint.host}`, checked) in"
                f" {known}."
            )
        if "Permission denied" in text:
            key = f"the key of Secret block {self.key_name!r}" if self.key_name else "the key"
            user = self.endpoint.user
            return (
                f"{self.fields['key']}: {where} refuses {key} for user {user}; add its public"
                f" key to ~{user}/.ssh/authorized_keys there, or name the right key."
            )
        said = "; ".join(line.strip() for line in text.splitlines() if line.strip()) or "no answer"
        return f"{self.fields['address']}: cannot reach {where} over SSH: {said}."

    def run(
        self, remote: str, data: bytes | None = None, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess:
        """Run `remote` there, with `data` on its standard input; return how it ended (ssh's
        own failure: exit 255). TimeoutError names the machine when it does not answer."""
        try:
            return subprocess.run(
                self.argv(remote),
                input=data if data is not None else b"",
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self} did not answer within {timeout_s:.0f} s") from None

    def start(self, remote: str) -> subprocess.Popen:
        """Start `remote` there with pipes for its input and output (in a session of its own
        here: a Ctrl-C meant for gpuflow does not cut it)."""
        return subprocess.Popen(
            self.argv(remote),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )


def remote_command(argv: list[str]) -> str:
    """Return `argv` as one shell command line for the remote side."""
    return shlex.join(argv)
