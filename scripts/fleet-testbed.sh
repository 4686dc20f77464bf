#!/usr/bin/env bash
# GPU servers for fleet tests, on this machine: each host a network namespace with its own
# address on a bridge, its own sshd (its own host key, key-only, root), its own fake NVML
# (GPU count and product), its own GPUFLOW_HOME and HOME, and a PATH of its own.
#
#   scripts/fleet-testbed.sh up DIR HOST...   HOST is NAME:GPUS[:PRODUCT][:nopython]; none:
#                                             an empty bed, for instances added later
#   scripts/fleet-testbed.sh add DIR HOST ADDRESS   one more host at ADDRESS (on the bed's
#                                             /24: an elastic fleet's instance), its
#                                             authorized_keys empty (its boot fills it)
#   scripts/fleet-testbed.sh remove DIR NAME  its power cut: processes killed, namespace gone
#   scripts/fleet-testbed.sh down DIR         stops the sshds, removes the namespaces,
#                                             the veths, the bridge and DIR
#
# `up` writes DIR/hosts.json (name, address, port, known_hosts line, GPUs, product per host),
# DIR/client_key (the key every host lets in) and DIR/env (the bridge and namespaces, read
# by `down`). Hosts get 10.251.N.2.. on a bridge whose own end is 10.251.N.1 (N: the first
# free, chosen under a lock, so test beds side by side do not meet); hosts reach each
# other over the bridge.
# FLEET_HOST_ENV (NAME=VALUE ...) is added to every host's environment (the container
# tests' engine settings); podman, where installed, is on every host's PATH.
# The hosts' Python is FLEET_PYTHON (default: python3 here); `nopython` leaves it out of
# that host's PATH. FAKE_NVML_DIR (default: this checkout's tests/fakes) goes first on
# each host's PYTHONPATH. Needs root (ip netns, veths, sshd).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
FAKES=${FAKE_NVML_DIR:-$ROOT/tests/fakes}
TOOLS="sh bash sleep cat tar gzip mkdir rm rmdir ls env true false echo df kill ps id
       uname head tail grep sed mv cp ln chmod date hostname nproc stat touch sha256sum
       wc tr cut sort uniq xargs awk mawk expr seq find dirname basename readlink podman"

free_net() { # a /24 of its own per test bed: 10.251.<1..250>, the first whose bridge is not there
  local n
  for ((n = 1; n <= 250; n++)); do
    ip link show "gf${n}br" >/dev/null 2>&1 || { echo "$n"; return; }
  done
  echo "fleet-testbed: 250 test beds are up already" >&2
  exit 1
}

# add_host DIR NET I NAME GPUS PRODUCT FLAG ADDRESS KEYS: one host; prints its JSON line.
# KEYS=client lets the bed's client key in; KEYS=boot leaves authorized_keys empty (an
# instance's boot script fills it).
add_host() {
  local dir=$1 net=$2 i=$3 name=$4 gpus=$5 product=${6:-NVIDIA H100 80GB HBM3} flag=$7
  local address=$8 keys=$9
  local python=${FLEET_PYTHON:-$(command -v python3)}
  local tag=gf$net
  local ns=$tag-$name home=$dir/$name tool
  mkdir -p "$home/bin" "$home/home" "$home/gpuflow"
  for tool in $TOOLS; do
    [[ -x /usr/bin/$tool ]] && ln -sf "/usr/bin/$tool" "$home/bin/$tool"
    [[ -x /bin/$tool ]] && ln -sf "/bin/$tool" "$home/bin/$tool"
  done
  if [[ $flag != nopython ]]; then # a wrapper, not a link: a venv's Python stays its venv's
    printf '#!/bin/sh\nexec %s "$@"\n' "$python" >"$home/bin/python3"
    chmod +x "$home/bin/python3"
    ln -sf python3 "$home/bin/python"
  fi
  ip netns add "$ns"
  echo "NS_$i=$ns" >>"$dir/env"
  ip link add "$tag-v$i" type veth peer name eth0 netns "$ns"
  ip link set "$tag-v$i" master "${tag}br" up
  ip -n "$ns" addr add "$address/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  echo "VETH_$i=$tag-v$i" >>"$dir/env"
  rm -f "$home/host_key" "$home/host_key.pub"
  ssh-keygen -q -t ed25519 -N "" -C "$name" -f "$home/host_key"
  if [[ $keys == client ]]; then
    cp "$dir/client_key.pub" "$home/authorized_keys"
  else
    : >"$home/authorized_keys"
  fi
  cat >"$home/sshd_config" <<EOF
Port 22
ListenAddress $address
HostKey $home/host_key
AuthorizedKeysFile $home/authorized_keys
PidFile $home/sshd.pid
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
MaxSessions 64
MaxStartups 64:30:128
SetEnv HOME=$home/home GPUFLOW_HOME=$home/gpuflow PATH=$home/bin PYTHONPATH=$FAKES FAKE_NVML_GPUS=$gpus "FAKE_NVML_NAME=$product" FAKE_NVML_UTIL=3 ${FLEET_HOST_ENV:-}
LogLevel VERBOSE
EOF
  # its network only (ip netns exec would also remount /sys, hiding the cgroup hierarchies)
  nsenter --net="/run/netns/$ns" /usr/sbin/sshd -f "$home/sshd_config" -E "$home/sshd.log"
  local key
  key=$(cut -d' ' -f1-2 "$home/host_key.pub")
  echo "{\"name\": \"$name\", \"address\": \"$address\", \"port\": 22, \"known_hosts\": \"$address $key\", \"gpus\": $gpus, \"product\": \"$product\", \"namespace\": \"$ns\", \"veth\": \"$tag-v$i\", \"python\": $([[ $flag == nopython ]] && echo false || echo true)}"
}

