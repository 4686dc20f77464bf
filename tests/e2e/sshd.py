"""A login node for the Slurm test cluster: a real sshd on 127.0.0.1 (key-only, its own
host key, the cluster's SLURM_CONF in its sessions), started and stopped by PID."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import free_port


def keypair(folder: Path, name: str) -> tuple[str, str]:
    """Return a new ed25519 key pair (private, public) made with ssh-keygen."""
    path = folder / name
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path)], check=True
    )
    return path.read_text(), (folder / f"{name}.pub").read_text()


class LoginNode:
    """sshd on a free loopback port that lets in `authorized` keys only, as root."""

    def __init__(self, folder: Path, slurm_conf: Path, authorized: list[str]) -> None:
        self.folder, self.port = folder, free_port()
        folder.mkdir(parents=True, exist_ok=True)
        self.host_key, public = keypair(folder, "host_key")
        # a known_hosts line for this sshd: "[127.0.0.1]:PORT ssh-ed25519 AAAA..."
        self.known_hosts = f"[127.0.0.1]:{self.port} {' '.join(public.split()[:2])}\n"
        (folder / "authorized_keys").write_text("".join(authorized))
        config = folder / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {folder / 'host_key'}\n"
            f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPidFile {folder / 'sshd.pid'}\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n"
            f"StrictModes no\nSetEnv SLURM_CONF={slurm_conf}\nLogLevel VERBOSE\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation folder
        self.proc = subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-f", str(config), "-E", str(folder / "sshd.log")],
            stdin=subprocess.DEVNULL,
        )
        until = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None, (folder / "sshd.log").read_text()
                assert time.monotonic() < until, "sshd did not listen"
                time.sleep(0.05)

    def log(self) -> str:
        return (self.folder / "sshd.log").read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
