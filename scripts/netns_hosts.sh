#!/usr/bin/env bash
# Several "hosts" on this machine, for multi-node jobs without a cluster: each host is a Linux
# network namespace with its own address on a private bridge, its own hostname and its own local
# disk. The tests use it (tests/hosts.py), and so does scripts/slurm_cluster.sh for its nodes.
#
#   scripts/netns_hosts.sh up NAME COUNT [HOSTNAME_PREFIX]   # as root: hosts PREFIX1..PREFIXCOUNT
#   scripts/netns_hosts.sh exec NAME I COMMAND...            # runs COMMAND on host I
#   scripts/netns_hosts.sh exec --shared-mounts NAME I COMMAND...  # ... in this machine's mounts
#   scripts/netns_hosts.sh addr NAME I                       # host I's address (0: the bridge's)
#   scripts/netns_hosts.sh disk NAME I                       # where host I's disk is, seen from here
#   scripts/netns_hosts.sh kill NAME I                       # SIGKILL to every process of host I
#   scripts/netns_hosts.sh down NAME                         # kills every process, deletes it all
#
# NAME (at most 9 letters and digits) keeps several sets apart. The hosts are on 10.213.X.0/24,
# X derived from NAME (or $NETNS_HOSTS_SUBNET, e.g. 10.213.7): host I is .I, the bridge in this
# machine's own namespace is .254, so a server started here on that address (an S3 server, a
# Slurm controller) is reachable from every host. Nothing is routed beyond the bridge.
#
# On host I, COMMAND sees:
# - hostname PREFIX<I>, and an /etc/hosts that maps it to 127.0.1.1 and the other hosts to their
#   addresses: the layout of many cloud images, where a host's own name resolves to loopback;
# - its own disk at $NETNS_HOSTS_DISK (default /mnt/host-disk): the same path is another folder
#   on every host, and no host sees another's. Everything else (this checkout, /tmp, /root) is
#   this machine's, as if on a shared file system.
# With --shared-mounts, COMMAND only gets host I's network and hostname: it stays in this
# machine's mount namespace, so it also sees what is mounted here after it started (a daemon in
# a chroot whose shared directories come and go, like scripts/slurm_cluster.sh's slurmd), and
# gets neither the /etc/hosts view nor the disk (it brings its own, e.g. in its chroot).
#
# `up` replaces a set of the same NAME left by a run that died; `down` is safe to repeat.
set -euo pipefail

STATE_HOME=${NETNS_HOSTS_HOME:-/run/netns-hosts}
NETNS_DIR=/run/netns  # where `ip netns add` pins the namespaces
DISK_MOUNT=${NETNS_HOSTS_DISK:-/mnt/host-disk}

say() { echo "netns_hosts: $*" >&2; }
die() { say "$*"; exit 1; }

check_name() {
  [[ "$1" =~ ^[a-z][a-z0-9]{0,8}$ ]] \
    || die "NAME $1 must be 1-9 lower-case letters and digits, starting with a letter (it prefixes interface names)"
}

subnet() {
  if [ -n "${NETNS_HOSTS_SUBNET:-}" ]; then echo "$NETNS_HOSTS_SUBNET"; return; fi
  echo "10.213.$(( $(printf '%s' "$1" | cksum | cut -d' ' -f1) % 200 + 20 ))"
}

netns() { echo "${1}h$2"; }
state() { echo "$STATE_HOME/$1"; }
count() { cat "$(state "$1")/count" 2>/dev/null || echo 0; }

addr() {
  local name=$1 i=$2
  if [ "$i" = 0 ]; then echo "$(subnet "$name").254"; else echo "$(subnet "$name").$i"; fi
}

# SIGKILL to every process of a host (its namespace), until none is left: a host that dies.
kill_host() {
  local ns=$1 pids try
  for try in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    sleep 0.2
  done
  [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] || die "processes of $ns survive SIGKILL"
}

down() {
  local name=$1 ns dir
  for ns in $(ip netns list | awk '{ print $1 }' | grep -E "^${name}h[0-9]+$" || true); do
    kill_host "$ns"  # the namespace stays alive as long as one of its processes does
    # The veth pair now, not when the kernel gets round to the deleted namespace: an `up` right
    # after could otherwise find its name taken.
    ip link del "${name}v${ns##*h}" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "${name}br" 2>/dev/null || true
  dir=$(state "$name")
  [ ! -d "$dir" ] || rm -rf "$dir"
}

