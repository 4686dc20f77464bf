#!/usr/bin/env bash
# Creates .venv and installs gpuflow into it; with --test, also what the tests need;
# with --render, also Blender (and ffmpeg) for renders; with --hpc, Open MPI for MPI jobs;
# with --serve, HAProxy for services' endpoints.
# Safe to rerun: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
step() { echo "setup: $* ($((SECONDS - t0)) s so far)"; }

want_test=false want_render=false want_hpc=false want_serve=false
[[ "${1:-}" == "--test" ]] && want_test=true want_render=true want_hpc=true want_serve=true
[[ "${1:-}" == "--serve" ]] && want_serve=true
[[ "${1:-}" == "--render" ]] && want_render=true
[[ "${1:-}" == "--hpc" ]] && want_hpc=true

apt_packages=()
command -v python3 >/dev/null || apt_packages+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || apt_packages+=(python3-venv)
if $want_test; then
    command -v prometheus-pushgateway >/dev/null || apt_packages+=(prometheus-pushgateway)
    command -v promtool >/dev/null || apt_packages+=(prometheus)  # promtool checks infra/ rules
    command -v chromium >/dev/null || apt_packages+=(chromium)    # loads the Prefect UI headless
    command -v curl >/dev/null || apt_packages+=(curl)            # the Kubernetes test cluster's
    command -v openssl >/dev/null || apt_packages+=(openssl)      # certificates and first calls
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || apt_packages+=(postgresql)  # platform on PostgreSQL
    command -v munged >/dev/null || apt_packages+=(munge)               # the Slurm test cluster
    command -v slurmctld >/dev/null || apt_packages+=(slurmctld)        # (scripts/slurm-testbed.sh)
    command -v slurmd >/dev/null || apt_packages+=(slurmd)
    command -v sbatch >/dev/null || apt_packages+=(slurm-client)
    [ -x /usr/sbin/sshd ] || apt_packages+=(openssh-server)  # the Slurm login node over SSH
    command -v containerd >/dev/null || apt_packages+=(containerd)  # the Kubernetes test
    command -v runc >/dev/null || apt_packages+=(runc)              # cluster's real node
    [ -x /usr/lib/cni/bridge ] || apt_packages+=(containernetworking-plugins)
    command -v ip >/dev/null || apt_packages+=(iproute2)
    command -v wrk >/dev/null || apt_packages+=(wrk)  # the services' load generator
    command -v mmdebstrap >/dev/null || apt_packages+=(mmdebstrap)  # gpuflow's job image
    command -v podman >/dev/null || apt_packages+=(podman)  # jobs in their image (image:)
    command -v skopeo >/dev/null || apt_packages+=(skopeo)  # the tests' user images; Slurm's
    command -v umoci >/dev/null || apt_packages+=(umoci)    # image bundles (with skopeo)
fi
if $want_render; then
    command -v blender >/dev/null || apt_packages+=(blender)  # renders run the real Blender
    command -v ffmpeg >/dev/null || apt_packages+=(ffmpeg)    # preview videos
fi
if $want_serve; then
    command -v haproxy >/dev/null || apt_packages+=(haproxy)  # a service's endpoint
fi
if $want_hpc; then
    command -v mpirun >/dev/null || apt_packages+=(openmpi-bin)  # mpirun; mpi4py loads its libmpi
fi
if ((${#apt_packages[@]})); then
    sudo=""
    [[ $(id -u) -ne 0 ]] && sudo="sudo"
    step "installing Debian packages (a few minutes on a new machine): ${apt_packages[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "gpuflow needs Python 3.11 or newer; this python3 is $(python3 --version)" >&2
    exit 2
}
[[ -x .venv/bin/python ]] || { step "creating .venv"; python3 -m venv .venv; }
py=.venv/bin/python
$py -m pip install -q --upgrade pip

# torch first, pinned where there is no GPU so that pip's cache serves every later venv:
# PyPI's torch is a CUDA build of several GB (it runs on the CPU without a GPU).
if ! $py -c 'import torch' 2>/dev/null; then
    step "installing torch into .venv (the largest download)"
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        $py -m pip install -q 'torch>=2.4,<3'
    else
        $py -m pip install -q torch==2.13.0
    fi
fi
# the demo's smoke job and the examples' training use torch (installed above): gpuflow[train];
# the tests use every extra (gpuflow[test] holds gpuflow[all])
extra="[train]"
$want_hpc && extra="[train,hpc]"
$want_test && extra="[test]"
step "installing gpuflow$extra into .venv (pip: only what is missing)"
$py -m pip install -q -e ".$extra"
if $want_test; then
    image=
    if [[ $(id -u) -eq 0 ]]; then  # the real node's image (root: mmdebstrap keeps owners)
        # built beside the Go builds: it mostly downloads and unpacks, they mostly compile
        step "building gpuflow's job image for the test cluster's real node, beside what follows (cold: about 2 minutes; cached after)"
        image_log=$(mktemp)
        setsid bash scripts/build-image.sh >/dev/null 2>"$image_log" &
        image=$!
        trap 'kill -- -$image 2>/dev/null || true' EXIT  # setup failed: the image's build goes too
    fi
    # The Kubernetes test cluster: built once from the Go module proxy, cached under $HOME.
    step "building the Kubernetes test cluster (cold: about 8 minutes on 2 cores; cached after)"
    bash scripts/k8s-testbed.sh build
    bash scripts/imds-mock.sh build  # AWS's instance metadata mock (seconds)
    bash scripts/registry.sh build   # the container tests' local OCI registry (seconds)
    if [[ $(id -u) -eq 0 ]]; then    # the user images those tests pull (about 20 s cold)
        bash scripts/build-test-images.sh >/dev/null
    fi
    if [[ -n $image ]]; then
        step "waiting for gpuflow's job image"
        if ! wait "$image"; then
            tail -20 "$image_log" >&2
            echo "setup: building gpuflow's job image failed (scripts/build-image.sh); its last lines are above" >&2
            exit 1
        fi
        trap - EXIT
        rm -f "$image_log"
    fi
fi
step "ready"
