#!/usr/bin/env bash
# A real multi-node Slurm test cluster on this one machine (Debian 12, slurm-wlm 22.05).
#
#   slurm/dev-cluster.sh up       install what is missing, start everything, wait until all nodes are idle
#   slurm/dev-cluster.sh down     stop what `up` started, remove its namespaces/bridge (keeps state and logs)
#   slurm/dev-cluster.sh status   daemons, namespaces, sinfo, squeue
#   slurm/dev-cluster.sh env      shell lines a client needs (`eval "$(slurm/dev-cluster.sh env)"`); optional,
#                                 since `up` also installs the config as /etc/slurm/slurm.conf
#   slurm/dev-cluster.sh purge    down, then delete the state directory (job ids restart at 1 afterwards)
#   slurm/dev-cluster.sh kill-node nI [--silent] | revive-node nI   a node dies (its link down first) | comes back
#   slurm/dev-cluster.sh freeze-node nI | thaw-node nI              a node hangs (every process stopped) | runs on
#
# Runs as root. One munged, one private MariaDB (127.0.0.1), slurmdbd, slurmctld on this machine, and N slurmd
# "nodes" n1..nN, each in its own network + UTS + mount namespace on a private bridge. Everything lives under
# $HPCTRAIN_SLURM_DIR (default /tmp/hpctrain-slurm). See slurm/README.md.
#
# Environment (all optional):
#   HPCTRAIN_SLURM_DIR       state directory                      (/tmp/hpctrain-slurm)
#   HPCTRAIN_SLURM_NODES     number of nodes                      (4)
#   HPCTRAIN_SLURM_NODE_CPUS CPUs declared per node               (4; oversubscribes a small machine on purpose)
#   HPCTRAIN_SLURM_SUBNET    first three octets of the private /24 (10.213.77)
#   HPCTRAIN_SLURM_TIMEOUT   seconds `up` waits for the nodes      (60)
set -euo pipefail

S=${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}
NNODES=${HPCTRAIN_SLURM_NODES:-4}
NODE_CPUS=${HPCTRAIN_SLURM_NODE_CPUS:-4}
NODE_MEM_MB=4096
NODE_SHM=2g                  # each node's private /dev/shm (its RAM checkpoint tier)
SUBNET=${HPCTRAIN_SLURM_SUBNET:-10.213.77}
UP_TIMEOUT=${HPCTRAIN_SLURM_TIMEOUT:-60}
CLUSTER=hpctrain-dev
BRIDGE=hpcslurm0
NS_PREFIX=hpcslurm-          # network namespaces: /run/netns/hpcslurm-n1 ...
FREEZER=/sys/fs/cgroup/freezer  # each node's processes in a freezer cgroup of its own, where the machine has one
VETH_PREFIX=hpcs-            # host side of each node's veth pair: hpcs-n1 ...
CTL_ADDR=$SUBNET.1
CTL_HOST=$(hostname -s)
CTLD_PORT=16817
SLURMD_PORT=16818            # the same in every node: each has its own network namespace
DBD_PORT=16819
DB_PORT=13306
DB_PASS=hpctrain-dev
MARKER="hpctrain dev cluster (slurm/dev-cluster.sh)"
ETC_CONF=/etc/slurm/slurm.conf
ETC_BACKUP=/etc/slurm/slurm.conf.hpctrain-backup

CONF=$S/etc/slurm.conf
DBD_CONF=$S/etc/slurmdbd.conf
MUNGE_DIR=$S/munge
MUNGE_SOCK=$MUNGE_DIR/munge.socket
DB_DIR=$S/mariadb
DB_SOCK=$DB_DIR/mariadb.sock
RUN=$S/run
LOG=$S/log
export SLURM_CONF=$CONF       # for the client commands this script runs

T0=$EPOCHREALTIME
say() { awk -v a="$T0" -v b="$EPOCHREALTIME" -v m="$*" 'BEGIN { printf "[dev-cluster %5.1fs] %s\n", b - a, m }'; }
die() { echo "dev-cluster: ERROR: $*" >&2; exit 1; }

