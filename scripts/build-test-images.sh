#!/usr/bin/env bash
# Builds the images the container tests run (tests/e2e/test_images.py), without a registry
# or a network beyond Debian's mirror, as OCI archives the tests push to their local
# registry (scripts/registry.sh):
#
#   py.tar        Debian bookworm (essential) with python3 and procps: a small user image
#   py-boto.tar   the same with boto3 (a job that keeps its checkpoint in S3)
#   py-cu130.tar  the same with a stand-in torch built for CUDA 13.0 (newer than the host's)
#   py-arm64.tar  the same files, its config saying arm64 (an image for another machine)
#   noshell.tar   one static program and nothing else (no /bin/sh)
#   py-mpi.tar    Debian with python3, numpy and Open MPI, and no gpuflow: the matmul and hpc
#                 kinds' units run in it with the gpuflow brought in (own_wheel.library)
#
# Cached under $GPUFLOW_TESTBED_CACHE/images (default ~/.cache/gpuflow/testbed/images) by
# what goes in; prints the folder. Needs root (mmdebstrap keeps the files' owners).
#
#   build-test-images.sh --blender   builds (or finds) blender.tar only and prints its path:
#     gpuflow's job image's Debian layer (python3 and Blender, no gpuflow; built by
#     scripts/build-image.sh) and `blender-in-image`, a Blender this machine does not have
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${GPUFLOW_TESTBED_CACHE:-$HOME/.cache/gpuflow/testbed}/images
SUITE=bookworm
DEBS=python3,procps
MPI_DEBS=python3,procps,python3-numpy,openmpi-bin
die() { printf 'build-test-images: %s\n' "$*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "building the images needs root (mmdebstrap keeps the files' owners)"
if [[ ${1:-} == --blender ]]; then
  bash "$ROOT/scripts/build-image.sh" >/dev/null
  read -r base _ <"$CACHE/gpuflow-job-testbed.tar.layers"
  [[ -f $base.gz ]] || { gzip -n -1 -c "$base" >"$base.gz.partial" && mv "$base.gz.partial" "$base.gz"; }
  out=$CACHE/user/blender-$(basename "$base" .tar).tar
  if [[ ! -f $out ]]; then
    mkdir -p "$CACHE/user"
    wrapper=$(mktemp)
    printf '#!/bin/sh\nexec /usr/bin/blender "$@"\n' >"$wrapper"
    python3 "$ROOT/scripts/testbed/oci_image.py" --name gpuflow.test/blender:1 --layer "$base.gz" \
      --file "$wrapper:/usr/local/bin/blender-in-image" \
      --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --out "$out.partial" >&2
    rm -f "$wrapper" "$out.partial.layer"
    mv "$out.partial" "$out"
  fi
  echo "$out"
  exit 0
fi
command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed: apt-get install mmdebstrap"
mkdir -p "$CACHE"
key=$(printf '%s' "$SUITE $DEBS" | sha256sum | cut -c1-16)
rootfs=$CACHE/user-py-$key.tar
if [[ ! -f $rootfs ]]; then
  echo "[test images] Debian $SUITE with $DEBS (mmdebstrap: about 20 s)" >&2
  mirror=http://deb.debian.org/debian
  mmdebstrap --quiet --variant=essential --format=tar --include="$DEBS" \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/* "$1"/usr/share/locale/*' \
    "$SUITE" "$rootfs.partial" "deb $mirror $SUITE main"
  mv "$rootfs.partial" "$rootfs"
fi
mpi_rootfs=$CACHE/user-mpi-$(printf '%s' "$SUITE $MPI_DEBS" | sha256sum | cut -c1-16).tar
if [[ ! -f $mpi_rootfs ]]; then
  echo "[test images] Debian $SUITE with $MPI_DEBS (mmdebstrap: about 25 s)" >&2
  mmdebstrap --quiet --variant=essential --format=tar --include="$MPI_DEBS" \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/* "$1"/usr/share/locale/*' \
    "$SUITE" "$mpi_rootfs.partial" "deb http://deb.debian.org/debian $SUITE main"
  mv "$mpi_rootfs.partial" "$mpi_rootfs"
fi
# boto3 for the image's own python3 (a job that keeps its checkpoint in S3), from .venv's
# pip and its cache: the same versions gpuflow runs with, pure Python
boto_pin=$("$ROOT/.venv/bin/python" -c 'import boto3, botocore; print(f"boto3=={boto3.__version__} botocore=={botocore.__version__}")')
boto=$CACHE/user-boto-$(printf '%s' "$boto_pin" | sha256sum | cut -c1-16).tar
if [[ ! -f $boto ]]; then
  echo "[test images] $boto_pin for the image's python3" >&2
  work=$(mktemp -d)
  # shellcheck disable=SC2086
  "$ROOT/.venv/bin/pip" install --quiet --disable-pip-version-check --no-compile \
    --target "$work/usr/lib/python3/dist-packages" $boto_pin
  rm -rf "$work/usr/lib/python3/dist-packages/bin"
  chmod 755 "$work"
  tar --create --file "$boto.partial" --directory "$work" --owner=0 --group=0 --numeric-owner --sort=name .
  mv "$boto.partial" "$boto"
  rm -rf "$work"
fi
# a stand-in torch built for CUDA 13.0 (what the host's driver, 12.4 in the fake NVML, cannot
# run): preflight reads the version and CUDA build from inside the image
fake_torch=$CACHE/user-torch-cu130.tar
if [[ ! -f $fake_torch ]]; then
  work=$(mktemp -d)
  mkdir -p "$work/usr/lib/python3/dist-packages/torch"
  cat >"$work/usr/lib/python3/dist-packages/torch/__init__.py" <<'PY'
"""A stand-in for torch 2.9.0 built for CUDA 13.0: its version and CUDA build only."""
__version__ = "2.9.0+cu130"
class version:  # noqa: N801
    cuda = "13.0"
class cuda:  # noqa: N801
    @staticmethod
    def is_available():
        return False
    @staticmethod
    def device_count():
        return 0
PY
  chmod -R a+rX "$work"
  tar --create --file "$fake_torch.partial" --directory "$work" --owner=0 --group=0 --numeric-owner --sort=name .
  mv "$fake_torch.partial" "$fake_torch"
  rm -rf "$work"
fi
# the layers kept compressed: each push to the tests' registry sends them as they are
for layer in "$rootfs" "$boto" "$fake_torch" "$mpi_rootfs"; do
  [[ -f $layer.gz ]] || { gzip -n -1 -c "$layer" >"$layer.gz.partial" && mv "$layer.gz.partial" "$layer.gz"; }
done
out=$CACHE/user
mkdir -p "$out"
pack=(python3 "$ROOT/scripts/testbed/oci_image.py")
path=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
stamp=$out/.built-$key-$({ cat "$ROOT/scripts/testbed/oci_image.py"; echo "$boto $fake_torch $mpi_rootfs gzip"; } | sha256sum | cut -c1-16)
if [[ ! -f $stamp ]]; then
  rm -f "$out"/.built-*
  "${pack[@]}" --name gpuflow.test/py:1 --layer "$rootfs.gz" --env "$path" --cmd '["python3"]' --out "$out/py.tar" >&2
  "${pack[@]}" --name gpuflow.test/py-boto:1 --layer "$rootfs.gz" --layer "$boto.gz" --env "$path" --out "$out/py-boto.tar" >&2
  "${pack[@]}" --name gpuflow.test/py-cu130:1 --layer "$rootfs.gz" --layer "$fake_torch.gz" --env "$path" --out "$out/py-cu130.tar" >&2
  "${pack[@]}" --name gpuflow.test/py-mpi:1 --layer "$mpi_rootfs.gz" --env "$path" --out "$out/py-mpi.tar" >&2
  "${pack[@]}" --name gpuflow.test/py-arm64:1 --layer "$rootfs.gz" --env "$path" --arch arm64 --out "$out/py-arm64.tar" >&2
  registry=$(bash "$ROOT/scripts/registry.sh" path)
  "${pack[@]}" --name gpuflow.test/noshell:1 --file "$registry:/hello" --env "$path" --out "$out/noshell.tar" >&2
  rm -f "$out/noshell.tar.layer"
  touch "$stamp"
fi
echo "$out"
