#!/usr/bin/env bash
# A two-node Slurm cluster on this machine, so that `torchx run -s slurm` runs for real, multi-node
# jobs included, without a cluster: the tests use it, and so can you.
#
#   scripts/slurm_cluster.sh start     # as root: builds the cluster's root once, starts its daemons
#   export PATH="$(scripts/slurm_cluster.sh bin):$PATH"   # its sbatch, squeue, sacct, ... first
#   torchx run -s slurm components.dlrm:train -j 1x2     # on one node
#   torchx run -s slurm components.dlrm:train -j 2x2     # on both: one part of the job on each
#   scripts/slurm_cluster.sh status    # exit status 0 while both its nodes take jobs
#   scripts/slurm_cluster.sh stop      # stops the daemons, deletes the nodes' namespaces, unmounts
#   scripts/slurm_cluster.sh purge     # stops, then deletes every root it built
#
# SLURM_CLUSTER_SUITE picks the Debian release, and so the Slurm: trixie (default, Slurm 24.11)
# or bookworm (Slurm 22.05, the oldest release our `-s slurm` supports); both can run at once.
# Either comes with slurmdbd and MariaDB, as torchx reads finished jobs through `sacct`. The
# release is debootstrapped into a root under $SLURM_CLUSTER_HOME (default
# /var/tmp/torchrec-dlrm-slurm), in a folder named after the recipe's hash: every checkout on the
# machine reuses it, and a changed recipe builds a new one. A build takes 75-120 s and 720 MB,
# starting an existing root 2-3 s. It needs root (chroot, mount) and, to build, Debian's mirror.
#
# Jobs run inside the root, as root, with the environment of the submitting shell (sbatch's
# --export=ALL), so a job finds the same torchrun and python as you. That works in the
# directories the root shares with this machine: this checkout, /root, /home, /tmp and those in
# $SLURM_CLUSTER_MOUNTS (space-separated, absolute); submit from one of them.
#
# The nodes, n1 and n2, are two hosts of scripts/netns_hosts.sh: each node's slurmd, and so each
# job step on it, runs in a network namespace of its own, with hostname n1 or n2 and its own
# address on a private bridge, so the parts of a multi-node job find each other over a network
# (rendezvous, gloo) as on a real cluster, not over loopback. Everything else is shared: the
# root's files (and the directories above), the processes, and the machine: both nodes are
# declared with all its cores and memory (less 1 GB), so a job sized for one node fits either,
# and jobs on both share the cores. slurmctld, slurmdbd, munged and MariaDB run in this machine's
# own namespace; the nodes reach slurmctld at the bridge's address, munged by its socket.
#
# Ports: slurmctld $SLURM_CLUSTER_PORT (by default 16817 for trixie and 16827 for bookworm, away
# from a real Slurm's 6817), each slurmd +1 on its node's address, slurmdbd +2 on 127.0.0.1;
# MariaDB only on its socket. The nodes are .1 and .2 of the /24 $SLURM_CLUSTER_SUBNET (default
# 10.213.N, N = 220 + PORT / 10 % 34), the bridge .254 (`ip -br addr` shows it as sl<PORT>br).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
HOME_DIR=${SLURM_CLUSTER_HOME:-/var/tmp/torchrec-dlrm-slurm}
SUITE=${SLURM_CLUSTER_SUITE:-trixie}
# The Debian release whose Slurm the cluster runs, and the first of its three ports.
# slurmd sets up a cgroup plugin even though nothing here uses cgroups (proctrack/linuxproc,
# task/none), and fails where there is no cgroup v2 hierarchy (this kind of machine): 24.11 can
# disable it; 22.05 cannot, but its cgroup/v1 plugin starts without a hierarchy to use.
case "$SUITE" in
  trixie) DEFAULT_PORT=16817 CGROUP_PLUGIN=disabled ;;       # Slurm 24.11
  bookworm) DEFAULT_PORT=16827 CGROUP_PLUGIN=cgroup/v1 ;;    # Slurm 22.05
  *) echo "slurm_cluster: SLURM_CLUSTER_SUITE=$SUITE is not a release it knows: use trixie (Slurm 24.11) or bookworm (Slurm 22.05)" >&2; exit 2 ;;
