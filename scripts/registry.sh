#!/usr/bin/env bash
# The tests' local OCI registry (scripts/testbed/registry: go-containerregistry's registry
# behind basic auth for its private/ repositories), on loopback, stopped by PID.
#
#   scripts/registry.sh build     build it into the cache (once; Go's caches make reruns quick)
#   scripts/registry.sh path      print the binary's path (building it if missing)
#
# Built from the Go module proxy at the versions pinned in scripts/testbed/registry/go.mod
# into $GPUFLOW_TESTBED_CACHE/bin (default ~/.cache/gpuflow/testbed/bin).
set -euo pipefail
cd "$(dirname "$0")/testbed/registry"
CACHE=${GPUFLOW_TESTBED_CACHE:-$HOME/.cache/gpuflow/testbed}
BIN=$CACHE/bin
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

build() {
  local stamp=$BIN/.oci-registry-version want
  want=$(cat go.mod go.sum main.go | sha256sum | cut -c1-16)
  if [[ -x $BIN/oci-registry && -f $stamp && $(cat "$stamp") == "$want" ]]; then
    return
  fi
  command -v go >/dev/null || { echo "registry: Go is not installed; install Go 1.26" >&2; exit 1; }
  mkdir -p "$BIN"
  echo "[registry] building the local OCI registry (cold: about 20 s)" >&2
  go build -trimpath -ldflags "-s -w" -o "$BIN/oci-registry" .
  echo "$want" >"$stamp"
}

case ${1:-} in
  build) build ;;
  path) build && echo "$BIN/oci-registry" ;;
  *) echo "usage: $0 build|path" >&2; exit 2 ;;
esac
