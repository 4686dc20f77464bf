#!/usr/bin/env bash
# gpuflow's Kubernetes test cluster, on 127.0.0.1 only: a real control plane (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler) with certificates,
# service-account keys and RBAC on, KWOK's simulated GPU nodes, the Kubeflow MPI Operator
# (MPIJobs) and Kueue's CRDs (its API, no controller).
#
#   scripts/k8s-testbed.sh build             build what is missing into the cache
#   scripts/k8s-testbed.sh up --dir DIR      build if needed, start, write DIR/kubeconfig
#   scripts/k8s-testbed.sh up --dir DIR --real-node   and a real node beside the KWOK ones:
#                                            containerd + a kubelet, pods in real containers
#                                            (gpuflow's job image imported: scripts/build-image.sh)
#   scripts/k8s-testbed.sh up --dir DIR --no-mpi-operator   without the MPI Operator (its
#                                            health port, 8080, is fixed: one per machine)
#   scripts/k8s-testbed.sh expose --dir DIR --port PORT   the real node's pods reach this
#                                            host's 127.0.0.1:PORT at the node's address
#                                            (a Prefect server for flow-run pods); gone at down
#   scripts/k8s-testbed.sh adapter --dir DIR --prometheus URL   the custom metrics API
#                                            (custom.metrics.k8s.io, through the API
#                                            server's aggregation layer): each pod's metric
#                                            is what that Prometheus holds for it (an HPA on
#                                            DCGM_FI_DEV_GPU_UTIL); stopped by down
#   scripts/k8s-testbed.sh down --dir DIR    stop what `up` started, by PID (an `up` that
#                                            fails part-way stops what it started itself)
#   scripts/k8s-testbed.sh restart-api --dir DIR   stop the API server and start it again (faults)
#
# Binaries are built from the Go module proxy at the versions pinned below (and in
# scripts/testbed/*/go.mod) into $GPUFLOW_TESTBED_CACHE (default ~/.cache/gpuflow/testbed);
# Go keeps its module and build caches under $HOME too, so a second build takes seconds.
set -euo pipefail

K8S_VERSION=v1.36.3   # k8s.io/kubernetes; staging modules v0.36.3 (scripts/testbed/k8s/go.mod)
ETCD_VERSION=v3.6.15  # go.etcd.io/etcd/server/v3 (scripts/testbed/etcd/go.mod)
KWOK_VERSION=v0.8.0   # sigs.k8s.io/kwok
KUEUE_VERSION=v0.17.0 # sigs.k8s.io/kueue: its CRDs only (the API of infra/kubernetes/kueue-*.yaml)
MPI_OPERATOR_VERSION=v0.6.0 # github.com/kubeflow/mpi-operator (scripts/testbed/mpi-operator/go.mod)
ADAPTER_VERSION=v1.36.0 # sigs.k8s.io/custom-metrics-apiserver (scripts/testbed/metrics-adapter/go.mod)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${GPUFLOW_TESTBED_CACHE:-$HOME/.cache/gpuflow/testbed}
BIN=$CACHE/bin
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
START=$SECONDS

say() { printf '[testbed] %s (%ds)\n' "$*" $((SECONDS - START)) >&2; }
die() { printf 'testbed: %s\n' "$*" >&2; exit 1; }

