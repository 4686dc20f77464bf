"""Packs root file system tarballs into an OCI image archive that `ctr images import` takes:
the test cluster's real node runs images built here (no registry is reachable).

    python3 oci_image.py --name gpuflow.local/gpuflow-job:testbed --layer rootfs.tar \
        --layer app.tar --env PATH=/usr/bin:/bin --workdir /workspace --out image.tar

Layers are kept uncompressed (`...layer.v1.tar`): containerd unpacks them in one pass and
the archive is only ever read on this machine. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

LAYER = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _digest_of(path: Path) -> tuple[str, int]:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return f"sha256:{sha.hexdigest()}", path.stat().st_size


def _unpacked_digest(path: Path) -> str:
    """The digest of a gzip layer's tar (its diff id)."""
    import gzip

    sha = hashlib.sha256()
    with gzip.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return f"sha256:{sha.hexdigest()}"


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    (blobs / digest.removeprefix("sha256:")).write_bytes(data)
    return digest, len(data)


def pack(
    name: str,
    layers: list[Path],
    out: Path,
    env: list[str],
    entrypoint: list[str] | None,
    cmd: list[str] | None,
    workdir: str | None,
    user: str | None = None,
    arch: str = "amd64",
) -> str:
    """Write the image archive to `out`; return the manifest's digest."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        root = Path(tmp)
        blobs = root / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        described = []
        diff_ids = []
        for layer in layers:
            digest, size = _digest_of(layer)
            target = blobs / digest.removeprefix("sha256:")
            try:
                target.hardlink_to(layer)  # same file system: no copy of a large layer
            except OSError:
                shutil.copyfile(layer, target)
            packed = layer.name.endswith(".gz")  # kept compressed: pushed as it is
            described.append(
                {"mediaType": LAYER + ("+gzip" if packed else ""), "digest": digest, "size": size}
            )
            diff_ids.append(_unpacked_digest(layer) if packed else digest)
        config = {
            "architecture": arch,
            "os": "linux",
            "config": {
                "Env": env,
                **({"Entrypoint": entrypoint} if entrypoint else {}),
                **({"Cmd": cmd} if cmd else {}),
                **({"WorkingDir": workdir} if workdir else {}),
                **({"User": user} if user else {}),
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created_by": f"gpuflow testbed layer {i}"} for i in range(len(layers))],
        }
        config_digest, config_size = _blob(blobs, json.dumps(config).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": config_digest, "size": config_size},
            "layers": described,
        }
        manifest_digest, manifest_size = _blob(blobs, json.dumps(manifest).encode())
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MANIFEST,
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                    },
                }
            ],
        }
        (root / "index.json").write_text(json.dumps(index))
        (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        partial = out.with_suffix(".partial")
        with tarfile.open(partial, "w") as archive:
            for path in sorted(root.rglob("*")):
                archive.add(path, arcname=str(path.relative_to(root)), recursive=False)
        partial.replace(out)
    return manifest_digest


def single_file_layer(path: Path, source: Path, inside: str) -> None:
    """Write a layer tarball holding `source` at `inside`, executable."""
    with tarfile.open(path, "w") as layer:
        info = layer.gettarinfo(str(source), arcname=inside.lstrip("/"))
        info.mode, info.uid, info.gid, info.uname, info.gname = 0o755, 0, 0, "root", "root"
        with source.open("rb") as f:
            layer.addfile(info, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--layer", action="append", default=[], type=Path)
    parser.add_argument("--file", help="SOURCE:/PATH: one executable as the only layer")
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--entrypoint", type=json.loads, help='JSON list: ["/usr/bin/tini", "--"]')
    parser.add_argument("--cmd", type=json.loads, help="JSON list")
    parser.add_argument("--user", help="the user the image runs as, e.g. 10001")
    parser.add_argument("--workdir")
    parser.add_argument("--arch", default="amd64", help="the architecture the config names")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    layers = list(args.layer)
    if args.file:
        source, inside = args.file.split(":", 1)
        layer = args.out.with_name(args.out.name + ".layer")
        single_file_layer(layer, Path(source), inside)
        layers.append(layer)
    if not layers:
        parser.error("give --layer or --file")
    digest = pack(
        args.name,
        layers,
        args.out,
        args.env,
        args.entrypoint,
        args.cmd,
        args.workdir,
        args.user,
        args.arch,
    )
    print(f"{args.name} {digest} -> {args.out}")


if __name__ == "__main__":
    main()
