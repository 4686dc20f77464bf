"""The container test bed: podman configured for this machine, fake GPUs described by a CDI
spec, and a local OCI registry on loopback (scripts/registry.sh) holding the user images
scripts/build-test-images.sh builds, one repository behind basic auth.

What it does not model: a registry over TLS (the engine is told this one is plain HTTP,
as a user's registries.conf would), Docker Hub's token service (the registry challenges
with Basic), and real GPUs (the CDI devices are character devices with /dev/null's
numbers: a container sees the nodes, no driver behind them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
USER, PASSWORD = "gpuflow-test", "registry-pass-9f8e7d"
CDI_SPEC = Path("/var/run/cdi/gpuflow-testbed.yaml")
FAKE_DEVICES = Path("/run/gpuflow-testbed/dev")
GPUS = 8  # as many as any test's fake NVML gives


@dataclass
class ImageBed:
    """Where the registry listens and what a `gpuflow` process needs to use it."""

    host: str  # 127.0.0.1:PORT
    env: dict[str, str] = field(default_factory=dict)

    def ref(self, name: str, private: bool = False) -> str:
        return f"{self.host}/{'private' if private else 'public'}/{name}:1"


def _containers_conf(folder: Path, registry: str) -> dict[str, str]:
    """containers.conf: no raised ulimits (this machine's sandbox refuses raising them in a
    container) and runc (crun refuses the hybrid cgroup layout here); registries.conf: the
    local registry speaks plain HTTP."""
    conf = folder / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n')
    registries = folder / "registries.conf"
    registries.write_text(f'[[registry]]\nlocation = "{registry}"\ninsecure = true\n')
    return {"CONTAINERS_CONF": str(conf), "CONTAINERS_REGISTRIES_CONF": str(registries)}


def _cdi_spec() -> None:
    """Fake GPU device nodes and the CDI spec naming them nvidia.com/gpu=0..7, written as
    the NVIDIA Container Toolkit writes one (the same content from every test worker)."""
    FAKE_DEVICES.mkdir(parents=True, exist_ok=True)
    devices = []
    for index in range(GPUS):
        node = FAKE_DEVICES / f"nvidia{index}"
        if not node.exists():
            with contextlib.suppress(FileExistsError):
                os.mknod(node, 0o666 | 0o020000, os.makedev(1, 3))
        devices.append(
            f'- name: "{index}"\n  containerEdits:\n    deviceNodes:\n'
            f"    - path: /dev/nvidia{index}\n      hostPath: {node}\n"
        )
    text = 'cdiVersion: "0.5.0"\nkind: nvidia.com/gpu\ndevices:\n' + "".join(devices)
    CDI_SPEC.parent.mkdir(parents=True, exist_ok=True)
    partial = CDI_SPEC.with_name(f".{CDI_SPEC.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(CDI_SPEC)


def _push(archive: Path, target: str, creds: bool) -> None:
    args = ["skopeo", "copy", "-q", "--dest-tls-verify=false"]
    if creds:
        args += ["--dest-creds", f"{USER}:{PASSWORD}"]
    done = subprocess.run(
        [*args, f"oci-archive:{archive}", f"docker://{target}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _built() -> tuple[Path, str]:
    """The user images' folder and the registry's program (built or cached)."""
    images = Path(
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "build-test-images.sh")],
            capture_output=True, text=True, check=True, timeout=900,
        ).stdout.strip()
    )  # fmt: skip
    binary = subprocess.run(
        ["bash", str(ROOT / "scripts" / "registry.sh"), "path"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout.strip()  # fmt: skip
    return images, binary


@contextlib.contextmanager
def registry(
    folder: Path, listen: str = "127.0.0.1:0", images: tuple[str, ...] = ()
) -> Iterator[ImageBed]:
    """A registry on `listen` with `images` (py, py-private, py-arm64, noshell) pushed,
    and the engine's settings for it in `folder`; stopped by PID."""
    built, binary = _built()
    folder.mkdir(parents=True, exist_ok=True)
    auth = folder / "auth"
    auth.write_text(f"{USER}:{PASSWORD}\n")
    port_file = folder / "port"
    log = (folder / "registry.log").open("w")
    proc = subprocess.Popen(
        [binary, "-listen", listen, "-auth", str(auth), "-port-file", str(port_file)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, (folder / "registry.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the registry never listened"
            time.sleep(0.05)
        address = listen.rsplit(":", 1)[0]
        bed = ImageBed(host=f"{address}:{port_file.read_text().strip()}")
        bed.env = _containers_conf(folder, bed.host)
        _cdi_spec()
        for name in images:
            private = name.endswith("-private")
            archive = built / f"{name.removesuffix('-private')}.tar"
            _push(archive, bed.ref(name.removesuffix("-private"), private), creds=private)
        yield bed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


@contextlib.contextmanager
def image_bed(folder: Path) -> Iterator[ImageBed]:
    """The registry on loopback with every user image; skipped where the bed cannot be."""
    if os.geteuid() != 0 or shutil.which("podman") is None or shutil.which("skopeo") is None:
        pytest.skip("the container test bed needs root, podman and skopeo (scripts/setup.sh)")
    with registry(
        folder, images=("py", "py-private", "py-boto", "py-cu130", "py-arm64", "noshell", "py-mpi")
    ) as bed:
        yield bed


# torch and what `import torch` and its launcher import, as this machine's venv has them
TORCH_STACK = (
    "torch", "torchgen", "functorch", "nvidia", "triton", "numpy", "numpy.libs", "sympy",
    "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "typing_extensions.py",
    "PIL", "pillow.libs",  # the classify task's images
)  # fmt: skip
TORCH_SITE = "/opt/torch-site"


def with_torch(bed: ImageBed, folder: Path) -> dict[str, str]:
    """The engine settings of `bed` with this machine's torch stack mounted read-only in
    every container at TORCH_SITE (a job puts it on PYTHONPATH): a stand-in for a user's
    torch image, whose CUDA build is several GB, made without copying a file."""
    import torch

    site = Path(torch.__file__).parents[1]
    volumes = [f"{site / p}:{TORCH_SITE}/{p}:ro" for p in TORCH_STACK if (site / p).exists()]
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "containers.conf"
    base = Path(bed.env["CONTAINERS_CONF"]).read_text()
    listed = ", ".join(f'"{v}"' for v in volumes)
    conf.write_text(base.replace("[containers]\n", f"[containers]\nvolumes = [{listed}]\n", 1))
    return {**bed.env, "CONTAINERS_CONF": str(conf)}


def push_blender(bed: ImageBed) -> str:
    """Push the Blender image (scripts/build-test-images.sh --blender: python3 and Blender,
    no gpuflow, `blender-in-image` a Blender this machine lacks) to `bed`; its reference."""
    archive = Path(
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "build-test-images.sh"), "--blender"],
            capture_output=True, text=True, check=True, timeout=1800,
        ).stdout.strip()
    )  # fmt: skip
    _push(archive, bed.ref("blender"), creds=False)
    return bed.ref("blender")


def containers_of(run: str) -> list[str]:
    """The names of the containers gpuflow made on this machine for the run whose id
    starts `run` (tests beside it on this machine make containers of their own)."""
    done = subprocess.run(
        ["podman", "ps", "--all", "--filter", "label=io.gpuflow.cluster",
         "--format", '{{.Names}} {{index .Labels "io.gpuflow.cluster"}}'],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    found = [line.split() for line in done.stdout.splitlines() if line.strip()]
    return [name for name, cluster in found if run and run in cluster]


def run_of(home: Path) -> str:
    """The id of the run a gpuflow with GPUFLOW_HOME `home` runs on this machine now (its
    cluster record), waiting up to 120 s for it."""
    deadline = time.monotonic() + 120
    while not (found := list((home / "local" / "clusters").glob("gpuflow-*.json"))):
        assert time.monotonic() < deadline, "the run never made its cluster"
        time.sleep(0.1)
    return found[0].stem.removeprefix("gpuflow-")
