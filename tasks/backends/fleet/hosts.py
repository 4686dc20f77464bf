"""A fleet's hosts over SSH: reaching one (its key from a Secret block, its host key
checked, its jump host), putting gpuflow there (this gpuflow's own wheel, pushed from here:
the hosts may have no internet), and checking it (Python, NVML's GPUs, free disk)."""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gpuflow.tasks import own_wheel
from gpuflow.tasks.errors import InvalidSpec, ProvisionError
from gpuflow.tasks.ssh import SSH_FAILED, Endpoint, SshTarget, passphrase_protected

if TYPE_CHECKING:
    from gpuflow.blocks.gpu_fleet import FleetHost, GpuFleet, HostCheck

REMOTE = "gpuflow.tasks.backends.local.remote"  # what a host runs: the local backend
MIN_PYTHON = (3, 11)
MIN_DISK_GIB = 1.0
NOT_INSTALLED = 3  # the wrapper's exit code when this gpuflow's wheel is not on the host

# Where the wheel lives on a host: $GPUFLOW_HOME (default ~/.gpuflow)/fleet/lib/<sha>
_LIB = '"${GPUFLOW_HOME:-$HOME/.gpuflow}/fleet/lib/%s"'

# Run with the host's Python before gpuflow is there: its version and what it lacks.
_PRECHECK = r"""
import importlib.util, json, sys
missing = [m for m in %r if importlib.util.find_spec(m) is None]
print(json.dumps({"version": list(sys.version_info[:3]), "missing": missing}))
"""

# Unpack a wheel (pure Python: a zip) read on standard input into its folder, checked.
_INSTALL = r"""
import hashlib, io, os, sys, zipfile
data = sys.stdin.buffer.read()
if hashlib.sha256(data).hexdigest() != sys.argv[1]:
    sys.exit("the wheel arrived damaged (its SHA-256 differs)")
lib = sys.argv[2]
tmp = lib + ".part-%d" % os.getpid()
os.makedirs(tmp, mode=0o700)
zipfile.ZipFile(io.BytesIO(data)).extractall(tmp)
try:
    os.rename(tmp, lib)
except OSError:  # another process installed it meanwhile
    import shutil; shutil.rmtree(tmp, ignore_errors=True)
"""

_WHEEL: list[tuple[str, bytes, str]] = []
_WHEEL_LOCK = threading.Lock()


def this_wheel() -> tuple[str, bytes, str]:
    """Return this gpuflow's wheel (name, bytes, SHA-256), built once per process."""
    with _WHEEL_LOCK:
        if not _WHEEL:
            name, data = own_wheel.build()
            _WHEEL.append((name, data, own_wheel.sha256(data)))
        return _WHEEL[0]


def _jump(text: str | None) -> Endpoint | None:
    if not text:
        return None
    user, _, rest = text.rpartition("@")
    host, _, port = rest.partition(":")
    return Endpoint(host, user, int(port or 22))


def target(fleet: GpuFleet, host: FleetHost, key_of: Callable[[str], str]) -> SshTarget:
    """Return how to reach `host`: its key (or the fleet's) read with `key_of` from its
    Secret block; InvalidSpec for a key with a passphrase or no key at all."""
    key_name = host.ssh_key or fleet.ssh_key
    if not key_name:
        raise InvalidSpec(
            f"hosts: host {host.label} has no ssh_key and the fleet none; name the Secret"
            " block that holds the private key the host accepts."
        )
    key = key_of(key_name)
    if passphrase_protected(key):
        raise InvalidSpec(
            f"ssh_key: the key in Secret block {key_name!r} (host {host.label}) is protected"
            " by a passphrase, which nothing can type here; save a key without one"
            " (`ssh-keygen -p -N ''` on a copy) for gpuflow."
        )
    if not host.known_hosts.strip():
        raise InvalidSpec(
            f"hosts: host {host.label} has no known_hosts line, so its key cannot be checked;"
            f" add `ssh-keyscan -p {host.port} {host.address}` (checked) as its known_hosts."
        )
    return SshTarget(
        Endpoint(host.address, host.user, host.port),
        f"fleet host {host.label}",
        key=key,
        known_hosts=host.known_hosts,
        jump=_jump(host.jump),
        key_name=key_name,
        fields={"key": "ssh_key", "known_hosts": "known_hosts", "address": "address"},
    )


def gpuflow_command(host: FleetHost, sha: str, argv: list[str]) -> str:
    """Return the shell command that runs gpuflow's host program with `argv` on `host`,
    with this gpuflow's wheel first on its path (exit NOT_INSTALLED where it is not)."""
    lib = _LIB % sha
    python = shlex.quote(host.python)
    return (  # umask 077: what it writes there is the user's alone
        f'umask 077; L={lib}; [ -d "$L" ] || exit {NOT_INSTALLED}; '
        f'PYTHONPATH="$L${{PYTHONPATH:+:$PYTHONPATH}}" exec {python} -m {REMOTE} '
        + shlex.join(argv)
    )