up() {
  local name=$1 n=$2 prefix=${3:-host} net dir i ns hosts
  [[ "$n" =~ ^[1-9]$ ]] || die "COUNT $n must be 1-9"
  [[ "$prefix" =~ ^[a-z][a-z0-9-]*$ ]] || die "HOSTNAME_PREFIX $prefix is not a hostname"
  down "$name"
  net=$(subnet "$name")
  dir=$(state "$name")
  mkdir -p "$dir" "$DISK_MOUNT"
  chmod 700 "$dir"
  ip link add "${name}br" type bridge
  ip addr add "$net.254/24" dev "${name}br"
  ip link set "${name}br" up
  for i in $(seq 1 "$n"); do
    ns=$(netns "$name" "$i")
    ip netns add "$ns"
    ip link add "${name}v$i" type veth peer name eth0 netns "$ns"
    ip link set "${name}v$i" master "${name}br" up
    ip -n "$ns" addr add "$net.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    mkdir -p "$dir/disk/$i"
  done
  for i in $(seq 1 "$n"); do
    hosts="$dir/hosts.$i"
    printf '127.0.0.1 localhost\n127.0.1.1 %s%s\n' "$prefix" "$i" >"$hosts"
    for j in $(seq 1 "$n"); do
      [ "$j" = "$i" ] || printf '%s.%s %s%s\n' "$net" "$j" "$prefix" "$j" >>"$hosts"
    done
  done
  echo "$n" >"$dir/count"
  echo "$prefix" >"$dir/prefix"
  # The hosts must reach each other and the bridge, or nothing else here can work.
  for i in $(seq 1 "$n"); do
    reaches_bridge "$name" "$i" || die "host $i cannot reach the bridge at $net.254"
  done
  say "up: $n hosts ${prefix}1..${prefix}$n on $net.0/24 (bridge ${name}br at $net.254)"
}

# A TCP connection from host I to a listener on the bridge.
reaches_bridge() {
  local name=$1 i=$2 net
  net=$(subnet "$name")
  python3 - "$net.254" "$(netns "$name" "$i")" <<'EOF'
import socket, subprocess, sys
addr, ns = sys.argv[1], sys.argv[2]
with socket.socket() as s:
    s.bind((addr, 0)); s.listen(1)
    port = s.getsockname()[1]
    code = f"import socket; socket.create_connection(({addr!r}, {port}), timeout=5).close()"
    sys.exit(subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], timeout=10).returncode)
EOF
}

exec_on() {
  local shared_mounts= name i dir prefix
  if [ "$1" = --shared-mounts ]; then shared_mounts=1; shift; fi
  name=$1 i=$2
  shift 2
  check_name "$name"
  dir=$(state "$name")
  [ -d "$dir/disk/$i" ] || die "no host $i in set $name: run $0 up $name COUNT first"
  prefix=$(cat "$dir/prefix")
  if [ -n "$shared_mounts" ]; then
    # nsenter, not `ip netns exec`: that one makes a mount namespace, which would not see later
    # mounts here (this machine's mounts are not shared).
    exec nsenter --net="$NETNS_DIR/$(netns "$name" "$i")" unshare --uts \
      /bin/sh -c 'hostname "$1" && shift && exec "$@"' sh "$prefix$i" "$@"
  fi
  # A mount namespace of its own: the host's /etc/hosts and disk, and the other disks hidden.
  exec ip netns exec "$(netns "$name" "$i")" unshare --mount --uts --propagation private \
    /bin/sh -c 'hostname "$1" && mount --bind "$2/hosts.$3" /etc/hosts \
      && mount --bind "$2/disk/$3" "$4" && mount -t tmpfs -o size=1m,mode=700 none "$2" \
      && shift 4 && exec "$@"' sh "$prefix$i" "$dir" "$i" "$DISK_MOUNT" "$@"
}

[ "$(id -u)" = 0 ] || die "must run as root: it makes network and mount namespaces"
command -v ip >/dev/null || die "needs iproute2's ip (apt-get install iproute2)"
case "${1:-}" in
  up) [ $# -ge 3 ] || die "usage: $0 up NAME COUNT [HOSTNAME_PREFIX]"; check_name "$2"; up "$2" "$3" "${4:-host}" ;;
  down) [ $# -eq 2 ] || die "usage: $0 down NAME"; check_name "$2"; down "$2" ;;
  kill) [ $# -eq 3 ] || die "usage: $0 kill NAME I"; check_name "$2"; kill_host "$(netns "$2" "$3")" ;;
  exec)
    [ $# -ge 4 ] && { [ "$2" != --shared-mounts ] || [ $# -ge 5 ]; } \
      || die "usage: $0 exec [--shared-mounts] NAME I COMMAND..."
    shift; exec_on "$@" ;;
  addr) [ $# -eq 3 ] || die "usage: $0 addr NAME I"; check_name "$2"; addr "$2" "$3" ;;
  disk) [ $# -eq 3 ] || die "usage: $0 disk NAME I"; check_name "$2"; echo "$(state "$2")/disk/$3" ;;
  *) die "usage: $0 up|exec|addr|disk|down ..." ;;
esac
