#!/usr/bin/env bash
# AWS's instance metadata mock (amazon-ec2-metadata-mock), for tests of what gpuflow does
# on an EC2 instance: IMDSv2 tokens, spot interruption notices, rebalance recommendations.
#
#   scripts/imds-mock.sh build     build it into the cache (once; Go's caches make reruns quick)
#   scripts/imds-mock.sh path      print the binary's path (building it if missing)
#
# Built from the Go module proxy at the version pinned below into
# $GPUFLOW_TESTBED_CACHE/bin (default ~/.cache/gpuflow/testbed/bin). Tests start it on
# 127.0.0.1 (-n 127.0.0.1) and stop it by PID.
set -euo pipefail

AEMM_VERSION=v1.13.0 # github.com/aws/amazon-ec2-metadata-mock
CACHE=${GPUFLOW_TESTBED_CACHE:-$HOME/.cache/gpuflow/testbed}
BIN=$CACHE/bin
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

build() {
  local stamp=$BIN/.ec2-metadata-mock-version
  if [[ -x $BIN/ec2-metadata-mock && -f $stamp && $(cat "$stamp") == "$AEMM_VERSION" ]]; then
    return
  fi
  command -v go >/dev/null || { echo "imds-mock: Go is not installed; install Go 1.26" >&2; exit 1; }
  mkdir -p "$BIN"
  echo "[imds-mock] building ec2-metadata-mock $AEMM_VERSION (cold: about 15 s)" >&2
  GOBIN=$BIN go install -trimpath -ldflags "-s -w" \
    "github.com/aws/amazon-ec2-metadata-mock/cmd/ec2-metadata-mock@$AEMM_VERSION"
  echo "$AEMM_VERSION" >"$stamp"
}

case ${1:-} in
  build) build ;;
  path) build && echo "$BIN/ec2-metadata-mock" ;;
  *) echo "usage: $0 build|path" >&2; exit 2 ;;
esac