build() {
  mkdir -p "$BIN"
  command -v go >/dev/null || die "Go is not installed; install Go 1.26 (it builds the test cluster)"
  local stamp=$BIN/.versions want="k8s=$K8S_VERSION etcd=$ETCD_VERSION kwok=$KWOK_VERSION kueue=$KUEUE_VERSION mpi-operator=$MPI_OPERATOR_VERSION metrics-adapter=$ADAPTER_VERSION"
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]] &&
    [[ -x $BIN/kube-apiserver && -x $BIN/kube-controller-manager && -x $BIN/kube-scheduler && -x $BIN/kubelet ]] &&
    [[ -x $BIN/etcd && -x $BIN/kwok && -x $BIN/mpi-operator && -x $BIN/metrics-adapter ]] &&
    [[ -f $CACHE/crds/kueue.x-k8s.io_clusterqueues.yaml && -f $CACHE/crds/kubeflow.org_mpijobs.yaml ]]; then
    say "built already: $want in $BIN"
    return
  fi
  rm -f "$stamp"
  if [[ ! -x $BIN/kube-apiserver || ! -x $BIN/kube-controller-manager || ! -x $BIN/kube-scheduler || ! -x $BIN/kubelet ]]; then
    say "building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet $K8S_VERSION (cold: about 8 minutes on 2 cores)"
    local pkg=k8s.io/component-base/version minor=${K8S_VERSION#v1.}
    (cd "$HERE/testbed/k8s" && go build -trimpath -o "$BIN/" \
      -ldflags "-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=${minor%%.*} -X $pkg.gitTreeState=clean" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet)
  fi
  if [[ ! -x $BIN/etcd ]]; then
    say "building etcd $ETCD_VERSION"
    (cd "$HERE/testbed/etcd" && go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" .)
  fi
  if [[ ! -x $BIN/kwok ]]; then
    say "building kwok $KWOK_VERSION"
    GOBIN=$BIN go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  fi
  if [[ ! -x $BIN/mpi-operator ]]; then
    say "building mpi-operator $MPI_OPERATOR_VERSION (cold: about 5 minutes on 2 cores)"
    (cd "$HERE/testbed/mpi-operator" && go build -trimpath -ldflags "-s -w" -o "$BIN/mpi-operator" \
      github.com/kubeflow/mpi-operator/cmd/mpi-operator)
  fi
  if [[ ! -x $BIN/metrics-adapter ]]; then
    say "building the custom metrics adapter (custom-metrics-apiserver $ADAPTER_VERSION)"
    (cd "$HERE/testbed/metrics-adapter" && go build -trimpath -ldflags "-s -w" -o "$BIN/metrics-adapter" .)
  fi
  say "fetching Kueue $KUEUE_VERSION's CRDs"
  local kueue
  kueue=$(go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  mkdir -p "$CACHE/crds"
  for kind in resourceflavors clusterqueues localqueues workloadpriorityclasses; do
    cp "$kueue/config/components/crd/bases/kueue.x-k8s.io_$kind.yaml" "$CACHE/crds/"
  done
  local mpi
  mpi=$(cd "$HERE/testbed/mpi-operator" && go list -m -f '{{.Dir}}' github.com/kubeflow/mpi-operator)
  cp "$mpi/manifests/base/kubeflow.org_mpijobs.yaml" "$CACHE/crds/"
  echo "$want" >"$stamp"
  say "built: $want in $BIN"
}

free_port() { python3 "$HERE/testbed/free_port.py"; } # below the ephemeral range: see the script

start() { # start NAME ARGS...: in a session of its own, logging to DIR/logs/NAME.log
  local name=$1
  shift
  setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$DIR/pids/$name"
}

wait_for() { # wait_for WHAT SECONDS COMMAND...
  local what=$1 limit=$2
  shift 2
  local until=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < until)) || die "$what did not come up within ${limit}s; see $DIR/logs"
    sleep 0.2
  done
}

api() { # api METHOD PATH [YAML]: a request to the API server as the admin
  curl -fsS --cacert "$DIR/pki/ca.crt" --cert "$DIR/pki/admin.crt" --key "$DIR/pki/admin.key" \
    -X "$1" "https://127.0.0.1:$(cat "$DIR/ports/api")$2" ${3:+-H "Content-Type: application/yaml" --data-binary "$3"}
}

api_file() { # api_file METHOD PATH FILE: the same, the YAML body read from FILE
  api "$1" "$2" "@$3"
}