wait_ssh() { # wait_ssh ADDRESS: until its sshd answers
  local until=$((SECONDS + 20))
  until (exec 3<>"/dev/tcp/$1/22") 2>/dev/null; do
    ((SECONDS < until)) || { echo "fleet-testbed: sshd on $1 did not answer" >&2; exit 1; }
    sleep 0.05
  done
}

up() {
  local dir=$1
  shift
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  local net tag bridge
  exec 9>/run/lock/gpuflow-fleet-testbed.lock
  flock 9 # two test beds starting at once choose different nets
  net=$(free_net)
  tag=gf$net
  bridge=${tag}br
  echo "BRIDGE=$bridge" >"$dir/env"
  echo "TAG=$tag" >>"$dir/env"
  ip link add "$bridge" type bridge
  flock -u 9
  ip addr add "10.251.$net.1/24" dev "$bridge"
  ip link set "$bridge" up
  rm -f "$dir/client_key" "$dir/client_key.pub"
  ssh-keygen -q -t ed25519 -N "" -C fleet-client -f "$dir/client_key"
  mkdir -p /run/sshd
  local i=1 hosts=() spec name gpus product flag
  for spec in "$@"; do
    IFS=: read -r name gpus product flag <<<"$spec"
    hosts+=("$(add_host "$dir" "$net" "$i" "$name" "$gpus" "$product" "$flag" "10.251.$net.$((i + 1))" client)")
    i=$((i + 1))
  done
  local joined
  joined=$(IFS=,; echo "${hosts[*]}")
  echo "{\"bridge\": \"$bridge\", \"address\": \"10.251.$net.1\", \"hosts\": [$joined]}" >"$dir/hosts.json"
  # each sshd answers before `up` returns
  local n
  for ((n = 2; n <= i; n++)); do wait_ssh "10.251.$net.$n"; done
}

# add DIR NAME:GPUS[:PRODUCT] ADDRESS: one more host at ADDRESS on the bed's /24, whose
# authorized_keys (DIR/NAME/authorized_keys) starts empty; prints its JSON line.
add() {
  local dir=$1 spec=$2 address=$3 name gpus product flag
  IFS=: read -r name gpus product flag <<<"$spec"
  # shellcheck disable=SC1091
  . "$dir/env"
  local i
  i=$(($(grep -c '^NS_' "$dir/env" || true) + 1))
  add_host "$dir" "${TAG#gf}" "$i" "$name" "$gpus" "$product" "$flag" "$address" boot \
    >"$dir/$name.json"
  wait_ssh "$address"
  cat "$dir/$name.json"
}

# remove DIR NAME: the host's power cut: every process in its namespace killed, the
# namespace and its link removed (its folder stays, for what a test reads after).
remove() {
  local dir=$1 name=$2
  # shellcheck disable=SC1091
  . "$dir/env"
  local ns=$TAG-$name pid veth
  for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  ip netns del "$ns" 2>/dev/null || true
  veth=$(grep -o '"veth": "[^"]*"' "$dir/$name.json" 2>/dev/null | cut -d'"' -f4 || true)
  [[ -z $veth ]] || ip link del "$veth" 2>/dev/null || true
}

down() {
  local dir=$1
  [[ -f $dir/env ]] || { rm -rf "$dir"; return 0; }
  local pidfile pid
  for pidfile in "$dir"/*/sshd.pid; do
    [[ -f $pidfile ]] || continue
    pid=$(cat "$pidfile")
    # the host's sessions first (their processes live in its namespace), then sshd
    kill "$pid" 2>/dev/null || true
  done
  local line ns
  while IFS= read -r line; do
    case $line in
      NS_*)
        ns=${line#*=}
        # every process still in the namespace: sessions, units left behind
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
        ;;
      VETH_*) ip link del "${line#*=}" 2>/dev/null || true ;;
    esac
  done <"$dir/env"
  # shellcheck disable=SC1091
  . "$dir/env"
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$dir"
}

case ${1:-} in
  up) shift; up "$@" ;;
  add) add "${2:?usage: $0 add DIR NAME:GPUS[:PRODUCT] ADDRESS}" "${3:?}" "${4:?}" ;;
  remove) remove "${2:?usage: $0 remove DIR NAME}" "${3:?}" ;;
  down) down "${2:?usage: $0 down DIR}" ;;
  *) echo "usage: $0 up DIR [HOST...] | add DIR HOST ADDRESS | remove DIR NAME | down DIR" >&2; exit 2 ;;
esac
