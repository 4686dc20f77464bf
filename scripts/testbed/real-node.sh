# The test cluster's real node, sourced by scripts/k8s-testbed.sh (which sets DIR, BIN,
# CACHE, HERE and the helpers start, stop_pid, wait_for, api, say, die, free_port):
# Debian's containerd and runc under a kubelet built with the control plane, CNI bridge
# networking, GPUs advertised as an extended resource. Its pods run in real containers.

REAL_NODE=real-a10g-0       # its Node name
REAL_NODE_GPUS=2            # nvidia.com/gpu it advertises (no device is handed to pods)
REAL_NODE_PRODUCT=NVIDIA-A10G # its nvidia.com/gpu.product label (no KWOK node has it)
PAUSE_IMAGE=gpuflow.local/pause:testbed

real_node_tools() {
  local missing=()
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  [[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
  ((${#missing[@]} == 0)) || die "the real node needs Debian's ${missing[*]}: apt-get install ${missing[*]}"
  [[ $(id -u) -eq 0 ]] || die "the real node needs root (containers, cgroups, network namespaces)"
}

real_node_id() { # a number of its own for each test cluster: its bridge, subnet and cgroups
  cat "$DIR/real-node/id"
}

real_node_claim_id() { # the first of 1..250 in a random order whose bridge this host lacks,
  local id # claimed by making that bridge: two clusters starting at once never share one
  for id in $(shuf -i 1-250); do
    if ip link add "gfbr$id" type bridge 2>/dev/null; then
      echo "$id" >"$DIR/real-node/id"
      return 0
    fi
  done
  die "no free bridge name gfbr1 to gfbr250 for the real node: remove stale ones (ip link delete gfbrN)"
}

pause_image() { # the pod sandbox image: a 1.4 MB static program, built and packed here
  local out=$CACHE/images/pause.tar
  if [[ ! -f $out ]]; then
    mkdir -p "$CACHE/images"
    (cd "$HERE/testbed/pause" && go build -trimpath -ldflags "-s -w" -o "$CACHE/images/pause" .)
    python3 "$HERE/testbed/oci_image.py" --name "$PAUSE_IMAGE" --file "$CACHE/images/pause:/pause" \
      --entrypoint '["/pause"]' --out "$out" >/dev/null
    rm -f "$CACHE/images/pause" "$out.layer"
  fi
  echo "$out"
}

real_node_chain() { echo "GPUFLOW-TB-$(real_node_id)"; }

real_node_expose() { # real_node_expose ADDRESS PORT LOOPBACK_PORT: pods reach 127.0.0.1's port there
  iptables -t nat -C "$(real_node_chain)" -d "$1/32" -p tcp --dport "$2" -j DNAT --to-destination "127.0.0.1:$3" 2>/dev/null ||
    iptables -t nat -A "$(real_node_chain)" -d "$1/32" -p tcp --dport "$2" -j DNAT --to-destination "127.0.0.1:$3"
}

ctr_() { ctr --address "$DIR/real-node/containerd/containerd.sock" --namespace k8s.io "$@"; }

real_node_up() {
  real_node_tools
  local rn=$DIR/real-node id
  mkdir -p "$rn"/{containerd,net.d,ipam,kubelet,pod-logs}
  real_node_claim_id
  id=$(real_node_id)
  cat >"$rn/containerd/config.toml" <<EOF
version = 2
root = "$rn/containerd/root"
state = "$rn/containerd/state"
[grpc]
  address = "$rn/containerd/containerd.sock"
[ttrpc]
  address = "$rn/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  disable_apparmor = true
  # no oom_score_adj below containerd's own: this host refuses negative ones (EIO)
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$rn/net.d"
  # a registry's settings (hosts.toml: a test's registry on loopback speaks plain HTTP)
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$rn/containerd/certs.d"
EOF
  # The node's address is its bridge's, 10.244.$id.1: a kubelet refuses a loopback node IP,
  # and this one is reachable from this host and its pods only. Pods reach this host there;
  # nothing is masqueraded or forwarded.
  local node_ip=10.244.$id.1
  ip addr replace "$node_ip/24" dev "gfbr$id"
  ip link set "gfbr$id" up
  echo "$node_ip" >"$rn/node-ip"
  # No kube-proxy: the API server's Service address (10.96.0.1:443, which its certificate
  # names) leads from the pods to its loopback port, so in-cluster clients (a flow-run pod
  # making unit pods) reach it. The rules live in a chain of this node's own.
  sysctl -qw "net.ipv4.conf.gfbr$id.route_localnet=1"
  iptables -t nat -N "$(real_node_chain)" 2>/dev/null || iptables -t nat -F "$(real_node_chain)"
  iptables -t nat -C PREROUTING -i "gfbr$id" -j "$(real_node_chain)" 2>/dev/null ||
    iptables -t nat -A PREROUTING -i "gfbr$id" -j "$(real_node_chain)"
  real_node_expose 10.96.0.1 443 "$(cat "$DIR/ports/api")"
  local pki=$DIR/pki
  openssl req -newkey rsa:2048 -nodes -subj "/CN=system:node:$REAL_NODE" -keyout "$pki/real-node.key" \
    -out "$pki/real-node.csr" 2>/dev/null
  openssl x509 -req -in "$pki/real-node.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 30 -out "$pki/real-node.crt" -extfile <(printf 'subjectAltName=IP:%s' "$node_ip") 2>/dev/null
  cat >"$rn/net.d/10-gpuflow.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "gpuflow-testbed", "plugins": [
  {"type": "bridge", "bridge": "gfbr$id", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.$id.0/24"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$rn/ipam"}},
  {"type": "loopback"}]}
EOF
  start containerd containerd --config "$rn/containerd/config.toml"
  wait_for containerd 60 ctr_ version
  ctr_ images import "$(pause_image)" >/dev/null
  local image
  for image in "$CACHE"/images/gpuflow-job-*.tar; do
    [[ -f $image ]] || continue
    ctr_ images import "$image" >/dev/null
    say "imported $(basename "$image") into the real node's containerd"
  done
  cat >"$rn/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
port: KUBELET_PORT
readOnlyPort: 0
healthzPort: 0
tlsCertFile: $DIR/pki/real-node.crt
tlsPrivateKeyFile: $DIR/pki/real-node.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://$rn/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupRoot: /gpuflow-testbed-$id   # its pods' cgroups, apart from any other kubelet's
failCgroupV1: false                # this host's cgroups are v1
failSwapOn: false
podLogsDir: $rn/pod-logs
registerWithTaints: [{key: nvidia.com/gpu, value: present, effect: NoSchedule}]
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100   # the imported images cannot be pulled again: never collect them
serializeImagePulls: false
EOF
  # the kubelet makes its pods' cgroups under this one, in every hierarchy, and wants it there
  local hierarchy
  for hierarchy in /sys/fs/cgroup/*/; do
    [[ -f $hierarchy/cgroup.procs ]] || continue
    mkdir -p "$hierarchy/gpuflow-testbed-$id"
    if [[ -f $hierarchy/cpuset.cpus ]]; then # a new cpuset has no CPUs until it is given some
      cat "$hierarchy/cpuset.cpus" >"$hierarchy/gpuflow-testbed-$id/cpuset.cpus"
      cat "$hierarchy/cpuset.mems" >"$hierarchy/gpuflow-testbed-$id/cpuset.mems"
    fi
  done
  real_node_start_kubelet "$node_ip"
  local until=$((SECONDS + 180)) node="/api/v1/nodes/$REAL_NODE" tries=1
  until api GET "$node" 2>/dev/null | grep -q '"reason": "KubeletReady"'; do
    if ! kill -0 "$(cat "$DIR/pids/kubelet")" 2>/dev/null; then
      # its port, free when chosen, was taken before it bound it: choose again (twice at most)
      if ((tries < 3)) && grep -q 'bind: address already in use' "$DIR/logs/kubelet.log"; then
        say "the kubelet's port $(cat "$DIR/ports/kubelet") was taken; choosing another"
        tries=$((tries + 1))
        real_node_start_kubelet "$node_ip"
        continue
      fi
      die "the kubelet exited: $(grep -m1 'command failed' "$DIR/logs/kubelet.log" || tail -n 3 "$DIR/logs/kubelet.log")"
    fi
    ((SECONDS < until)) || die "the real node $REAL_NODE was not Ready within 180 s; see $DIR/logs/kubelet.log"
    sleep 0.5
  done
  # GPUs as an extended resource in the node's status (Kubernetes' documented way without a
  # device plugin): the scheduler places GPU pods here; no device is handed to them
  curl -fsS --cacert "$DIR/pki/ca.crt" --cert "$DIR/pki/admin.crt" --key "$DIR/pki/admin.key" \
    -X PATCH -H "Content-Type: application/json-patch+json" "https://127.0.0.1:$(cat "$DIR/ports/api")$node/status" \
    --data "[{\"op\": \"add\", \"path\": \"/status/capacity/nvidia.com~1gpu\", \"value\": \"$REAL_NODE_GPUS\"}]" >/dev/null
  # the kubelet makes them allocatable at its next status update (every 10 s)
  wait_for "the real node's GPUs allocatable" 60 bash -c "curl -fsS --cacert '$DIR/pki/ca.crt' --cert '$DIR/pki/admin.crt' --key '$DIR/pki/admin.key' https://127.0.0.1:$(cat "$DIR/ports/api")$node | python3 -c 'import json, sys; sys.exit(json.load(sys.stdin)[\"status\"][\"allocatable\"].get(\"nvidia.com/gpu\") != \"$REAL_NODE_GPUS\")'"
  say "real node $REAL_NODE up: containerd + kubelet on $node_ip, $REAL_NODE_GPUS x $REAL_NODE_PRODUCT, pods on 10.244.$id.0/24"
}

real_node_start_kubelet() { # real_node_start_kubelet NODE_IP: on a port chosen now
  local rn=$DIR/real-node
  free_port >"$DIR/ports/kubelet"
  sed "s/^port: .*/port: $(cat "$DIR/ports/kubelet")/" "$rn/kubelet.yaml" >"$rn/kubelet.yaml.new"
  mv "$rn/kubelet.yaml.new" "$rn/kubelet.yaml"
  start kubelet "$BIN/kubelet" --config "$rn/kubelet.yaml" --kubeconfig "$DIR/kubeconfig" \
    --root-dir "$rn/kubelet" --hostname-override "$REAL_NODE" --node-ip "$1" \
    --node-labels "nvidia.com/gpu.present=true,nvidia.com/gpu.count=$REAL_NODE_GPUS,nvidia.com/gpu.product=$REAL_NODE_PRODUCT,type=real"
}

real_node_unmount() { # what the kubelet (its root dir) and the pods (root file systems,
  # emptyDirs, /dev/shm) left mounted, deepest first, stacked ones too
  local mount
  for _ in 1 2 3; do
    awk -v root="$DIR/real-node/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r |
      while read -r mount; do umount -l "$mount" 2>/dev/null || true; done
  done
}

real_node_down() {
  local rn=$DIR/real-node id task cg
  [[ -f $rn/id ]] || { real_node_unmount; return 0; }
  id=$(real_node_id)
  if [[ -f $DIR/pids/kubelet && -f $DIR/pids/kube-apiserver ]]; then
    # the kubelet stops the node's pods itself: their sandboxes, networks and mounts go
    local names
    for _ in $(seq 150); do
      names=$(api GET "/api/v1/pods?fieldSelector=spec.nodeName%3D$REAL_NODE" 2>/dev/null | python3 -c '
import json, sys
for pod in json.load(sys.stdin)["items"]:
    print(pod["metadata"]["namespace"], pod["metadata"]["name"])') || break
      [[ -n $names ]] || break
      while read -r ns name; do
        api DELETE "/api/v1/namespaces/$ns/pods/$name?gracePeriodSeconds=0" >/dev/null 2>&1 || true
      done <<<"$names"
      sleep 0.3
    done
  fi
  stop_pid kubelet
  if [[ -f $DIR/pids/containerd ]]; then
    for task in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s KILL "$task" >/dev/null 2>&1 || true; done
  fi
  stop_pid containerd
  pkill -KILL -f "containerd-shim-runc-v2 .*-address $rn/containerd/containerd.sock" 2>/dev/null || true
  real_node_unmount
  ip link delete "gfbr$id" 2>/dev/null || true
  iptables -t nat -D PREROUTING -i "gfbr$id" -j "$(real_node_chain)" 2>/dev/null || true
  iptables -t nat -F "$(real_node_chain)" 2>/dev/null || true
  iptables -t nat -X "$(real_node_chain)" 2>/dev/null || true
  rm -rf "$rn/containerd/root" "$rn/containerd/state"  # the images' content and snapshots: GBs
  for cg in /sys/fs/cgroup/*/gpuflow-testbed-"$id"; do
    [[ -d $cg ]] && find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  rm -f "$rn/id" "$DIR/ports/kubelet"
}