certificates() {
  local pki=$DIR/pki
  mkdir -p "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=gpuflow-testbed-ca" \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  sign() { # sign NAME SUBJECT [SAN]
    openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$pki/$1.key" -out "$pki/$1.csr" 2>/dev/null
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
      -days 30 -out "$pki/$1.crt" ${3:+-extfile <(printf 'subjectAltName=%s' "$3")} 2>/dev/null
  }
  sign apiserver "/CN=kube-apiserver" "IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc,IP:10.96.0.1"
  sign admin "/O=system:masters/CN=gpuflow-testbed-admin"
  sign kwok "/CN=gpuflow-testbed-kubelet" "IP:127.0.0.1"  # KWOK's kubelet endpoint (pod logs)
  sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  # the aggregation layer: the API server proxies custom.metrics.k8s.io to the adapter as
  # front-proxy-client, which the adapter trusts by the front-proxy CA
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=gpuflow-testbed-front-proxy-ca" \
    -keyout "$pki/front-proxy-ca.key" -out "$pki/front-proxy-ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=front-proxy-client" \
    -keyout "$pki/front-proxy-client.key" -out "$pki/front-proxy-client.csr" 2>/dev/null
  openssl x509 -req -in "$pki/front-proxy-client.csr" -CA "$pki/front-proxy-ca.crt" \
    -CAkey "$pki/front-proxy-ca.key" -CAcreateserial -days 30 -out "$pki/front-proxy-client.crt" 2>/dev/null
  sign metrics-adapter "/CN=gpuflow-metrics-adapter" "DNS:gpuflow-metrics-adapter.kube-system.svc,IP:127.0.0.1"
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
}