[[ $S == /* && $S != *[[:space:]]* ]] || die "HPCTRAIN_SLURM_DIR must be an absolute path without spaces: $S"
[[ $NNODES =~ ^[1-9][0-9]?$ ]] || die "HPCTRAIN_SLURM_NODES must be 1..99: $NNODES"
[[ $SUBNET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "HPCTRAIN_SLURM_SUBNET must look like 10.213.77: $SUBNET"

node_names() { local i; for ((i = 1; i <= NNODES; i++)); do echo "n$i"; done; }
node_addr() { echo "$SUBNET.$((10 + ${1#n}))"; }

# ---------------------------------------------------------------------------------------------------------
# processes: only pids from our pid files, checked against the expected name; zombies count as dead
# ---------------------------------------------------------------------------------------------------------
pid_alive() {  # pid expected-comm
    local pid=$1 name=$2 comm st
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "$name" ]] || return 1
    st=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
    [[ $st != Z* ]]
}
pidfile_pid() { [[ -s $1 ]] && tr -dc '0-9' <"$1" || true; }
daemon_pid() {  # pidfile name -> prints pid if alive
    local pid; pid=$(pidfile_pid "$1")
    if pid_alive "$pid" "$2"; then echo "$pid"; fi
}
stop_pids() {  # name pid... : TERM, wait up to 10 s, then KILL
    local name=$1; shift
    local pids=() p i
    for p in "$@"; do pid_alive "$p" "$name" && pids+=("$p"); done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        local left=()
        for p in "${pids[@]}"; do pid_alive "$p" "$name" && left+=("$p"); done
        ((${#left[@]})) || return 0
        sleep 0.1
    done
    say "  $name did not stop after SIGTERM: SIGKILL ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null || true
}
stop_daemon() {  # pidfile name
    local pid; pid=$(daemon_pid "$1" "$2")
    if [[ -n $pid ]]; then say "stopping $2 (pid $pid)"; stop_pids "$2" "$pid"; fi
    rm -f "$1"
}
our_ns_pids() {  # every process inside our node namespaces (slurmd, slurmstepd, job tasks, their orphans)
    local -A inos=()
    local f p link
    for f in /run/netns/"$NS_PREFIX"*; do
        [[ -e $f ]] || continue
        inos["net:[$(stat -L -c %i "$f")]"]=1
    done
    ((${#inos[@]})) || return 0
    for p in /proc/[0-9]*; do
        link=$(readlink "$p/ns/net" 2>/dev/null) || continue
        [[ -n ${inos[$link]:-} ]] && echo "${p#/proc/}"
    done
    return 0
}
live_pids() {  # pid... -> those still alive and not zombies
    (($#)) || return 0
    ps -o pid=,stat= -p "$(IFS=,; echo "$*")" 2>/dev/null | awk '$2 !~ /^Z/ {print $1}'
    return 0
}
stop_ns_processes() {  # SIGTERM everything in our namespaces, wait up to 3 s, SIGKILL what is left; repeat for late forks
    local round pids alive i
    for round in 1 2 3; do
        pids=$(our_ns_pids)
        pids=$(live_pids $pids)
        [[ -n $pids ]] || return 0
        if ((round == 1)); then
            say "stopping $(echo $pids | wc -w) process(es) in the node namespaces (slurmd, steps, tasks)"
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null || true
            for ((i = 0; i < 30; i++)); do
                # shellcheck disable=SC2086
                alive=$(live_pids $pids)
                [[ -n $alive ]] || break
                sleep 0.1
            done
            pids=$(our_ns_pids)
            pids=$(live_pids $pids)
            [[ -n $pids ]] || return 0
            say "  still alive after SIGTERM: SIGKILL $(echo $pids)"
        fi
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.2
    done
}

# ---------------------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------------------
ensure_packages() {
    local missing=() c
    for c in slurmctld slurmd sbatch sacct munged slurmdbd mariadbd mariadb-install-db ip nsenter unshare runuser ss flock setsid ps; do
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    ((${#missing[@]})) || return 0
    say "installing packages (missing: ${missing[*]}; log: $LOG/apt.log)"
    export DEBIAN_FRONTEND=noninteractive
    # apt must not start the distribution's own munge/mariadb/slurm services: we start private ones
    local policy=/usr/sbin/policy-rc.d own_policy=0 rc=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 0755 "$policy" && own_policy=1
    fi
    apt-get update -q >"$LOG/apt.log" 2>&1 || rc=$?
    if ((rc == 0)); then
        apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge slurmdbd mariadb-server \
            iproute2 procps util-linux >>"$LOG/apt.log" 2>&1 || rc=$?
    fi
    ((own_policy)) && rm -f "$policy"
    ((rc == 0)) || { tail -20 "$LOG/apt.log" >&2; die "package installation failed (rc $rc)"; }
    say "packages installed"
}

# ---------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------
write_if_changed() {  # path  (content on stdin) ; returns 0 if changed
    local tmp; tmp=$(mktemp "$1.XXXX")
    cat >"$tmp"
    if [[ -f $1 ]] && cmp -s "$tmp" "$1"; then rm -f "$tmp"; return 1; fi
    mv -f "$tmp" "$1"
    return 0
}

gen_slurm_conf() {
    local n
    cat <<EOF
# $MARKER
# Generated from $CONF; edit slurm/dev-cluster.sh instead of this file.
ClusterName=$CLUSTER
SlurmctldHost=$CTL_HOST($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK,cred_expire=10
CredType=cred/munge
StateSaveLocation=$S/ctld
SlurmdSpoolDir=$S/nodes/%n/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
SchedulerParameters=sched_interval=2,bf_interval=1
KillWait=5
ReturnToService=1
SlurmdTimeout=10
SlurmctldTimeout=30
MessageTimeout=10
InactiveLimit=0
MinJobAge=600
UnkillableStepTimeout=60
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_ADDR
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCK
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
EOF
    for n in $(node_names); do
        echo "NodeName=$n NodeHostname=$n NodeAddr=$(node_addr "$n") CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN"
    done
    local all="n[1-$NNODES]"
    ((NNODES > 1)) || all=n1
    echo "PartitionName=debug Nodes=$all Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30 PreemptMode=REQUEUE"
    echo "PartitionName=urgent Nodes=$all MaxTime=INFINITE State=UP PriorityTier=10"
}

gen_dbd_conf() {
    cat <<EOF
# $MARKER
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$CTL_HOST
DbdAddr=$CTL_ADDR
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
}

gen_node_hosts() {
    local n
    echo "# $MARKER: /etc/hosts inside the node namespaces"
    echo "127.0.0.1 localhost"
    echo "$CTL_ADDR $CTL_HOST"
    for n in $(node_names); do echo "$(node_addr "$n") $n"; done
}

strip_block() {  # stdin minus our marked block
    awk -v b="# BEGIN $MARKER" -v e="# END $MARKER" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}'
}

install_host_files() {
    # /etc/hosts of this machine (the login side) resolves the node names: a marked block, rewritten in place
    local block cur new n
    block="# BEGIN $MARKER"$'\n'
    for n in $(node_names); do block+="$(node_addr "$n") $n"$'\n'; done
    block+="# END $MARKER"
    cur=$(cat /etc/hosts)
    new=$(printf '%s\n' "$cur" | strip_block)
    new+=$'\n'"$block"
    [[ $new == "$cur" ]] || printf '%s\n' "$new" >/etc/hosts   # in place: /etc/hosts may be a bind mount

    # /etc/slurm/slurm.conf: the default path every client (sbatch, squeue, sacct, submitit) reads
    mkdir -p /etc/slurm
    if [[ -f $ETC_CONF ]] && ! is_ours "$ETC_CONF" && [[ ! -e $ETC_BACKUP ]]; then
        say "backing up $ETC_CONF to $ETC_BACKUP"
        mv "$ETC_CONF" "$ETC_BACKUP"
    fi
    cmp -s "$CONF" "$ETC_CONF" 2>/dev/null || cp "$CONF" "$ETC_CONF"
}

is_ours() { local first=""; read -r first <"$1" || true; [[ $first == "# $MARKER" ]]; }

remove_host_files() {
    local cur new
    cur=$(cat /etc/hosts)
    new=$(printf '%s\n' "$cur" | strip_block)
    [[ $new == "$cur" ]] || printf '%s\n' "$new" >/etc/hosts
    if [[ -f $ETC_CONF ]] && is_ours "$ETC_CONF"; then rm -f "$ETC_CONF"; fi
    if [[ -e $ETC_BACKUP && ! -e $ETC_CONF ]]; then mv "$ETC_BACKUP" "$ETC_CONF"; say "restored $ETC_CONF"; fi
}

# ---------------------------------------------------------------------------------------------------------
# network: bridge $BRIDGE with $CTL_ADDR/24, one netns + veth per node, no default route, no forwarding
# ---------------------------------------------------------------------------------------------------------
setup_network() {
    local n ns veth addrs
    addrs=$(ip -4 -o addr show)
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        if grep -qF " $SUBNET." <<<"$addrs"; then
            die "subnet $SUBNET.0/24 is already used on this machine; set HPCTRAIN_SLURM_SUBNET"
        fi
        ip link add "$BRIDGE" type bridge
        ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    for n in $(node_names); do
        ns=$NS_PREFIX$n veth=$VETH_PREFIX$n
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip link add "$veth" type veth peer name "${veth}p"
            ip link set "${veth}p" netns "$ns"
            ip -n "$ns" link set "${veth}p" name eth0
            ip -n "$ns" addr add "$(node_addr "$n")/24" dev eth0
        fi
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
    done
}

teardown_network() {
    local ns n veth
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        [[ $ns == "$NS_PREFIX"* ]] || continue
        n=${ns#"$NS_PREFIX"}
        veth=$VETH_PREFIX$n
        ip link del "$veth" 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    for veth in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//'); do
        [[ $veth == "$VETH_PREFIX"* ]] && ip link del "$veth" 2>/dev/null || true
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
    return 0
}

# ---------------------------------------------------------------------------------------------------------
# daemons
# ---------------------------------------------------------------------------------------------------------
wait_for() {  # seconds description command...
    local secs=$1 i; shift 2  # $2: what we wait for (documentation only)
    for ((i = 0; i < secs * 10; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    return 1
}
port_listening() { local out; out=$(ss -ltnH "sport = :$1" 2>/dev/null); [[ -n $out ]]; }

start_munge() {
    [[ -n $(daemon_pid "$MUNGE_DIR/munged.pid" munged) ]] && return 0
    say "starting munged"
    install -d -o munge -g munge -m 0755 "$MUNGE_DIR"
    if [[ ! -s $MUNGE_DIR/munge.key ]]; then
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
    chown munge:munge "$MUNGE_DIR/munge.key"
    chmod 0400 "$MUNGE_DIR/munge.key"
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    runuser -u munge -- munged --socket="$MUNGE_SOCK" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" 9>&- \
        || { tail -5 "$MUNGE_DIR/munged.log" >&2 || true; die "munged failed to start"; }
    wait_for 10 munge test -S "$MUNGE_SOCK" || die "munged socket $MUNGE_SOCK did not appear"
}

start_mariadb() {
    [[ -n $(daemon_pid "$RUN/mariadbd.pid" mariadbd) ]] && return 0
    if [[ ! -d $DB_DIR/data/mysql ]]; then
        say "initialising the private MariaDB in $DB_DIR/data"
        rm -rf "$DB_DIR/data"
        mkdir -p "$DB_DIR/data"
        mariadb-install-db --no-defaults --user=root --datadir="$DB_DIR/data" --skip-test-db \
            --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 \
            || { tail -20 "$LOG/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
    fi
    say "starting mariadbd (127.0.0.1:$DB_PORT)"
    setsid mariadbd --no-defaults --user=root --datadir="$DB_DIR/data" --socket="$DB_SOCK" \
        --pid-file="$RUN/mariadbd.pid" --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
        --skip-log-bin --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
        --innodb-log-file-size=64M --log-error="$LOG/mariadb.log" </dev/null >>"$LOG/mariadb.log" 2>&1 9>&- &
    if ! wait_for 30 mariadb mariadb-admin --no-defaults -S "$DB_SOCK" -u root ping; then
        tail -20 "$LOG/mariadb.log" >&2; die "mariadbd did not come up"
    fi
    mariadb --no-defaults -S "$DB_SOCK" -u root -e "
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        FLUSH PRIVILEGES;" || die "could not create the slurm database user"
}

start_slurmdbd() {
    [[ -n $(daemon_pid "$RUN/slurmdbd.pid" slurmdbd) ]] && return 0
    say "starting slurmdbd ($CTL_ADDR:$DBD_PORT)"
    slurmdbd 9>&- || { tail -20 "$LOG/slurmdbd.log" >&2; die "slurmdbd failed to start"; }
    if ! wait_for 60 slurmdbd port_listening "$DBD_PORT"; then
        tail -20 "$LOG/slurmdbd.log" >&2; die "slurmdbd is not listening on port $DBD_PORT"
    fi
}

ensure_cluster_registered() {
    local out
    out=$(timeout 15 sacctmgr -n -P list cluster format=cluster 2>&1) || { echo "$out" >&2; die "sacctmgr cannot reach slurmdbd"; }
    if ! grep -qx "$CLUSTER" <<<"$out"; then
        say "registering cluster $CLUSTER in slurmdbd"
        timeout 15 sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

start_slurmctld() {
    [[ -n $(daemon_pid "$RUN/slurmctld.pid" slurmctld) ]] && return 0
    say "starting slurmctld ($CTL_HOST($CTL_ADDR):$CTLD_PORT)"
    mkdir -p "$S/ctld"
    slurmctld -f "$CONF" 9>&- || { tail -20 "$LOG/slurmctld.log" >&2; die "slurmctld failed to start"; }
    if ! wait_for 30 slurmctld timeout 5 scontrol ping; then
        tail -30 "$LOG/slurmctld.log" >&2; die "slurmctld does not answer scontrol ping"
    fi
}

node_freezer() {  # node -> its freezer cgroup (cgroup v1: every process slurmd forks stays in it), made here;
    # nothing where this machine has none or may not make one (kill-node then stops the processes one by one)
    local cg=$FREEZER/hpctrain-dev-$1
    mkdir -p "$cg" 2>/dev/null && [[ -w $cg/freezer.state && -w $cg/cgroup.procs ]] && echo "$cg"
    return 0
}

start_slurmd() {  # node
    local n=$1 ns=$NS_PREFIX$1 cg
    [[ -n $(daemon_pid "$RUN/slurmd-$n.pid" slurmd) ]] && return 0
    mkdir -p "$S/nodes/$n/spool"
    cg=$(node_freezer "$n")
    [[ -z $cg ]] || echo THAWED >"$cg/freezer.state"
    say "starting slurmd $n ($(node_addr "$n"), namespace $ns${cg:+, cgroup $cg})"
    # Not `ip netns exec`: it remounts /sys and slurmd dies ("No filesystem mounted on /sys/fs/cgroup").
    # /dev/shm is the node's own RAM, as on real nodes: a tmpfs in its mount namespace, gone when the node dies
    # (kill-node ends every process holding it), empty when it comes back.
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
        sh -c "${cg:+echo \$\$ >$cg/cgroup.procs && }hostname $n && mount --bind $S/nodes/$n/hosts /etc/hosts \
               && mount -t tmpfs -o size=$NODE_SHM,mode=1777 tmpfs /dev/shm \
               && exec slurmd -f $CONF -N $n" 9>&- </dev/null \
        || { tail -20 "$LOG/slurmd-$n.log" >&2 || true; die "slurmd $n failed to start"; }
}

node_states() { timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

wait_nodes_ready() {
    local deadline=$(($(date +%s) + UP_TIMEOUT)) states bad resumed=0
    while :; do
        states=$(node_states || true)
        bad=$(printf '%s\n' "$states" | awk 'NF==2 && $2 !~ /^(idle|mix|alloc|comp)$/ {print}')
        if [[ -n $states && -z $bad ]] && (($(printf '%s\n' "$states" | wc -l) == NNODES)); then return 0; fi
        # nodes left DOWN/DRAIN by an earlier run (not just "not responding" yet): resume them once
        if ((!resumed)) && grep -qE ' (down|drain|drng)$' <<<"$bad"; then
            local ns; ns=$(printf '%s\n' "$bad" | awk '$2 ~ /^(down|drain|drng)$/ {print $1}' | paste -sd,)
            say "resuming nodes left down/drained by an earlier run: $ns"
            timeout 10 scontrol update nodename="$ns" state=resume >/dev/null 2>&1 || true
            resumed=1
        fi
        if (($(date +%s) >= deadline)); then
            echo "dev-cluster: ERROR: nodes not ready after ${UP_TIMEOUT}s:" >&2
            printf '%s\n' "${states:-<sinfo gave nothing>}" >&2
            timeout 10 sinfo -R >&2 || true
            local f
            for f in "$LOG"/slurmd-n*.log "$LOG/slurmctld.log"; do
                [[ -f $f ]] && { echo "---- tail $f" >&2; tail -15 "$f" >&2; }
            done
            exit 1
        fi
        sleep 0.3
    done
}

all_running() {
    local n
    [[ -n $(daemon_pid "$MUNGE_DIR/munged.pid" munged) ]] || return 1
    [[ -n $(daemon_pid "$RUN/mariadbd.pid" mariadbd) ]] || return 1
    [[ -n $(daemon_pid "$RUN/slurmdbd.pid" slurmdbd) ]] || return 1
    [[ -n $(daemon_pid "$RUN/slurmctld.pid" slurmctld) ]] || return 1
    for n in $(node_names); do [[ -n $(daemon_pid "$RUN/slurmd-$n.pid" slurmd) ]] || return 1; done
    return 0
}

# ---------------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------------
cmd_up() {
    [[ $(id -u) == 0 ]] || die "must run as root"
    mkdir -p "$S" "$S/etc" "$RUN" "$LOG" "$S/nodes"
    chmod 0755 "$S"
    ensure_packages
    # serialise concurrent up/down; every daemon is started with 9>&- so that it does not inherit the lock
    exec 9>"$S/.lock"
    flock -w 120 9 || die "another dev-cluster.sh holds $S/.lock"

    local changed=0 n
    gen_slurm_conf | write_if_changed "$CONF" && changed=1
    (umask 077; gen_dbd_conf | write_if_changed "$DBD_CONF") || true
    chmod 0600 "$DBD_CONF"
    for n in $(node_names); do
        mkdir -p "$S/nodes/$n/spool"
        gen_node_hosts | write_if_changed "$S/nodes/$n/hosts" || true
    done

    if all_running && ((!changed)) && cmp -s "$CONF" "$ETC_CONF"; then
        say "already up"
        wait_nodes_ready
        cmd_status
        return 0
    fi
    if ((changed)); then
        [[ -z $(daemon_pid "$RUN/slurmctld.pid" slurmctld) ]] || say "slurm.conf changed: restarting the Slurm daemons"
        stop_slurm_daemons
    fi
    # nodes of an earlier, larger cluster
    local old
    for old in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        [[ $old == "$NS_PREFIX"* ]] || continue
        n=${old#"$NS_PREFIX"}
        if ! grep -qx "$n" <<<"$(node_names)"; then stop_slurm_daemons; ip link del "$VETH_PREFIX$n" 2>/dev/null || true; ip netns del "$old"; fi
    done

    setup_network
    install_host_files
    start_munge
    start_mariadb
    start_slurmdbd
    ensure_cluster_registered
    start_slurmctld
    for n in $(node_names); do start_slurmd "$n"; done
    say "waiting for $NNODES node(s) to be idle"
    wait_nodes_ready
    say "up: $NNODES node(s) ready"
    cmd_status
}

requeue_running_jobs() {
    # Their processes are about to die with the nodes; without this the controller would keep them RUNNING
    # (ghosts holding their nodes) after the next `up`. Requeue them like a node failure would.
    [[ -n $(daemon_pid "$RUN/slurmctld.pid" slurmctld) ]] || return 0
    local jobs j rq="" cx=""
    jobs=$(timeout 10 squeue -h -t RUNNING,CONFIGURING,SUSPENDED -o %i 2>/dev/null) || return 0
    for j in $jobs; do
        if timeout 10 scontrol requeue "$j" >/dev/null 2>&1; then rq+=" $j"
        elif timeout 10 scancel "$j" >/dev/null 2>&1; then cx+=" $j"; fi
    done
    [[ -z $rq ]] || say "requeued running job(s):$rq"
    [[ -z $cx ]] || say "cancelled running job(s) that cannot be requeued:$cx"
    return 0
}

stop_slurm_daemons() {
    local f
    requeue_running_jobs
    stop_daemon "$RUN/slurmctld.pid" slurmctld
    stop_ns_processes
    # a slurmd whose namespace is already gone (should not happen, but its pid file says so)
    for f in "$RUN"/slurmd-*.pid; do
        [[ -e $f ]] || continue
        stop_daemon "$f" slurmd
    done
}

cmd_down() {
    [[ $(id -u) == 0 ]] || die "must run as root"
    if [[ ! -d $S ]]; then
        teardown_network
        say "down (nothing was running: $S does not exist)"
        return 0
    fi
    exec 9>"$S/.lock"
    flock -w 120 9 || die "another dev-cluster.sh holds $S/.lock"
    stop_slurm_daemons
    stop_daemon "$RUN/slurmdbd.pid" slurmdbd
    stop_daemon "$RUN/mariadbd.pid" mariadbd
    stop_daemon "$MUNGE_DIR/munged.pid" munged
    teardown_network
    remove_host_files
    rmdir "$FREEZER"/hpctrain-dev-* 2>/dev/null || true  # the nodes' cgroups, empty once their processes ended
    say "down (state and logs kept in $S)"
}

cmd_purge() {
    cmd_down
    if [[ -d $S ]]; then rm -rf "$S"; say "removed $S"; fi
}

cmd_status() {
    local pid n f name
    echo "state directory: $S"
    for f in "$MUNGE_DIR/munged.pid:munged" "$RUN/mariadbd.pid:mariadbd" "$RUN/slurmdbd.pid:slurmdbd" "$RUN/slurmctld.pid:slurmctld"; do
        name=${f##*:}
        pid=$(daemon_pid "${f%:*}" "$name")
        if [[ -n $pid ]]; then printf '  %-10s running (pid %s)\n' "$name" "$pid"; else printf '  %-10s stopped\n' "$name"; fi
    done
    for n in $(node_names); do
        pid=$(daemon_pid "$RUN/slurmd-$n.pid" slurmd)
        if [[ -n $pid ]]; then
            printf '  %-10s running (pid %s, %s, netns %s)\n' "slurmd $n" "$pid" "$(node_addr "$n")" "$NS_PREFIX$n"
        else printf '  %-10s stopped\n' "slurmd $n"; fi
    done
    if [[ -n $(daemon_pid "$RUN/slurmctld.pid" slurmctld) ]]; then
        echo "sinfo:"
        timeout 10 sinfo 2>&1 | sed 's/^/  /' || true
        echo "squeue:"
        timeout 10 squeue 2>&1 | sed 's/^/  /' || true
    fi
}

node_ns_pids() {  # node -> every process in that node's network namespace (slurmd, steps, tasks)
    local ino p link
    [[ -e /run/netns/$NS_PREFIX$1 ]] || return 0
    ino="net:[$(stat -L -c %i "/run/netns/$NS_PREFIX$1")]"
    for p in /proc/[0-9]*; do
        link=$(readlink "$p/ns/net" 2>/dev/null) || continue
        [[ $link == "$ino" ]] && echo "${p#/proc/}"
    done
    return 0
}

cmd_kill_node() {  # node [--silent]: a node dies: SIGKILL its slurmd and everything running on it, nothing else
    local n=${1:?usage: dev-cluster.sh kill-node nI [--silent]} pids
    # --silent: its link goes down first, as when a node loses power: its peers get no FIN or RST, only
    # silence (without it the kernel closes the killed processes' connections, which a real death does not)
    if [[ ${2:-} == --silent ]]; then ip link set "$VETH_PREFIX$n" down; fi
    # A node dies at once: none of its processes may see another die first and act on it (srun forks a child
    # that ends the whole step, on every node, when its parent dies before it). So all of them are stopped
    # before any is killed. Where the node has a freezer cgroup, the kernel freezes all of them in one write
    # (what it forks meanwhile included; nothing frozen runs, whatever signal it is sent). Else each is sent
    # SIGSTOP, and looked at again until every one is stopped: a look finds what was forked meanwhile, and a
    # process a parent continued (slurmstepd sends SIGCONT to a child it sees stop, if it is stopped after the
    # child: seen in CI as "srun: got SIGCONT", then srun ending the step on the other nodes, twice).
    local stopped="" running _ cg
    cg=$(node_freezer "$n")
    if [[ -n $cg && -n $(<"$cg/cgroup.procs") ]]; then  # (not `-s`: a cgroup file's size is 0)
        echo FROZEN >"$cg/freezer.state"
        for _ in $(seq 100); do [[ $(<"$cg/freezer.state") == FROZEN ]] && break; sleep 0.05; done
        stopped=$(sort -un "$cg/cgroup.procs" | xargs)
        say "killing node $n: $(echo $stopped | wc -w) process(es), frozen ($(<"$cg/freezer.state"))"
        # shellcheck disable=SC2086
        [[ -z $stopped ]] || kill -KILL $stopped 2>/dev/null || true
        echo THAWED >"$cg/freezer.state"  # they die as they thaw
        stopped=$(live_pids $(node_ns_pids "$n"))  # anything outside the cgroup (a node started before it)
        # shellcheck disable=SC2086
        [[ -z $stopped ]] || kill -KILL $stopped 2>/dev/null || true
        return 0
    fi
    for _ in 1 2 3 4 5 6; do
        stopped=$(echo $stopped $(live_pids $(node_ns_pids "$n")) | tr ' ' '\n' | sort -un | xargs)
        [[ -n $stopped ]] || break
        running=$(ps -o pid=,stat= -p "$(echo $stopped | tr ' ' ',')" 2>/dev/null | awk '$2 !~ /^[TtZ]/ {print $1}')
        [[ -n $running ]] || break
        # shellcheck disable=SC2086
        kill -STOP $running 2>/dev/null || true
    done
    say "killing node $n: $(echo $stopped | wc -w) process(es)"
    # shellcheck disable=SC2086
    [[ -z $stopped ]] || kill -KILL $stopped 2>/dev/null || true
}

cmd_freeze_node() {  # node: the node hangs: every process on it stops (its freezer cgroup frozen), none dies, its
    # link stays up: its peers see silence, not closed connections, and slurmd answers nothing either (Slurm
    # declares the node DOWN after SlurmdTimeout). thaw-node undoes it.
    local n=${1:?usage: dev-cluster.sh freeze-node nI} cg _
    cg=$(node_freezer "$n")
    [[ -n $cg && -n $(<"$cg/cgroup.procs") ]] || die "freeze-node needs node $n running in a freezer cgroup (cgroup v1)"
    echo FROZEN >"$cg/freezer.state"
    for _ in $(seq 100); do [[ $(<"$cg/freezer.state") == FROZEN ]] && break; sleep 0.05; done
    say "froze node $n: $(sort -un "$cg/cgroup.procs" | wc -l) process(es) ($(<"$cg/freezer.state"))"
}

cmd_thaw_node() {  # node: after freeze-node: its processes run on (a node Slurm declared DOWN comes back)
    local n=${1:?usage: dev-cluster.sh thaw-node nI} cg
    cg=$(node_freezer "$n")
    [[ -z $cg ]] || echo THAWED >"$cg/freezer.state"
    timeout 10 scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
    say "thawed node $n"
}

cmd_kill_job() {  # job: the job crashes: SIGKILL every process of its first step (its tasks, and the workers
    # their agents forked), as an OOM killer or a segfault in all of them would; srun then fails and the batch
    # script goes on (hpctrain's supervisor). Not slurmstepd, not srun, not the batch script.
    local job=${1:?usage: dev-cluster.sh kill-job JOBID} pids="" p env
    for p in /proc/[0-9]*; do
        env=$(tr '\0' '\n' < "$p/environ" 2>/dev/null) || continue
        grep -qx "SLURM_JOB_ID=$job" <<< "$env" && grep -qx "SLURM_STEP_ID=0" <<< "$env" \
            && grep -q "^SUBMITIT_EXECUTOR=" <<< "$env" && pids="$pids ${p#/proc/}"
    done
    say "killing job $job: $(echo $pids | wc -w) process(es)"
    # shellcheck disable=SC2086
    [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
}

cmd_revive_node() {  # node: start its slurmd again (ReturnToService=1 brings it back once it registers)
    local n=${1:?usage: dev-cluster.sh revive-node nI}
    ip link set "$VETH_PREFIX$n" up  # after kill-node --silent
    start_slurmd "$n"
    timeout 10 scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
}

cmd_env() {
    echo "export SLURM_CONF=$CONF"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    purge) cmd_purge ;;
    kill-node) cmd_kill_node "${2:-}" "${3:-}" ;;
    revive-node) cmd_revive_node "${2:-}" ;;
    freeze-node) cmd_freeze_node "${2:-}" ;;
    thaw-node) cmd_thaw_node "${2:-}" ;;
    kill-job) cmd_kill_job "${2:-}" ;;
    *) echo "usage: $0 up|down|status|env|purge|kill-node nI [--silent]|revive-node nI|freeze-node nI|thaw-node nI|kill-job JOBID" >&2
       exit 2 ;;
esac
