#!/bin/bash
# The checks inside the e2e VM (run by the guest's lodger-e2e.service as root; see run-vm.sh).
# /mnt/e2e is shared with the host: it holds the packages, the training emulator and this
# script, and receives results.txt: one PASS/FAIL line per check, notes indented, and
# `N passed, N failed` at the end. The VM powers off when this script exits.
. "$(dirname "$0")/lib.sh"

# Every thread of $1 is SCHED_OTHER and allowed every online CPU.
all_other_everywhere() {
    local pid=$1 t online
    online=$(cat /sys/devices/system/cpu/online)
    for t in /proc/"$pid"/task/*; do
        [ "$(sched_of "$t" | cut -d' ' -f1)" = 0 ] || { echo "thread ${t##*/}: $(sched_of "$t")"; return 1; }
        grep -q "^Cpus_allowed_list:[[:space:]]*$online\$" "$t/status" ||
            { echo "thread ${t##*/}: $(grep Cpus_allowed_list "$t/status")"; return 1; }
    done
}
# CPUs $1 all belong to NUMA node $2 and are whole cores (every SMT sibling included).
numa_local_whole_cores() {
    local cpus=$1 node=$2 c s
    local -A in_set=()
    for c in $(expand "$cpus"); do in_set[$c]=1; done
    for c in $(expand "$(cat /sys/devices/system/node/node"$node"/cpulist)"); do
        unset "in_set[$c]" 2>/dev/null || true
    done
    [ ${#in_set[@]} = 0 ] || { echo "CPUs ${!in_set[*]} are not on node $node"; return 1; }
    for c in $(expand "$cpus"); do
        for s in $(expand "$(cat /sys/devices/system/cpu/cpu"$c"/topology/thread_siblings_list)"); do
            [[ " $(expand "$cpus") " == *" $s "* ]] || { echo "CPU $c without its sibling $s"; return 1; }
        done
    done
    echo "$cpus: node $node, whole cores"
}
count() { expand "$1" | wc -w; }
# "cpus id" of every job, from lodgerctl's JSON (keys come sorted).
placements() { lodgerctl --json list | grep -o '"cpus":"[^"]*"\|"id":"[^"]*"' | paste -sd' '; }
# Cgroups of lodger's (not this test's own lodger-e2e.service, nor Slurm's scope, which Debian's
# Slurm names after the host: lodger-e2e_slurmstepd.scope).
lodger_cgroups() {
    local found
    found=$(find /sys/fs/cgroup -name '*lodger*' ! -name lodger-e2e.service \
        ! -name "$(hostname -s)_slurmstepd.scope")
    echo "$found"
    [ -z "$found" ]
}
# Starts the training emulator in a unit of its own, as a launcher would; prints its pid.
start_training() { # unit gpu [systemd-run options...]
    local unit=$1 gpu=$2
    shift 2
    systemd-run --quiet --unit="$unit" -p Type=exec "$@" /usr/local/bin/train_emulator \
        --workers 3 --batch-cpu-ms 1 --gpu-step-ms 50 \
        --publish-dir /run/lodger/emulated-gpu --gpu "$gpu"
    local pid="" i
    for i in $(seq 100); do
        pid=$(systemctl show -p MainPID --value "$unit")
        [ "${pid:-0}" != 0 ] && [ "$(ls /proc/"$pid"/task 2>/dev/null | wc -l)" -ge 5 ] && break
        sleep 0.2
    done
    echo "$pid"
}
wait_active() {
    local i
    for i in $(seq 150); do
        systemctl -q is-active lodgerd && return 0
        sleep 0.2
    done
    return 1
}
# No user-space thread on the node is SCHED_RR or SCHED_FIFO (kernel threads are children of
# kthreadd, pid 2, and are left out).
no_rt_user_threads() {
    local rt
    rt=$(ps -eLo cls=,ppid=,pid=,tid=,comm= | awk '($1 == "RR" || $1 == "FF") && $2 != 2 && $3 != 2')
    [ -z "$rt" ] || { echo "$rt"; return 1; }
}

echo "guest up: $(cut -d' ' -f1 /proc/uptime) s since the kernel started" | note

phase "the node"
check "systemd is PID 1" test "$(cat /proc/1/comm)" = systemd
check "cgroup v2 unified at /sys/fs/cgroup" test "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs
check "16 CPUs online (2 sockets x 4 cores x 2 threads)" \
    test "$(cat /sys/devices/system/cpu/online)" = 0-15
check "2 NUMA nodes: node0 = 0-7, node1 = 8-15" \
    test "$(cat /sys/devices/system/node/node0/cpulist) $(cat /sys/devices/system/node/node1/cpulist)" = "0-7 8-15"
check "SMT siblings: CPU 8 pairs with CPU 9" \
    test "$(cat /sys/devices/system/cpu/cpu8/topology/thread_siblings_list)" = 8-9

phase "install"
cp "$share/train_emulator" /usr/local/bin/
mkdir -p /run/lodger/emulated-gpu
cd "$share" || exit 1
deb=$(ls lodger_*.deb)
check "apt install ./$deb" apt-get install -y ./"$deb"
check_eq "lodgerd.service enabled on install" "$(systemctl is-enabled lodgerd)" enabled
check_eq "lodgerd.service not started on install" "$(systemctl is-active lodgerd)" inactive
check "group lodger created" getent group lodger
check "systemd-analyze verify lodgerd.service: clean" \
    sh -c '! systemd-analyze verify lodgerd.service 2>&1 | grep .'
check "man pages, completions and D-Bus policy installed" test -f /usr/share/man/man8/lodgerd.8.gz \
    -a -f /usr/share/man/man1/lodgerctl.1.gz -a -f /usr/share/bash-completion/completions/lodgerctl \
    -a -f /usr/share/dbus-1/system.d/org.lodger1.conf

# The site's declarations: GPU 0 sits on NUMA node 1, GPU 1 on node 0 (sysfs in a VM cannot
# tell), and GPU utilization comes from the training emulator.
cat >>/etc/lodger/lodger.toml <<'EOF'

[[node.gpu]]
index = 0
numa_node = 1

[[node.gpu]]
index = 1
numa_node = 0
EOF
sed -i 's/^gpu = "auto"$/gpu = "emulated"/' /etc/lodger/lodger.toml
# A NIC to shape: a dummy interface (it drops what it sends, after the qdisc has classified it).
ip link add lt0 type dummy && ip addr add 10.99.0.1/24 dev lt0 && ip link set lt0 up
cat >>/etc/lodger/lodger.toml <<'EOF'

[[network.link]]
interface = "lt0"
line_rate_mbit = 1000
EOF
check "lodgerd --check-config accepts the GPU overrides" lodgerd --check-config
lodgerd --check-config 2>&1 | note

phase "start"
t0=$(date +%s.%N)
check "systemctl enable --now lodgerd: active (READY=1)" sh -c 'systemctl enable --now lodgerd && systemctl -q is-active lodgerd'
echo "ready after $(awk -v s="$t0" -v e="$(date +%s.%N)" 'BEGIN { printf "%.2f", e - s }') s" | note
lodgerd_pid=$(systemctl show -p MainPID --value lodgerd)
check "lodgerd's threads stay on the reserved CPUs 0-1" sh -c \
    "! grep -h Cpus_allowed_list: /proc/$lodgerd_pid/task/*/status | grep -v '[[:space:]]0-1\$'"
expected_caps=$(printf '%016x' $(((1 << 5) | (1 << 12) | (1 << 21) | (1 << 23) | (1 << 38))))
check "capabilities: bounding set is SYS_NICE SYS_ADMIN PERFMON NET_ADMIN KILL only" \
    grep -q "^CapBnd:[[:space:]]*$expected_caps\$" /proc/"$lodgerd_pid"/status
check "NoNewPrivs set" grep -q '^NoNewPrivs:[[:space:]]*1$' /proc/"$lodgerd_pid"/status
check "Delegate=yes: cpuset is among the controllers of lodgerd.service's cgroup" grep -qw cpuset \
    /sys/fs/cgroup/system.slice/lodgerd.service/cgroup.controllers
check_eq "no device allow-list (NVML opens /dev/nvidia*; ProtectClock=yes made one before systemd 252)" \
    "$(systemctl show -p DeviceAllow --value lodgerd)" ""
check "watchdog armed (WatchdogSec=30s)" test "$(systemctl show -p WatchdogUSec --value lodgerd)" = 30s
# The eBPF filter that narrows the process events to the jobs' processes (src/sys/procwatch.rs)
# loads within the unit's bounding set: lodgerd holds its map (65536 entries), and no fall-back
# line was logged.
check "process events narrowed to the jobs' processes in the kernel (eBPF map held, no fall-back)" \
    sh -c "grep -qs 'max_entries:[[:space:]]*65536\$' /proc/$lodgerd_pid/fdinfo/* &&
        ! journalctl -b -u lodgerd -o cat | grep -q 'the kernel filter could not be loaded'"
check "GPU utilization source: the training emulator's published records (gpu = \"emulated\")" \
    sh -c 'journalctl -b -u lodgerd -o cat -n 50 | grep "GPU sensing" | tail -n 1 | grep emulated'
lodgerctl status 2>&1 | note

. "$share/slurm.sh"
# LODGER_E2E_STOP_AFTER_SLURM=1 on the host: a quick look at the Slurm checks alone.
[ ! -e "$share/stop-after-slurm" ] || finish

phase "a training job registered with lodgerctl: GPU 0, so NUMA node 1"
# Right-sizing (SODA's tuner, fed by the emulated GPU) is off for the jobs kept across restart
# and upgrade: those checks compare placements, which the tuner may legitimately change.
pid_a=$(start_training train-a 0)
cgroup_a=$(cat /proc/"$pid_a"/cgroup)
check "register training (lodgerctl, GPU 0, 4 CPUs)" \
    lodgerctl register training --pid "$pid_a" --gpus 0 --cores 4 --name bert --no-rightsize
job_a=$(lodgerctl --json list | sed -n 's/.*"id":"\(j[0-9]*\)".*/\1/p' | head -n 1)
json_a=$(lodgerctl --json show "$job_a")
cpus_a=$(field "$json_a" cpus)
echo "$job_a: $json_a" | note
check_eq "$job_a: 4 CPUs" "$(count "$cpus_a")" 4
check "$job_a: NUMA-local to GPU 0 (node 1), whole cores" numa_local_whole_cores "$cpus_a" 1
check_eq "$job_a: memory on node 1" "$(field "$json_a" mems)" 1
check "$job_a: every thread SCHED_RR/10 on its CPUs" all_rr_on "$pid_a" 10 "$cpus_a"
check "$job_a: process left in its own unit's cgroup (v2: pinned by affinity)" \
    test "$(cat /proc/"$pid_a"/cgroup)" = "$cgroup_a"
ps -L -o tid,cls,rtprio,psr,comm -p "$pid_a" | note
# sd_notify STATUS=, read every 10 s: the line systemctl status shows under the unit.
check "systemctl status shows lodgerd's line: jobs, instances, training's CPUs" sh -c 'for _ in $(seq 30); do
    systemctl show -p StatusText --value lodgerd |
        grep -Eq "^[0-9]+ jobs?, [0-9]+ instances?; training on CPUs [0-9,-]+ \([0-9]+\), [0-9]+ free; contention .*; network " && exit 0
    sleep 1; done; systemctl show -p StatusText --value lodgerd; exit 1'

phase "a second one registered with busctl: GPU 1, so NUMA node 0 less the reserved CPUs"
pid_b=$(start_training train-b 1)
reply=$(busctl call org.lodger1 /org/lodger1 org.lodger1.Manager RegisterJob 'a{sv}' 5 \
    kind s training pids au 1 "$pid_b" gpus au 1 1 cores u 4 rightsize b false 2>&1)
job_b=$(sed -n 's/^so "\(j[0-9]*\)".*/\1/p' <<<"$reply")
check "register training (busctl RegisterJob, GPU 1, 4 CPUs): $reply" test -n "$job_b"
json_b=$(lodgerctl --json show "$job_b")
cpus_b=$(field "$json_b" cpus)
echo "$job_b: $json_b" | note
check "$job_b: 4 CPUs, none reserved (0-1)" sh -c "test $(count "$cpus_b") = 4 && \
    test -z \"\$(echo ' $(expand "$cpus_b") ' | grep -E ' (0|1) ')\""
check "$job_b: NUMA-local to GPU 1 (node 0), whole cores" numa_local_whole_cores "$cpus_b" 0
check "$job_b: every thread SCHED_RR/10 on its CPUs" all_rr_on "$pid_b" 10 "$cpus_b"
check "the two jobs share no CPU" disjoint "$cpus_a" "$cpus_b"

phase "who may change jobs"
useradd --no-create-home --shell /usr/sbin/nologin e2e-user
useradd --no-create-home --shell /usr/sbin/nologin --groups lodger e2e-member
# The member's own process: lodgerd refuses a member another user's (docs/security.md).
pid_c=$(start_training train-c 0 -p User=e2e-member)
check "non-root user may list jobs" runuser -u e2e-user -- lodgerctl list
runuser -u e2e-user -- lodgerctl register training --pid "$pid_c" --cores 2 >"$share/nonroot.log" 2>&1
status=$?
check "non-root user refused by the system bus's policy (lodgerctl register, exit $status)" \
    sh -c "test $status = 1 && grep -q 'the bus refused the call' '$share/nonroot.log'"
note <"$share/nonroot.log"
check "non-root user refused (busctl UnregisterJob $job_a)" sh -c "! runuser -u e2e-user -- \
    busctl call org.lodger1 /org/lodger1 org.lodger1.Manager UnregisterJob s $job_a"
check "$job_a still registered" lodgerctl show "$job_a"
out_c=$(runuser -u e2e-member -- lodgerctl --json register training --pid "$pid_c" --cores 2 2>&1)
job_c=$(field "$out_c" id)
check "member of group lodger may register ($out_c)" test -n "$job_c"
check "member of group lodger may unregister $job_c" runuser -u e2e-member -- lodgerctl unregister "$job_c"
check "$job_c's threads back to SCHED_OTHER on every CPU" all_other_everywhere "$pid_c"
. "$share/trust.sh"

# A job registered by cgroup: lodgerd writes the unit's cpuset.cpus, which the service's
# ProtectSystem=strict + ProtectKernelTunables=yes would forbid but for ReadWritePaths=.
phase "a job registered by cgroup"
# AllowedCPUs= and AllowedMemoryNodes= make systemd enable the cpuset controller down to the
# unit, as a site that hands units to lodger would.
pid_d=$(start_training train-d 0 -p AllowedCPUs=0-15 -p AllowedMemoryNodes=0-1)
cg_d=$(cut -d: -f3 /proc/"$pid_d"/cgroup)
cpuset_d=$(cat /sys/fs/cgroup"$cg_d"/cpuset.cpus)
echo "$cg_d: cpuset.cpus '$cpuset_d' before" | note
out_d=$(lodgerctl --json register training --cgroup "$cg_d" --cores 2 2>&1)
job_d=$(field "$out_d" id)
cpus_d=$(field "$out_d" cpus)
check "register training --cgroup $cg_d ($out_d)" test -n "$job_d"
check_eq "$job_d: cpuset.cpus.effective of $cg_d is its CPUs" \
    "$(cat /sys/fs/cgroup"$cg_d"/cpuset.cpus.effective)" "$cpus_d"
check "$job_d: every thread SCHED_RR/10 on its CPUs" all_rr_on "$pid_d" 10 "$cpus_d"
check "unregister $job_d" lodgerctl unregister "$job_d"
check_eq "$job_d: cpuset.cpus of $cg_d restored" "$(cat /sys/fs/cgroup"$cg_d"/cpuset.cpus)" "$cpuset_d"
if [ "$(cat /sys/fs/cgroup"$cg_d"/cpuset.cpus)" != "$cpuset_d" ]; then
    journalctl -b -u lodgerd -o cat | grep -E "$job_d|train-d|cpuset|WARN|ERROR" | tail -n 20 | note
fi
check "$job_d: threads back to SCHED_OTHER on every CPU" all_other_everywhere "$pid_d"
# Without AllowedMemoryNodes= the unit's cpuset.mems is empty ("inherit"), and the kernel (before
# Linux 7.0) refuses to write that back into a populated cgroup (ENOSPC): lodger restores it as
# the whole node's nodes instead, which still follows the parent, and says so.
pid_e=$(start_training train-e 0 -p AllowedCPUs=0-15)
cg_e=$(cut -d: -f3 /proc/"$pid_e"/cgroup)
mems_e=$(cat /sys/fs/cgroup"$cg_e"/cpuset.mems)
echo "$cg_e: cpuset.mems '$mems_e' before (empty: inherited)" | note
out_e=$(lodgerctl --json register training --cgroup "$cg_e" --cores 2 2>&1)
job_e=$(field "$out_e" id)
check "register training --cgroup $cg_e with inherited mems ($out_e)" test -n "$job_e"
check "unregister $job_e: succeeds" lodgerctl unregister "$job_e"
check_eq "$job_e: cpuset.mems.effective of $cg_e follows its parent again" \
    "$(cat /sys/fs/cgroup"$cg_e"/cpuset.mems.effective)" \
    "$(cat /sys/fs/cgroup"$(dirname "$cg_e")"/cpuset.mems.effective)"
check "$job_e: lodgerd said how it restored the inherited value" sh -c \
    "journalctl -b -u lodgerd -o cat | grep -q 'cpuset.mems'"
journalctl -b -u lodgerd -o cat | grep "$job_e\|cpuset.mems" | tail -n 5 | note
systemctl stop train-e

phase "network shaping while a multi-node training job runs (cgroup v2, nftables)"
# Bytes HTB sent in class $1 on lt0.
class_bytes() { tc -s class show dev lt0 | awk -v c="$1" '$3 == c { f = 1 } f && $1 == "Sent" { print $2; exit }'; }
wait_for() { # seconds command...
    local i
    for ((i = 0; i < $1 * 5; i++)); do "${@:2}" && return 0; sleep 0.2; done
    return 1
}
htb_on_lt0() { tc qdisc show dev lt0 | grep -q 'htb 4c44:'; }
nothing_on_lt0() { ! htb_on_lt0 && ! nft list table inet lodger >/dev/null 2>&1; }
check "idle before any multi-node job: $(lodgerctl status | grep Network:)" \
    sh -c 'lodgerctl status | grep -q "Network: idle" && ! tc qdisc show dev lt0 | grep -q htb'
# A CPU job sending UDP out of lt0 from its instance, and one multi-node training job.
out_o=$(lodgerctl --json register offline --max-instances 1 -- \
    bash -c 'while true; do echo lodger > /dev/udp/10.99.0.2/9; sleep 0.05; done' 2>&1)
job_o=$(field "$out_o" id)
check "register offline: a UDP sender ($out_o)" test -n "$job_o"
pid_m=$(start_training train-m 0)
out_m=$(lodgerctl --json register training --pid "$pid_m" --cores 2 --multi-node --no-rightsize 2>&1)
job_m=$(field "$out_m" id)
check "register training --multi-node ($out_m)" test -n "$job_m"
check "HTB root on lt0 within 10 s" wait_for 10 htb_on_lt0
tc class show dev lt0 | note
nft list table inet lodger 2>&1 | note
check "status: $(lodgerctl status | grep Network:)" sh -c 'lodgerctl status | grep -q "Network: shaping lt0 (1000 Mbit/s): training 75%, CPU jobs 25%"'
check "$job_o: held to 25%" sh -c "lodgerctl show $job_o | grep -q 'Network: held to 25%'"
check "nftables matches the instances' cgroup2 directory" sh -c \
    'nft list table inet lodger | grep -q "socket cgroupv2 level"'
cpu_bytes() { [ "$(class_bytes 4c44:20)" -gt 0 ] 2>/dev/null; }
check "the CPU job's packets land in its class 4c44:20" wait_for 10 cpu_bytes
for _ in 1 2 3; do echo training > /dev/udp/10.99.0.2/9; done
train_bytes() { [ "$(class_bytes 4c44:10)" -gt 0 ] 2>/dev/null; }
check "other traffic (this script's) lands in training's class 4c44:10" wait_for 10 train_bytes
tc -s class show dev lt0 | note
check "unregister $job_m" lodgerctl unregister "$job_m"
check "no qdisc or nftables table of lodger's left once no multi-node job runs" wait_for 10 nothing_on_lt0
check "$job_o: no longer held" sh -c "! lodgerctl show $job_o | grep -q Network:"
check "unregister $job_o" lodgerctl unregister "$job_o"
systemctl stop train-m

phase "restart and upgrade keep the jobs"
# Issue 17: an inference instance (root's: a transient unit too) outlives restarts and upgrades,
# the same process, heard again through its report FIFO.
out_s=$(lodgerctl --json register offline --max-instances 1 -- /bin/sh -c \
    'while :; do echo "{{\"items\":1,\"latency_ms\":5}}" >&3; sleep 0.2; done' 2>&1)
job_s=$(field "$out_s" id)
check "register offline: a report loop ($out_s)" test -n "$job_s"
instance_pid() { lodgerctl --json show "$job_s" | grep -o '"pid":[0-9]*' | head -n 1 | cut -d: -f2; }
instance_runs() { [ -n "$(instance_pid)" ] && [ "$(instance_pid)" != 0 ]; }
instance_heard() { lodgerctl --json show "$job_s" | grep -q '"p50_ms"'; }
check "$job_s: its instance runs and reports within 60 s" poll_for 60 instance_heard
pid_s=$(instance_pid)
check "$job_s: its instance is a transient unit in lodger-instances.slice" \
    grep -q "/lodger-instances.slice/lodger-$job_s-0-" "/proc/$pid_s/cgroup"
check_eq "$job_s: the OOM killer takes its instance first (oom_score_adj)" \
    "$(cat /proc/"$pid_s"/oom_score_adj)" 1000
jobs_before=$(placements)
check "systemctl restart lodgerd" sh -c 'systemctl restart lodgerd && systemctl -q is-active lodgerd'
check_eq "after restart: same jobs on the same CPUs" "$(placements)" "$jobs_before"
check "after restart: $job_a threads still SCHED_RR/10 on $cpus_a" all_rr_on "$pid_a" 10 "$cpus_a"
check "after restart: $job_b threads still SCHED_RR/10 on $cpus_b" all_rr_on "$pid_b" 10 "$cpus_b"
check "after restart: $job_s's instance is listed within 30 s" poll_for 30 instance_runs
check_eq "after restart: $job_s's instance is the same process" "$(instance_pid)" "$pid_s"
check "after restart: $job_s's instance is heard again within 30 s" poll_for 30 instance_heard
if [ "$(instance_pid)" != "$pid_s" ]; then
    { systemctl list-units --all --no-legend 'lodger*'; journalctl -b -u lodgerd -o cat |
        grep -E "adopt|leftover|instance|$job_s" | tail -n 30; } 2>&1 | note
fi
echo "$jobs_before" | note

pid_before=$(systemctl show -p MainPID --value lodgerd)
upgrade=$(ls upgrade/lodger_*.deb)
check "upgrade: apt install ./$upgrade" \
    apt-get install -y -o Dpkg::Options::=--force-confold ./"$upgrade"
check "upgrade: lodgerd restarted" sh -c "systemctl -q is-active lodgerd && \
    test \"\$(systemctl show -p MainPID --value lodgerd)\" != $pid_before"
check "upgrade: still enabled" test "$(systemctl is-enabled lodgerd)" = enabled
check_eq "upgrade: same jobs on the same CPUs" "$(placements)" "$jobs_before"
check "upgrade: $job_a threads still SCHED_RR/10" all_rr_on "$pid_a" 10 "$cpus_a"
check "upgrade: $job_s's instance is listed within 30 s" poll_for 30 instance_runs
check_eq "upgrade: $job_s's instance is the same process" "$(instance_pid)" "$pid_s"
check "upgrade: $job_s's instance is heard again within 30 s" poll_for 30 instance_heard
check_eq "no watchdog or failure restarts (NRestarts=0)" "$(systemctl show -p NRestarts --value lodgerd)" 0
lodgerctl --json status 2>&1 | note

phase "lodgerd killed 10 times (kill -9): nothing lost, doubled or restarted"
# Issue 17's crash suite, short, under systemd: SIGKILL, systemd restarts lodgerd
# (Restart=on-failure, 2 s later), which re-adopts the jobs and the instance unit. reset-failed
# keeps systemd's start limit (5 in 10 s) out of the way.
# Churn between the kills: an offline job registered after every odd restart (its instance unit
# starting when the next kill comes), the newest one unregistered after every fourth: five
# registered, two unregistered, three left to check.
lodgerd_answers() { lodgerctl status >/dev/null 2>&1; }
kills_ok=0 churn=()
for i in 1 2 3 4 5 6 7 8 9 10; do
    systemctl kill -s SIGKILL lodgerd
    sleep 0.5
    if poll_for 30 lodgerd_answers; then kills_ok=$((kills_ok + 1)); fi
    systemctl reset-failed lodgerd 2>/dev/null || true
    if ((i % 2 == 1)); then
        out_c=$(lodgerctl --json register offline --max-instances 1 -- \
            /bin/sh -c 'while :; do sleep 1; done' 2>&1)
        id_c=$(field "$out_c" id)
        [ -z "$id_c" ] || churn+=("$id_c")
    elif ((i % 4 == 0)) && [ ${#churn[@]} -gt 0 ]; then
        lodgerctl unregister "${churn[-1]}" >/dev/null 2>&1 && unset 'churn[-1]'
    fi
done
check_eq "lodgerd answered after each of the 10 kills" "$kills_ok" 10
check_eq "churn: three offline jobs left registered" "${#churn[@]}" 3
check_eq "churn: the offline jobs left registered are listed" \
    "$(for j in "${churn[@]}"; do lodgerctl show "$j" >/dev/null 2>&1 && echo "$j"; done | xargs)" \
    "${churn[*]}"
for j in "${churn[@]}"; do lodgerctl unregister "$j" >/dev/null 2>&1; done
# An instance unit whose job is not registered is an orphan.
orphan_units() {
    local u j
    for u in $(systemctl list-units --no-legend --plain --state=running 'lodger-j*-*.service' |
        awk '{ print $1 }'); do
        j=${u#lodger-} j=${j%%-*}
        lodgerctl show "$j" >/dev/null 2>&1 || echo "$u"
    done
}
no_orphan_units() { [ -z "$(orphan_units)" ]; }
check "after the kills and churn: no instance unit of an unregistered job within 30 s" \
    poll_for 30 no_orphan_units
orphan_units | note
check "after the kills: $job_s's instance is listed within 30 s" poll_for 30 instance_runs
check_eq "after the kills: $job_s's instance is the same process" "$(instance_pid)" "$pid_s"
check_eq "after the kills: one unit runs for $job_s" \
    "$(systemctl list-units --no-legend --state=running "lodger-$job_s-*.service" | wc -l)" 1
check "after the kills: $job_s's instance is heard again within 30 s" poll_for 30 instance_heard
check_eq "after the kills: same jobs on the same CPUs" "$(placements)" "$jobs_before"
check "after the kills: $job_a threads still SCHED_RR/10 on $cpus_a" all_rr_on "$pid_a" 10 "$cpus_a"

phase "memory: instance limits (MemoryMax=), OOM kills inside them"
# Issue 19 under systemd: every instance unit gets MemoryMax= (inference.memory_max, 10% of
# MemTotal by default) and MemoryHigh= (90% of it); one past its limit is killed by the OOM
# killer inside its own unit, counted from lodger-instances.slice's memory.events, reported and
# restarted with back-off, and the instance beside it keeps running.
unit_s=$(sed -n 's|^0::.*/lodger-instances.slice/\(lodger-[^/]*\.service\).*|\1|p' "/proc/$pid_s/cgroup")
# As lodger computes it: MemTotal / 100 * 10, then each down to a whole 4 KiB page.
want_max=$(awk '/^MemTotal:/ { m = int($2 * 1024 / 100) * 10; printf "%d", m - m % 4096 }' /proc/meminfo)
check_eq "$job_s: its unit's MemoryMax= is 10% of MemTotal" \
    "$(systemctl show -p MemoryMax --value "$unit_s")" "$want_max"
check_eq "$job_s: its unit's MemoryHigh= is 90% of that" \
    "$(systemctl show -p MemoryHigh --value "$unit_s")" "$((want_max / 100 * 90 / 4096 * 4096))"
out_h=$(lodgerctl --json register offline --max-instances 1 --memory-max 32M -- \
    /usr/bin/tail /dev/zero 2>&1)
job_h=$(field "$out_h" id)
check "register offline --memory-max 32M: a leak (tail /dev/zero) ($out_h)" test -n "$job_h"
oom_killed() { lodgerctl --json show "$job_h" | grep -q '"oom_kills":[1-9]'; }
check "$job_h: OOM-killed inside its 32 MiB within 120 s" poll_for 120 oom_killed
check "$job_h: show says so" sh -c "lodgerctl show $job_h | grep -q 'Memory: 32 MiB per instance, [1-9] OOM kill'"
check "$job_h: the log names the OOM killer" sh -c \
    "journalctl -b -u lodgerd -o cat | grep -q 'killed by the OOM killer, memory limit 32 MiB'"
lodgerctl show "$job_h" 2>&1 | note
check_eq "$job_s: its instance lived through it" "$(instance_pid)" "$pid_s"
check "unregister $job_h" lodgerctl unregister "$job_h"

phase "purge leaves nothing behind"
# train-c runs as e2e-member: userdel refuses a user with a running process.
systemctl stop train-c
check "test users removed" sh -c 'userdel e2e-user && userdel e2e-member'
check "apt purge lodger" apt-get purge -y lodger
check "purge: no lodgerd process" sh -c '! pidof lodgerd'
check "purge: no lodgerd unit" sh -c '! systemctl cat lodgerd.service && \
    test -z "$(ls /etc/systemd/system/*.wants/lodgerd.service 2>/dev/null)"'
check "purge: no lodger cgroup" lodger_cgroups
check "purge: no real-time user thread on the node" no_rt_user_threads
check "purge: $job_a back to SCHED_OTHER on every CPU" all_other_everywhere "$pid_a"
check "purge: $job_b back to SCHED_OTHER on every CPU" all_other_everywhere "$pid_b"
check "purge: the training processes still run" kill -0 "$pid_a" "$pid_b"
check "purge: $job_s's instance stopped (drained)" sh -c "! kill -0 $pid_s 2>/dev/null"
# Instance units are lodger-<job>-<index>-...: not lodger-e2e.service, this suite's own unit.
check "purge: no lodger instance unit" \
    sh -c '! systemctl list-units --all --no-legend "lodger-j*-*.service" | grep -q .'
check "purge: no /var/lib/lodger, /etc/lodger, group lodger, D-Bus policy" sh -c \
    '! test -e /var/lib/lodger && ! test -e /etc/lodger && ! getent group lodger && \
     ! test -e /usr/share/dbus-1/system.d/org.lodger1.conf'
check "purge: dpkg knows no lodger" sh -c '! dpkg-query -W -f="\${Status}" lodger 2>/dev/null | grep -q installed'

finish