kubeconfig() { # the admin's kubeconfig, certificates inline
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
- name: gpuflow-testbed
  cluster:
    server: https://127.0.0.1:$(cat "$DIR/ports/api")
    certificate-authority-data: $(base64 -w0 "$DIR/pki/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $(base64 -w0 "$DIR/pki/admin.crt")
    client-key-data: $(base64 -w0 "$DIR/pki/admin.key")
contexts:
- name: gpuflow-testbed
  context: {cluster: gpuflow-testbed, user: admin}
current-context: gpuflow-testbed
EOF
}

nodes() { # the simulated nodes: two 8 x H100, one 4 x L4, one CPU-only
  node() { # node NAME GPUS PRODUCT
    cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $1
  annotations: {kwok.x-k8s.io/node: fake}
  labels:
    kubernetes.io/hostname: $1
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
$(if (($2)); then printf '    nvidia.com/gpu.present: "true"\n    nvidia.com/gpu.count: "%s"\n    nvidia.com/gpu.product: %s\n' "$2" "$3"; fi)
spec:
$(if (($2)); then printf '  taints:\n  - {key: nvidia.com/gpu, value: present, effect: NoSchedule}\n'; fi)
status:
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", ephemeral-storage: 1Ti$( (($2)) && printf ', nvidia.com/gpu: "%s"' "$2")}
  capacity: {cpu: "64", memory: 512Gi, pods: "110", ephemeral-storage: 1Ti$( (($2)) && printf ', nvidia.com/gpu: "%s"' "$2")}
  nodeInfo: {kubeletVersion: fake, operatingSystem: linux, architecture: amd64}
  # both kinds of address, or KWOK's node-initialize stage (its NodeName is empty here)
  # writes an empty list over them every ~50 s: the API server could not reach the
  # node's kubelet endpoint for pod logs half of the time
  addresses: [{type: InternalIP, address: 127.0.0.1}, {type: Hostname, address: $1}]
EOF
  }
  node gpu-h100-0 8 NVIDIA-H100-80GB-HBM3
  echo ---
  node gpu-h100-1 8 NVIDIA-H100-80GB-HBM3
  echo ---
  node gpu-l4-0 4 NVIDIA-L4
  echo ---
  node cpu-0 0 ""
}

up_failed() { # EXIT trap while up runs: what it started before failing goes with it
  local rc=$?
  trap - EXIT
  ((rc)) || return 0
  say "up failed part-way: stopping what it started"
  down || true
  exit "$rc"
}

up() {
  build
  [[ ! -f $DIR/pids/kube-apiserver ]] || die "$DIR holds a running test cluster; run down --dir $DIR first"
  # the MPI Operator's health server listens on :8080, fixed (no flag): one per machine,
  # so a second cluster with it is refused before anything starts
  if $WITH_MPI_OPERATOR && python3 -c 'import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); sys.exit(s.connect_ex(("127.0.0.1", 8080)) != 0)'; then
    die "port 8080 is taken (another test cluster's MPI Operator?): the MPI Operator listens there; stop that one, or use --no-mpi-operator"
  fi
  mkdir -p "$DIR"/{logs,pids,ports}
  DIR=$(cd "$DIR" && pwd)
  trap up_failed EXIT
  for name in etcd etcd-peer api kcm scheduler kwok; do free_port >"$DIR/ports/$name"; done
  certificates
  local etcd=http://127.0.0.1:$(cat "$DIR/ports/etcd")
  start etcd "$BIN/etcd" --name testbed --data-dir "$DIR/etcd-data" \
    --listen-client-urls "$etcd" --advertise-client-urls "$etcd" \
    --listen-peer-urls "http://127.0.0.1:$(cat "$DIR/ports/etcd-peer")" \
    --initial-advertise-peer-urls "http://127.0.0.1:$(cat "$DIR/ports/etcd-peer")" \
    --initial-cluster "testbed=http://127.0.0.1:$(cat "$DIR/ports/etcd-peer")" \
    --listen-metrics-urls "" --log-level warn --quota-backend-bytes 2147483648
  wait_for etcd 60 curl -fsS "$etcd/health"
  say "etcd up on $etcd"
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "$etcd" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$(cat "$DIR/ports/api")" \
    --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
    --client-ca-file "$DIR/pki/ca.crt" --authorization-mode RBAC \
    --service-account-key-file "$DIR/pki/sa.pub" --service-account-signing-key-file "$DIR/pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range 10.96.0.0/16 --allow-privileged=true --cert-dir "$DIR/pki" \
    --enable-priority-and-fairness=false --profiling=false \
    --kubelet-preferred-address-types InternalIP --kubelet-certificate-authority "$DIR/pki/ca.crt" \
    --kubelet-client-certificate "$DIR/pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$DIR/pki/apiserver-kubelet-client.key" \
    --requestheader-client-ca-file "$DIR/pki/front-proxy-ca.crt" \
    --requestheader-allowed-names front-proxy-client --requestheader-username-headers X-Remote-User \
    --requestheader-group-headers X-Remote-Group --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$DIR/pki/front-proxy-client.crt" \
    --proxy-client-key-file "$DIR/pki/front-proxy-client.key"
  wait_for kube-apiserver 180 api GET /readyz
  kubeconfig >"$DIR/kubeconfig"
  chmod 600 "$DIR/kubeconfig"
  say "kube-apiserver up on https://127.0.0.1:$(cat "$DIR/ports/api")"
  start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$DIR/kubeconfig" \
    --authentication-kubeconfig "$DIR/kubeconfig" --authorization-kubeconfig "$DIR/kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$(cat "$DIR/ports/kcm")" --leader-elect=false \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
    --use-service-account-credentials=false --controllers '*,-nodeipam' \
    --node-monitor-grace-period 20s --profiling=false \
    --kube-api-qps 100 --kube-api-burst 200 --concurrent-job-syncs 20 \
    --horizontal-pod-autoscaler-sync-period 2s
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$DIR/kubeconfig" \
    --authentication-kubeconfig "$DIR/kubeconfig" --authorization-kubeconfig "$DIR/kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$(cat "$DIR/ports/scheduler")" --leader-elect=false \
    --profiling=false
  mkdir -p "$DIR/pod-logs"
  cat >"$DIR/pod-logs.yaml" <<EOF
# Pods in the namespace gpuflow-logs show DIR/pod-logs/unit.log as their container unit's
# log (followed): e2e tests write there what the container would print.
apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterLogs
metadata: {name: gpuflow-pod-logs}
spec:
  selector: {matchNamespaces: [gpuflow-logs]}
  logs:
  - containers: [unit]
    logsFile: $DIR/pod-logs/unit.log
    follow: true
EOF
  local stages kwok_crds
  stages=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
  kwok_crds=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/crd/bases
  [[ -d $stages && -d $kwok_crds ]] || die "KWOK's stages are not in $stages; run build again"
  # per-pod logs (a Logs object named after the pod): a test that plays kubelet for the
  # namespace gpuflow-kubelet runs a pod's program here and serves what it prints
  api_file POST /apis/apiextensions.k8s.io/v1/customresourcedefinitions \
    "$kwok_crds/kwok.x-k8s.io_logs.yaml" >/dev/null
  wait_for "KWOK's Logs API" 60 api GET /apis/kwok.x-k8s.io/v1alpha1/logs
  start kwok "$BIN/kwok" --kubeconfig "$DIR/kubeconfig" --manage-all-nodes=false \
    --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --server-address "127.0.0.1:$(cat "$DIR/ports/kwok")" --node-ip 127.0.0.1 \
    --node-port "$(cat "$DIR/ports/kwok")" \
    --tls-cert-file "$DIR/pki/kwok.crt" --tls-private-key-file "$DIR/pki/kwok.key" \
    --enable-crds Logs --config "$DIR/pod-logs.yaml" \
    --config "$stages/node/fast/node-initialize.yaml" \
    --config "$stages/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
    --config "$stages/pod/fast/pod-ready.yaml" --config "$HERE/testbed/kwok/pod-complete.yaml" \
    --config "$HERE/testbed/kwok/pod-ready-again.yaml" \
    --config "$stages/pod/fast/pod-delete.yaml" \
    --config "$stages/pod/chaos/pod-container-running-failed.yaml"
  nodes >"$DIR/nodes.yaml"
  local doc
  while IFS= read -r -d '' doc; do api POST /api/v1/nodes "$doc" >/dev/null; done < <(awk 'BEGIN{RS="---\n"; ORS="\0"} {print}' "$DIR/nodes.yaml")
  wait_for "4 Ready nodes" 120 bash -c "[[ \$(curl -fsS --cacert '$DIR/pki/ca.crt' --cert '$DIR/pki/admin.crt' --key '$DIR/pki/admin.key' https://127.0.0.1:$(cat "$DIR/ports/api")/api/v1/nodes | grep -c '\"reason\": \"KubeletReady\"') -ge 4 ]]"
  local crd
  for crd in "$CACHE"/crds/*.yaml; do
    api_file POST /apis/apiextensions.k8s.io/v1/customresourcedefinitions "$crd" >/dev/null
  done
  wait_for "the default service account" 60 api GET /api/v1/namespaces/default/serviceaccounts/default
  wait_for "Kueue's API" 60 api GET /apis/kueue.x-k8s.io/v1beta2/clusterqueues
  wait_for "the MPIJob API" 60 api GET /apis/kubeflow.org/v2beta1/mpijobs
  local operator="the MPI Operator"
  if $WITH_MPI_OPERATOR; then
    api POST /api/v1/namespaces 'apiVersion: v1
kind: Namespace
metadata: {name: mpi-operator}' >/dev/null
    start mpi-operator "$BIN/mpi-operator" -kubeConfig "$DIR/kubeconfig" -lock-namespace mpi-operator \
      -monitoring-port 0 -threadiness 4 -kube-api-qps 50 -kube-api-burst 100
  else
    operator="no MPI Operator"
  fi
  say "up: 4 nodes (2 x 8 H100, 4 L4, 1 CPU), $operator, Kueue's CRDs; kubeconfig: $DIR/kubeconfig"
  if $WITH_REAL_NODE; then real_node_up; fi
  trap - EXIT
}

stop_pid() { # stop_pid NAME: SIGTERM, up to 10 s, then SIGKILL
  local name=$1 pid
  [[ -f $DIR/pids/$name ]] || return 0
  pid=$(cat "$DIR/pids/$name")
  if kill -TERM "$pid" 2>/dev/null; then
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
    say "stopped $name (pid $pid)"
  fi
  rm -f "$DIR/pids/$name"
}

down() {
  [[ -d $DIR/pids ]] || { say "nothing runs in $DIR"; return; }
  real_node_down
  local name
  for name in metrics-adapter mpi-operator kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
    stop_pid "$name"
  done
}

adapter() { # the custom metrics API, served from PROMETHEUS through the aggregation layer
  [[ -f $DIR/pids/kube-apiserver ]] || die "no test cluster runs in $DIR: start it with up"
  stop_pid metrics-adapter
  free_port >"$DIR/ports/metrics-adapter"
  local port
  port=$(cat "$DIR/ports/metrics-adapter")
  start metrics-adapter "$BIN/metrics-adapter" --prometheus-url "$PROMETHEUS" \
    --bind-address 127.0.0.1 --secure-port "$port" \
    --tls-cert-file "$DIR/pki/metrics-adapter.crt" --tls-private-key-file "$DIR/pki/metrics-adapter.key" \
    --lister-kubeconfig "$DIR/kubeconfig" --authentication-kubeconfig "$DIR/kubeconfig" \
    --authorization-kubeconfig "$DIR/kubeconfig" --v 1
  # an ExternalName service: the API server reaches the adapter on this host's loopback
  api DELETE /apis/apiregistration.k8s.io/v1/apiservices/v1beta2.custom.metrics.k8s.io >/dev/null 2>&1 || true
  api DELETE /api/v1/namespaces/kube-system/services/gpuflow-metrics-adapter >/dev/null 2>&1 || true
  api POST /api/v1/namespaces/kube-system/services "apiVersion: v1
kind: Service
metadata: {name: gpuflow-metrics-adapter, namespace: kube-system}
spec: {type: ExternalName, externalName: 127.0.0.1, ports: [{port: $port}]}" >/dev/null
  api POST /apis/apiregistration.k8s.io/v1/apiservices "apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1beta2.custom.metrics.k8s.io}
spec:
  group: custom.metrics.k8s.io
  version: v1beta2
  groupPriorityMinimum: 100
  versionPriority: 200
  caBundle: $(base64 -w0 "$DIR/pki/ca.crt")
  service: {name: gpuflow-metrics-adapter, namespace: kube-system, port: $port}" >/dev/null
  wait_for "the custom metrics API" 120 api GET /apis/custom.metrics.k8s.io/v1beta2
  say "custom metrics API up (adapter pid $(cat "$DIR/pids/metrics-adapter"), Prometheus $PROMETHEUS)"
}

restart_api() { # stop the API server by PID and start it again with the same arguments
  local pid
  pid=$(cat "$DIR/pids/kube-apiserver" 2>/dev/null) || die "no API server runs in $DIR"
  mapfile -d '' -t argv <"/proc/$pid/cmdline" || die "the API server (pid $pid) is gone"
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  say "stopped kube-apiserver (pid $pid)"
  start kube-apiserver "${argv[@]}"
  wait_for kube-apiserver 180 api GET /readyz
  say "kube-apiserver up again (pid $(cat "$DIR/pids/kube-apiserver")); etcd kept the state"
}

# shellcheck source=testbed/real-node.sh
source "$HERE/testbed/real-node.sh"

command=${1:-}
shift || true
DIR= WITH_REAL_NODE=false WITH_MPI_OPERATOR=true PORT= PROMETHEUS=
while (($#)); do
  case $1 in
  --dir) DIR=$2; shift 2 ;;
  --port) PORT=$2; shift 2 ;;
  --prometheus) PROMETHEUS=$2; shift 2 ;;
  --real-node) WITH_REAL_NODE=true; shift ;;
  --no-mpi-operator) WITH_MPI_OPERATOR=false; shift ;;
  *) die "unknown option $1; use build, up --dir DIR [--real-node] [--no-mpi-operator], expose --dir DIR --port PORT or down --dir DIR" ;;
  esac
done
case $command in
build) build ;;
up) [[ -n $DIR ]] || die "up needs --dir DIR"; up ;;
down) [[ -n $DIR ]] || die "down needs --dir DIR"; down ;;
restart-api) [[ -n $DIR ]] || die "restart-api needs --dir DIR"; restart_api ;;
adapter) [[ -n $DIR && -n $PROMETHEUS ]] || die "adapter needs --dir DIR --prometheus URL"; adapter ;;
expose)
  [[ -n $DIR && $PORT =~ ^[0-9]+$ ]] && ((PORT >= 1 && PORT <= 65535)) || die "expose needs --dir DIR --port PORT (1 to 65535)"
  [[ -f $DIR/real-node/id ]] || die "no real node runs in $DIR: start it with up --real-node"
  real_node_expose "$(cat "$DIR/real-node/node-ip")" "$PORT" "$PORT"
  say "the real node's pods reach 127.0.0.1:$PORT at $(cat "$DIR/real-node/node-ip"):$PORT"
  ;;
*) die "use: $0 build | up --dir DIR | expose --dir DIR --port PORT | down --dir DIR | restart-api --dir DIR" ;;
esac