def install(ssh: SshTarget, host: FleetHost) -> str:
    """Put this gpuflow's wheel on `host` (once: it is kept by its SHA-256); return the
    SHA. ProvisionError with the host's own words when it cannot be put there."""
    _, data, sha = this_wheel()
    lib = _LIB % sha
    python = shlex.quote(host.python)
    script = shlex.quote(_INSTALL)
    remote = (
        f'umask 077; L={lib}; [ -d "$L" ] && exit 0; mkdir -p "${{L%/*}}" &&'
        f' {python} -c {script} {sha} "$L"'
    )
    done = ssh.run(remote, data, timeout_s=120)
    if done.returncode == SSH_FAILED:
        raise ProvisionError(ssh.failure(done.stderr.decode(errors="replace")))
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        raise ProvisionError(
            f"could not put gpuflow on {ssh}: {said[-1] if said else 'no message'}"
        )
    return sha


def check_host(fleet: GpuFleet, host: FleetHost, key_of: Callable[[str], str]) -> HostCheck:
    """Reach `host`, check its Python, put gpuflow there and check its GPUs and disk;
    return what was found, with the one reason it cannot serve when it cannot."""
    from gpuflow.blocks.gpu_fleet import HostCheck

    found = HostCheck(host=host.label, ok=False, checked_at=datetime.now(UTC).isoformat())
    try:
        ssh = target(fleet, host, key_of)
    except InvalidSpec as exc:
        return found.model_copy(update={"reason": str(exc)})
    try:
        return _checked(ssh, host, found)
    except (ProvisionError, TimeoutError) as exc:
        return found.model_copy(update={"reason": str(exc)})
    finally:
        ssh.close()


def _checked(ssh: SshTarget, host: FleetHost, found: HostCheck) -> HostCheck:
    python = shlex.quote(host.python)
    script = shlex.quote(_PRECHECK % (("pydantic", "psutil", "yaml"),))
    done = ssh.run(f"command -v {python} >/dev/null || exit 127; {python} -c {script}")
    stderr = done.stderr.decode(errors="replace")
    if done.returncode == SSH_FAILED:
        return found.model_copy(update={"reason": ssh.failure(stderr)})
    if done.returncode == 127:
        return found.model_copy(
            update={
                "reason": f"python: host {host.label} has no {host.python} on its PATH; install"
                f" Python {'.'.join(map(str, MIN_PYTHON))} or newer there, or set the host's"
                " python to the interpreter's full path."
            }
        )
    pre = json_answer(done.stdout)
    version = tuple(pre.get("version", (0, 0, 0)))
    if version[:2] < MIN_PYTHON:
        return found.model_copy(
            update={
                "reason": f"python: {host.python} on host {host.label} is Python"
                f" {'.'.join(map(str, version))}; gpuflow needs"
                f" {'.'.join(map(str, MIN_PYTHON))} or newer: install it there and name it"
                " in the host's python."
            }
        )
    if pre.get("missing"):
        missing = ", ".join(pre["missing"])
        return found.model_copy(
            update={
                "reason": f"python: {host.python} on host {host.label} lacks {missing}, which"
                " gpuflow's code there imports; install them in that Python (pip install"
                " pydantic psutil pyyaml) or name one that has them."
            }
        )
    sha = install(ssh, host)
    done = ssh.run(gpuflow_command(host, sha, ["probe"]))
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        return found.model_copy(
            update={"reason": f"gpuflow's probe failed on {ssh}: {said[-1] if said else '?'}"}
        )
    probe = json_answer(done.stdout)
    gpus = probe.get("gpus", [])
    found = found.model_copy(
        update={
            "python": probe.get("python"),
            "gpus": len(gpus),
            "products": sorted({g["product"] for g in gpus}),
            "driver": probe.get("driver"),
            "cpus": probe.get("cpus", 0),
            "disk_free_gib": probe.get("disk_free_gib", 0.0),
            "wheel": sha,
        }
    )
    if host.gpus is not None and len(gpus) < host.gpus:
        seen = "no NVML" if not probe.get("nvml") else f"{len(gpus)}"
        return found.model_copy(
            update={
                "reason": f"gpus: host {host.label} should have {host.gpus} GPU(s) but NVML"
                f" sees {seen}"
                + (f" ({probe.get('nvml_reason')})" if not probe.get("nvml") else "")
                + "; check its driver and GPUs, or set its gpus to what it has."
            }
        )
    if found.disk_free_gib < MIN_DISK_GIB:
        return found.model_copy(
            update={
                "reason": f"disk: host {host.label} has {found.disk_free_gib} GiB free under"
                f" {probe.get('home')}; free at least {MIN_DISK_GIB} GiB there."
            }
        )
    return found.model_copy(update={"ok": True})


def json_answer(data: bytes) -> dict[str, Any]:
    """Return the last JSON object a host program printed (its answer), or {}."""
    for line in reversed(data.decode(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return {}
