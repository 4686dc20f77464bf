#!/usr/bin/env bash
# Builds gpuflow's job image for the test cluster's real node (and for any cluster without a
# registry at hand), from Debian packages and PyPI, without a container engine:
#
#   scripts/build-image.sh                    build what changed; prints the archive's path
#   scripts/build-image.sh --import SOCKET    and import it into that containerd (k8s.io)
#
# Three layers, each cached under $GPUFLOW_TESTBED_CACHE/images (default
# ~/.cache/gpuflow/testbed/images) by what goes into it:
#   1. Debian bookworm (mmdebstrap, minbase): python3, Blender (render pods), tini, procps
#   2. gpuflow's Python dependencies (pip --target /opt/gpuflow-deps, this machine's pip
#      cache), torch, webdataset and mpi4py left out; their programs (prefect, ...) on PATH
#   3. gpuflow itself at /opt/gpuflow (gpuflow, with its links to flows, tasks and blocks;
#      prefect.yaml), where
#      prefect.yaml's pull step looks for it, installed there (its `gpuflow` program and the
#      entry point that names the worker type gpuflow-kubernetes)
# So the image runs unit pods and flow-run pods alike (`prefect flow-run execute`).
# The image runs as uid 10001, like infra/docker/Dockerfile's, which describes the same image
# for a cluster with a registry (and a CUDA base and torch: that one trains; this one does not).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${GPUFLOW_TESTBED_CACHE:-$HOME/.cache/gpuflow/testbed}/images
NAME=gpuflow.local/gpuflow-job:testbed
SUITE=bookworm
DEBS=python3,python-is-python3,ca-certificates,procps,tini,blender
# gpuflow's dependencies less torch, webdataset and mpi4py (no training or MPI here); with
# matplotlib, which a flow-run pod's pipeline draws the run's utilisation with
PIP_DEPS=("prefect>=3.9,<4" "pydantic>=2.7,<3" "pyyaml>=6" "psutil>=5.9" "nvidia-ml-py>=12.535"
  "matplotlib>=3.8" "boto3>=1.34" "prefect-aws>=0.5" "prefect-kubernetes>=0.7" "pillow>=10")