esac
MIRROR=${SLURM_CLUSTER_MIRROR:-http://deb.debian.org/debian}
# libffi8 and libnsl2: what the host's (pyenv) Python needs to run inside the root.
PACKAGES=slurmctld,slurmd,slurm-client,slurmdbd,munge,mariadb-server,libffi8,libnsl2
RECIPE_KEY=$(printf '%s %s %s' "$SUITE" minbase "$PACKAGES" | sha256sum | cut -c1-12)
STATE=$HOME_DIR/$SUITE-$RECIPE_KEY
ROOT=$STATE/root
LOGS=$ROOT/var/log/slurm
BIN=$STATE/bin  # the host-side commands; outside the root, so jobs use the root's own
PORT=${SLURM_CLUSTER_PORT:-$DEFAULT_PORT}
NODES=(n1 n2)  # hosts 1 and 2 of its set of scripts/netns_hosts.sh, whose hostname prefix is n
# The nodes' set of network namespaces (scripts/netns_hosts.sh), one per cluster. Its subnet lies
# outside 10.213.20-219, where netns_hosts.sh puts sets it is not told a subnet for (the tests'
# hosts), so that those can never take the cluster's.
NETNS=sl$PORT
SUBNET=${SLURM_CLUSTER_SUBNET:-10.213.$((220 + PORT / 10 % 34))}
read -ra EXTRA_DIRS <<<"${SLURM_CLUSTER_MOUNTS:-}"
SHARED_DIRS=("$REPO" /root /home /tmp "${EXTRA_DIRS[@]}")
SELF="$REPO/scripts/slurm_cluster.sh"
[ "$SUITE" = trixie ] || SELF="SLURM_CLUSTER_SUITE=$SUITE $SELF"
SLURM_COMMANDS=(sbatch squeue sacct scancel sinfo scontrol srun salloc sacctmgr sstat)
DB_PASSWORD=torchx  # MariaDB on its socket only, inside the root: not a secret

say() { echo "slurm_cluster: $*" >&2; }
die() { say "$*"; exit 1; }
# Runs a command inside the root; without the lock, which daemons would otherwise hold forever.
in_root() { chroot "$ROOT" "$@" 9>&-; }
# scripts/netns_hosts.sh COMMAND on the nodes' set: `hosts up 2 n`, `hosts addr 1`, ...
hosts() { NETNS_HOSTS_SUBNET=$SUBNET "$REPO/scripts/netns_hosts.sh" "$1" "$NETNS" "${@:2}" 9>&-; }
# Runs `$2...` on host $1 of the set, in this machine's mounts (see start_nodes).
on_host() {
  NETNS_HOSTS_SUBNET=$SUBNET "$REPO/scripts/netns_hosts.sh" exec --shared-mounts "$NETNS" "$@" 9>&-
}

# Refuses what root must not trust in a world-writable place like /var/tmp: a symbolic link, or
# a path another user owns or can write to, could make us write or chroot where they chose.
# $2: d (a directory, the default) or f (a regular file).
check_ours() {
  local path=$1 kind=${2:-d} owner mode
  [ ! -L "$path" ] || die "$path is a symbolic link, which could point anywhere: remove it (or set SLURM_CLUSTER_HOME to a folder of root's)"
  [ -"$kind" "$path" ] || die "$path is not a $([ "$kind" = d ] && echo folder || echo file): remove it"
  read -r owner mode < <(stat -c '%u %a' "$path")
  [ "$owner" = 0 ] || die "$path belongs to user id $owner, not root, so someone else made it: remove it (or set SLURM_CLUSTER_HOME)"
  (( (8#$mode & 8#022) == 0 )) || die "$path can be written by other users (mode $mode): chmod go-w it, or remove it"
}

require_root() {
  [ "$(id -u)" = 0 ] || die "must run as root: it uses chroot and mount (try: sudo $0 $1)"
}

# Mount points under $1, deepest first.
mounts_under() {
  awk -v dir="$1" '$2 == dir || index($2, dir "/") == 1 { print $2 }' /proc/self/mounts | sort -r
}

# Passes until none is left: a mount under a later one over its parent (e.g. a checkout shared
# before its parent directory) can only be unmounted once that one is.
unmount_under() {
  local dir=$1 mnt left before=
  while left=$(mounts_under "$dir") && [ -n "$left" ] && [ "$left" != "$before" ]; do
    before=$left
    for mnt in $left; do
      umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
    done
  done
  [ -z "$left" ] || die "could not unmount ${left//$'\n'/ }"
}

# Deletes a root: only once nothing is mounted under it, or `rm -rf` would reach the host's files.
remove_root() {
  unmount_under "$1"
  rm -rf "$1"
}

build_root() {
  if [ -e "$STATE" ] || [ -L "$STATE" ]; then check_ours "$STATE"; fi
  if [ -e "$ROOT" ] || [ -L "$ROOT" ]; then
    check_ours "$ROOT"  # we chroot into it and run its daemons as root
    return  # a build only gets this name once it is complete
  fi
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; } \
      || die "cannot install debootstrap: install it (apt-get install debootstrap) and try again"
  fi
  local partial=$STATE/root.partial
  [ -e "$partial" ] && remove_root "$partial"  # a build that was interrupted
  say "building the cluster's root (Debian $SUITE, Slurm, slurmdbd, MariaDB) in $ROOT: 75-120 s"
  mkdir -p "$STATE"
  if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$partial" "$MIRROR" >"$STATE/debootstrap.log" 2>&1; then
    tail -5 "$STATE/debootstrap.log" >&2
    die "debootstrap failed; full log: $STATE/debootstrap.log"
  fi
  mv -T "$partial" "$ROOT"
}

mount_system() {
  local dir
  [ -n "$(mounts_under "$ROOT")" ] && unmount_under "$ROOT"  # mounts left by a crashed run
  for dir in /proc /sys /dev /dev/pts /dev/shm; do
    mount --bind "$dir" "$ROOT$dir"
  done
}

# Shares SHARED_DIRS with the root, parents first, each unless the root sees it already (inside
# a shared parent, or shared by an earlier start from another checkout).
share_dirs() {
  local dir
  for dir in "${SHARED_DIRS[@]}"; do
    case "$dir" in
      /*) ;;
      *) die "SLURM_CLUSTER_MOUNTS: $dir is not an absolute path" ;;
    esac
  done
  while read -r dir; do
    [ -d "$dir" ] || continue
    [ -d "$ROOT$dir" ] && [ "$(stat -c %d:%i "$dir")" = "$(stat -c %d:%i "$ROOT$dir")" ] && continue
    mkdir -p "$ROOT$dir"
    mount --bind "$dir" "$ROOT$dir"
  done < <(printf '%s\n' "${SHARED_DIRS[@]}" | awk '{ print length($0) "\t" $0 }' | sort -n | cut -f2-)
}

write_config() {
  local cpus mem_mb host i nodes=
  cpus=$(nproc)
  # Leave 1 GB to the machine; torchx asks for memory only where the partition has over 1 GB.
  mem_mb=$(( $(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo) - 1024 ))
  host=$(hostname -s)
  # Seen from the nodes too (they run in the root): a job's rendezvous host, the first node's
  # name ($SLURM_JOB_NODELIST_HET_GROUP_0), must resolve to its address on every node.
  printf '127.0.0.1 localhost %s\n' "$host" >"$ROOT/etc/hosts"
  for i in "${!NODES[@]}"; do
    printf '%s %s\n' "$(hosts addr $((i + 1)))" "${NODES[i]}" >>"$ROOT/etc/hosts"
    nodes+="NodeName=${NODES[i]} NodeAddr=$(hosts addr $((i + 1))) CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN"$'\n'
  done
  cat >"$ROOT/etc/slurm/slurm.conf" <<EOF
# Written by scripts/slurm_cluster.sh at every start.
ClusterName=torchrec-dlrm
SlurmctldHost=$host($(hosts addr 0))
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
# No cgroups on this kind of machine: track processes by their parent pid.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Only the backfill scheduler starts heterogeneous jobs (every multi-node torchx job), by default
# every 30 s: a two-node job would wait that long on an idle cluster.
SchedulerParameters=bf_interval=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$((PORT + 2))
ReturnToService=2
${nodes}PartitionName=local Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
  echo "CgroupPlugin=$CGROUP_PLUGIN" >"$ROOT/etc/slurm/cgroup.conf"
  cat >"$ROOT/etc/slurm/slurmdbd.conf" <<EOF
# Written by scripts/slurm_cluster.sh at every start.
AuthType=auth/munge
DbdHost=localhost
DbdPort=$((PORT + 2))
SlurmUser=root
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASSWORD
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$ROOT/etc/slurm/slurmdbd.conf"  # slurmdbd refuses a readable one
  mkdir -p "$LOGS" "$ROOT/var/lib/slurm/slurmctld" "${NODES[@]/#/$ROOT/var/lib/slurm/slurmd-}"
}

# Waits until `$2...` succeeds, for at most $1 seconds.
wait_for() {
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

pid_alive() { [ -f "$ROOT$1" ] && kill -0 "$(cat "$ROOT$1")" 2>/dev/null; }

start_daemons() {
  mkdir -p "$ROOT/run/munge" "$ROOT/run/mysqld"
  in_root chown munge:munge /run/munge
  in_root chown mysql:mysql /run/mysqld
  pid_alive /run/munge/munged.pid || in_root runuser -u munge -- /usr/sbin/munged \
    || die "munged did not start; see $ROOT/var/log/munge/munged.log"
  if ! pid_alive /run/mysqld/mysqld.pid; then
    setsid chroot "$ROOT" /usr/sbin/mariadbd --user=mysql --skip-networking \
      --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid \
      </dev/null >>"$LOGS/mariadb.log" 2>&1 9>&- &
  fi
  wait_for 60 in_root mariadb -e "SELECT 1" || die "MariaDB did not start; see $LOGS/mariadb.log"
  # MariaDB lets root in by socket only; slurmdbd logs in with a password. The database exists
  # before slurmdbd starts: Slurm 24.11 creates it over a connection that libmariadb 11.8 then
  # refuses every result on ("Number of columns in result (=1) set execeeds maxmimum allowed
  # number of columns (=0)"), and slurmdbd exits, at the first start of every new root.
  in_root mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
    CREATE DATABASE IF NOT EXISTS slurm_acct_db; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  # slurmdbd before slurmctld: slurmctld registers the cluster with it (else CLUSTER ID MISMATCH).
  pid_alive /run/slurmdbd.pid || in_root /usr/sbin/slurmdbd || die "slurmdbd did not start; see $LOGS/slurmdbd.log"
  wait_for 30 in_root sacctmgr --noheader --parsable2 list cluster \
    || die "slurmdbd did not start; see $LOGS/slurmdbd.log"
  pid_alive /run/slurmctld.pid || in_root /usr/sbin/slurmctld || die "slurmctld did not start; see $LOGS/slurmctld.log"
  start_nodes
  wait_for 30 nodes_in idle || die "the nodes did not come up: $(in_root /usr/bin/sinfo --Node 2>&1); see $LOGS/slurmd-*.log and slurmctld.log"
}

# Each node's slurmd on its host, in the network namespace and hostname of the host, but in this
# machine's mounts (--shared-mounts): directories shared with the root later, by a start from
# another checkout, reach the jobs too.
start_nodes() {
  local i out
  # Replaces a set left by a cluster that died, with whatever still ran on it.
  out=$(hosts up ${#NODES[@]} n 2>&1) || die "could not make the nodes' network namespaces: $out"
  for i in "${!NODES[@]}"; do
    on_host $((i + 1)) chroot "$ROOT" /usr/sbin/slurmd -N "${NODES[i]}" \
      || die "the slurmd of node ${NODES[i]} did not start; see $LOGS/slurmd-${NODES[i]}.log"
  done
}

# Passes when every node is in one of the states $@ (sinfo's short names: idle, mix, alloc, ...).
nodes_in() {
  local states node
  states=$(in_root /usr/bin/sinfo --noheader --Node --format='%N %t' 2>/dev/null) || return 1
  for node in "${NODES[@]}"; do
    grep -qxE "$node ($(IFS='|'; echo "$*"))" <<<"$states" || return 1
  done
}

# Host-side sbatch, squeue, ...: each runs the root's command inside the root, in the same
# directory, with the same environment.
write_commands() {
  local name
  mkdir -p "$BIN"
  for name in "${SLURM_COMMANDS[@]}"; do
    cat >"$BIN/$name" <<EOF
#!/bin/sh
# Written by $SELF: $name of the Slurm cluster in $ROOT.
if [ ! -d "$ROOT/proc/self" ]; then
  echo "$name: the Slurm cluster in $ROOT is not running: start it with $SELF start" >&2
  exit 2
fi
if [ ! -d "$ROOT\$PWD" ]; then
  echo "$name: \$PWD is not shared with the Slurm cluster; run from one of ${SHARED_DIRS[*]}, or add it to SLURM_CLUSTER_MOUNTS and restart the cluster ($SELF stop, then start)" >&2
  exit 2
fi
exec chroot "$ROOT" /usr/bin/env -C "\$PWD" /usr/bin/$name "\$@"
EOF
    chmod +x "$BIN/$name"
  done
}

running() {
  local node
  [ -d "$ROOT" ] && pid_alive /run/slurmctld.pid || return 1
  for node in "${NODES[@]}"; do
    pid_alive "/run/slurmd-$node.pid" || return 1
  done
  nodes_in idle mix alloc comp  # comp: a job on it is ending
}

# The pid files of the slurmds: each node's, and the one slurmd of this script's one-node
# version (it would answer as n1 from this machine's namespace).
slurmd_pid_files() { printf '/run/slurmd-%s.pid\n' "${NODES[@]}"; echo /run/slurmd.pid; }

check_python() {
  local python=$REPO/.venv/bin/python
  [ -x "$python" ] || return 0
  in_root "$python" -c "import sys" \
    || die "$python does not run inside the cluster's root: the Python it is built on must lie in a shared directory (${SHARED_DIRS[*]}); add its directory to SLURM_CLUSTER_MOUNTS"
}

start() {
  if running; then
    share_dirs  # this checkout, if the cluster was started from another one
    say "already running ($ROOT)"
  else
    build_root
    # What is left of a cluster that does not work (a node or slurmctld died, or an older version
    # of this script started it) starts again, on the configuration written now.
    # shellcheck disable=SC2046
    stop_daemons $(slurmd_pid_files) /run/slurmctld.pid
    write_config
    mount_system
    share_dirs
    write_commands
    start_daemons
    check_python
    say "started: Slurm $(in_root /usr/bin/sinfo --version | cut -d' ' -f2), nodes ${NODES[*]} ($(hosts addr 1), $(hosts addr 2); $(nproc) CPUs each), root $ROOT"
  fi
  say "put its commands first on PATH: export PATH=\"$BIN:\$PATH\""
}

# Stops the daemons of the given pid files together (each takes 1-2 s to exit).
stop_daemons() {
  local pidfile pids=()
  for pidfile in "$@"; do
    if pid_alive "$pidfile"; then pids+=("$(cat "$ROOT$pidfile")"); fi
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill "${pids[@]}"
  wait_for 20 all_exited "${pids[@]}" || kill -9 "${pids[@]}" 2>/dev/null || true
}

all_exited() {
  local pid
  for pid in "$@"; do
    if kill -0 "$pid" 2>/dev/null; then return 1; fi
  done
}

stop() {
  if [ ! -d "$ROOT" ]; then
    hosts down
    return 0
  fi
  if pid_alive /run/slurmctld.pid; then
    in_root /usr/bin/scancel --user=root 2>/dev/null || true  # jobs would keep shared dirs busy
  fi
  # slurmctld reports the last jobs to slurmdbd as it stops, so slurmdbd goes after it.
  # shellcheck disable=SC2046
  stop_daemons $(slurmd_pid_files) /run/slurmctld.pid
  hosts down  # kills what a job left running on the nodes
  stop_daemons /run/slurmdbd.pid /run/mysqld/mysqld.pid /run/munge/munged.pid
  unmount_under "$ROOT"
  say "stopped"
}

purge() {
  local root
  stop
  for root in "$HOME_DIR"/*/root "$HOME_DIR"/*/root.partial; do
    [ -d "$root" ] || continue
    mounts_under "$root" | grep -q . && die "$root is still in use (mounted); stop its cluster first"
    remove_root "$(dirname "$root")"
  done
  say "deleted the roots under $HOME_DIR"
}

usage() { die "usage: $0 start|stop|status|bin|purge"; }

case "${1:-}" in
  start|stop|purge)
    require_root "$1"
    mkdir -p "$HOME_DIR"
    check_ours "$HOME_DIR"
    [ ! -e "$HOME_DIR/lock" ] && [ ! -L "$HOME_DIR/lock" ] || check_ours "$HOME_DIR/lock" f
    exec 9>"$HOME_DIR/lock"
    flock 9  # one start/stop at a time on the machine
    "$1"
    ;;
  status) running ;;
  bin) echo "$BIN" ;;
  *) usage ;;
esac