START=$SECONDS
say() { printf '[image] %s (%ds)\n' "$*" $((SECONDS - START)) >&2; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

import_into=
while (($#)); do
  case $1 in
  --import) import_into=$2; shift 2 ;;
  *) die "unknown option $1; use: $0 [--import CONTAINERD_SOCKET]" ;;
  esac
done
[[ $(id -u) -eq 0 ]] || die "building the image needs root (mmdebstrap keeps the files' owners)"
command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed: apt-get install mmdebstrap"
mkdir -p "$CACHE"
key() { printf '%s' "$*" | sha256sum | cut -c1-16; }
tar_dir() { # tar_dir DIR OUT: the folder's contents as a layer, owned by root
  chmod 755 "$1"  # the layer's root: mktemp made it 700
  tar --create --file "$2.partial" --directory "$1" --owner=0 --group=0 --numeric-owner --sort=name .
  mv "$2.partial" "$2"
}

# 1. Debian
base=$CACHE/base-$(key "$SUITE $DEBS").tar
if [[ ! -f $base ]]; then
  say "Debian $SUITE with $DEBS (mmdebstrap: a few minutes the first time)"
  mirror=http://deb.debian.org/debian
  mmdebstrap --quiet --variant=minbase --include="$DEBS" --format=tar \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
    --customize-hook='chroot "$1" useradd --create-home --uid 10001 gpuflow' \
    "$SUITE" "$base.partial" "deb $mirror $SUITE main" "deb $mirror $SUITE-updates main" \
    "deb http://deb.debian.org/debian-security $SUITE-security main"
  mv "$base.partial" "$base"
fi

# 2. Python dependencies, with the pip of .venv (the same Python minor as Debian's: 3.11,
# so its wheels and compiled files fit)
pip=$ROOT/.venv/bin/pip
[[ -x $pip ]] || die "no .venv: run scripts/setup.sh first (its pip and cache build the image)"
DEPS_DIR=/opt/gpuflow-deps
deps=$CACHE/deps-$(key "$DEPS_DIR ${PIP_DEPS[*]}").tar
if [[ ! -f $deps ]]; then
  say "Python packages: ${PIP_DEPS[*]}"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$pip" install --quiet --disable-pip-version-check --target "$work$DEPS_DIR" "${PIP_DEPS[@]}"
  # pip writes this machine's interpreter into its programs: the image's is /usr/bin/python3
  rm -rf "$work$DEPS_DIR/bin/__pycache__"
  find "$work$DEPS_DIR/bin" -maxdepth 1 -type f -exec sed -i '1s|^#!.*python.*$|#!/usr/bin/python3|' {} +
  tar_dir "$work" "$deps"
  rm -rf "$work"
  trap - EXIT
fi

# 3. gpuflow's own code (changes often: small)
CODE=(gpuflow flows tasks blocks deployments pyproject.toml prefect.yaml)
sources=$(cd "$ROOT" && { git ls-files -co --exclude-standard -- "${CODE[@]}" 2>/dev/null ||
  find "${CODE[@]}" -type f; } | grep -v '/__pycache__/\|\.pyc$' | sort)
# gpuflow/tasks, gpuflow/flows and gpuflow/blocks are links to the top-level folders: the
# archive keeps them as links (so /opt/gpuflow on PYTHONPATH imports gpuflow.tasks), the key
# hashes what they point to
app=$CACHE/app-$(key "$(cd "$ROOT" && for f in $sources; do
  if [[ -L $f ]]; then echo "$f -> $(readlink "$f")"; else sha256sum "$f"; fi
done)").tar
if [[ ! -f $app ]]; then
  say "gpuflow's code"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/opt/gpuflow" "$work/usr/local/bin"
  (cd "$ROOT" && tar --create $sources) | tar --extract --directory "$work/opt/gpuflow"
  "$ROOT/.venv/bin/python" -m compileall -q "$work/opt/gpuflow" >/dev/null  # uid 10001 cannot write them there
  # installed where it lies (on PYTHONPATH): its metadata, entry points and program
  "$ROOT/.venv/bin/python" "$ROOT/scripts/testbed/dist_info.py" "$ROOT/pyproject.toml" \
    --into "$work/opt/gpuflow" --scripts "$work/usr/local/bin"
  tar_dir "$work" "$app"
  rm -rf "$work"
  trap - EXIT
fi

out=$CACHE/gpuflow-job-testbed.tar
stamp=$out.layers
if [[ ! -f $out || $(cat "$stamp" 2>/dev/null) != "$base $deps $app" ]]; then
  python3 "$ROOT/scripts/testbed/oci_image.py" --name "$NAME" --out "$out" \
    --layer "$base" --layer "$deps" --layer "$app" --workdir /opt/gpuflow \
    --env PATH=/usr/local/bin:$DEPS_DIR/bin:/usr/bin:/bin --env PYTHONPATH=/opt/gpuflow:$DEPS_DIR \
    --env PYTHONUNBUFFERED=1 --env HOME=/home/gpuflow --env GPUFLOW_HOME=/tmp/gpuflow \
    --user 10001 --entrypoint '["/usr/bin/tini", "--"]' >/dev/null
  echo "$base $deps $app" >"$stamp"
  # older layers of this image are not needed again
  find "$CACHE" -maxdepth 1 \( -name 'app-*.tar' ! -path "$app" -o -name 'deps-*.tar' ! -path "$deps" \) -delete
  say "built $NAME: $out ($(du -h "$out" | cut -f1))"
fi
if [[ -n $import_into ]]; then
  ctr --address "$import_into" --namespace k8s.io images import "$out" >/dev/null
  say "imported $NAME into $import_into"
fi
echo "$out"
