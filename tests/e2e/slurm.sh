# A real Slurm on the packaged install (issue 18, docs/slurm.md): Debian's slurmctld + slurmd on
# this one node, two GPUs declared in gres.conf over device nodes made with mknod (major 195),
# Prolog/Epilog the installed lodger wrappers. Shows: a GPU job becomes a training job of its
# user, every thread SCHED_RR inside Slurm's cpuset; a CPU-only job becomes a batch job beside
# it; scancel unregisters both and leaves nothing; with lodgerd stopped jobs still start, the
# prolog returns at once and the node is not drained. Sourced by guest.sh after "start", before
# any other job (Slurm does not know lodger's own placements); uses its helpers.
phase "Slurm: prolog and epilog registering every job"
spoll() { # seconds command...: until it succeeds or the seconds have passed
    local end=$((SECONDS + $1))
    while ((SECONDS < end)); do "${@:2}" && return 0; sleep 0.5; done
    return 1
}
mknod -m 666 /dev/nvidia0 c 195 0
mknod -m 666 /dev/nvidia1 c 195 1
cp "$share/membw_hog" /usr/local/bin/
useradd --create-home --shell /bin/bash e2e-alice
node=$(hostname -s)
# The guest has no network: Slurm's daemons find each other through /etc/hosts.
grep -qw "$node" /etc/hosts || echo "127.0.1.1 $node" >>/etc/hosts
# slurmd's own view of the node (CPUs, sockets, cores, threads, memory), less some memory.
hw=$(slurmd -C | head -n 1 | sed 's/RealMemory=\([0-9]*\)/RealMemory=1024/')
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=e2e
SlurmctldHost=$node(127.0.1.1)
AuthType=auth/munge
SlurmUser=slurm
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
Prolog=/usr/libexec/lodger/slurm-prolog
Epilog=/usr/libexec/lodger/slurm-epilog
PrologFlags=Contain
ReturnToService=2
# lodger's reserved CPUs (node.reserved_cpus = "auto": CPU 0 and its sibling) are Slurm's too.
$hw NodeAddr=127.0.1.1 Gres=gpu:2 CpuSpecList=0-1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
cat >/etc/slurm/cgroup.conf <<'EOF'
CgroupPlugin=autodetect
ConstrainCores=yes
EOF
echo "Name=gpu File=/dev/nvidia[0-1]" >/etc/slurm/gres.conf
grep -v '^#' /etc/slurm/slurm.conf | note
mkdir -p /var/log/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
chown slurm: /var/log/slurm /var/lib/slurm/slurmctld
check "munge, slurmctld and slurmd started" sh -c \
    'systemctl restart munge && systemctl start slurmctld slurmd && systemctl -q is-active slurmctld slurmd'
node_idle() { timeout 10 sinfo -h -n "$node" -o %T | grep -qx idle; }
check "sinfo: $node idle within 60 s" spoll 60 node_idle
timeout 10 sinfo -N -l 2>&1 | note
slurm_logs() { tail -n 15 /var/log/slurm/slurmd.log /var/log/slurm/slurmctld.log 2>&1 | note; }
node_idle || slurm_logs

# A GPU job of e2e-alice's: the training emulator on 4 CPUs and one GPU.
submit() { # sbatch arguments...: prints the job id
    timeout 30 runuser -u e2e-alice -- sbatch --parsable --output=/dev/null "$@"
}
slurm_job() { # slurm id: the lodger job registered for it, as one line of JSON (fails if none)
    lodgerctl --json list | python3 -c '
import json, sys
hits = [j for j in json.load(sys.stdin) if j.get("slurm_job") == int(sys.argv[1])]
print(json.dumps(hits[0], separators=(",", ":"), sort_keys=True)) if hits else sys.exit(1)' "$1"
}
sj_gpu=$(submit --gres=gpu:1 -c 4 --wrap \
    'exec /usr/local/bin/train_emulator --workers 3 --batch-cpu-ms 1 --gpu-step-ms 50')
check "sbatch --gres=gpu:1 -c 4 (the training emulator): job $sj_gpu" test -n "$sj_gpu"
gpu_running() { slurm_job "$sj_gpu" | grep -q '"state":"running"'; }
check "Slurm job $sj_gpu registered as a running training job within 60 s" spoll 60 gpu_running
gpu_running || { slurm_logs; lodgerctl list 2>&1 | note; journalctl -b -t lodgerctl -o cat | tail -n 5 | note; }
js=$(slurm_job "$sj_gpu")
echo "$js" | note
check_eq "Slurm job $sj_gpu: kind" "$(field "$js" kind)" training
check "Slurm job $sj_gpu: owned by e2e-alice (uid $(id -u e2e-alice))" \
    grep -q "\"owner_uid\":$(id -u e2e-alice)[,}]" <<<"$js"
check_eq "Slurm job $sj_gpu: named slurm-$sj_gpu" "$(field "$js" name)" "slurm-$sj_gpu"
scg=$(find /sys/fs/cgroup/system.slice -maxdepth 2 -type d -name "job_$sj_gpu" | head -n 1)
echo "Slurm's cgroup: $scg, cpuset $(cat "$scg"/cpuset.cpus.effective 2>&1)" | note
check "Slurm job $sj_gpu: its cgroup is Debian's layout (<node>_slurmstepd.scope)" \
    test "$scg" = "/sys/fs/cgroup/system.slice/${node}_slurmstepd.scope/job_$sj_gpu"
slurm_cpus=$(cat "$scg"/cpuset.cpus.effective 2>/dev/null)
cpus_t=$(field "$js" cpus)
check "Slurm job $sj_gpu: lodger's CPUs $cpus_t inside Slurm's cpuset $slurm_cpus" sh -c \
    "test -n '$cpus_t' && for c in $(expand "$cpus_t"); do case ' $(expand "$slurm_cpus") ' in *\" \$c \"*) ;; *) exit 1;; esac; done"
pid_t=$(pgrep -u e2e-alice -f train_emulator | head -n 1)
check "Slurm job $sj_gpu: every thread of the emulator (pid $pid_t) SCHED_RR/10 on $cpus_t" \
    all_rr_on "$pid_t" 10 "$cpus_t"
check "Slurm job $sj_gpu: Slurm's own slurmstepd left SCHED_OTHER" sh -c \
    "! ps -eLo cls=,comm= | awk '\$2 == \"slurmstepd\" && \$1 != \"TS\"' | grep -q ."
check "Slurm job $sj_gpu: Slurm's cpuset.cpus untouched by lodger" \
    test "$(cat "$scg"/cpuset.cpus.effective)" = "$slurm_cpus"

# A CPU-only job: the memory-bandwidth hog, registered as batch beside training.
sj_cpu=$(submit -c 2 --wrap 'exec /usr/local/bin/membw_hog --mib 64')
check "sbatch -c 2 (the memory-bandwidth hog): job $sj_cpu" test -n "$sj_cpu"
cpu_running() { slurm_job "$sj_cpu" | grep -q '"state":"running"'; }
check "Slurm job $sj_cpu registered as a running batch job within 60 s" spoll 60 cpu_running
jb=$(slurm_job "$sj_cpu")
echo "$jb" | note
check_eq "Slurm job $sj_cpu: kind" "$(field "$jb" kind)" batch
check "Slurm job $sj_cpu: its CPUs $(field "$jb" cpus) are not training's" \
    disjoint "$(field "$jb" cpus)" "$cpus_t"
lodgerctl list | note

check "scancel both" timeout 30 scancel "$sj_gpu" "$sj_cpu"
both_gone() { ! slurm_job "$sj_gpu" >/dev/null && ! slurm_job "$sj_cpu" >/dev/null; }
check "scancel: both unregistered within 60 s" spoll 60 both_gone
check "scancel: no real-time user thread left" no_rt_user_threads
lodgerctl list | note

# lodgerd stopped: jobs still start, the prolog gives up at once, the node is not drained.
systemctl stop lodgerd
t0=$(date +%s)
sj_off=$(submit -c 2 --wrap 'sleep 2')
job_ran() { timeout 10 scontrol show job "$sj_off" 2>/dev/null | grep -q 'JobState=COMPLETED'; }
check "with lodgerd stopped: Slurm job $sj_off ran to its end within 60 s" spoll 60 job_ran
echo "submitted to done: $(($(date +%s) - t0)) s" | note
check "with lodgerd stopped: the node is not drained ($(timeout 10 sinfo -h -n "$node" -o %T))" \
    sh -c "timeout 10 sinfo -h -n '$node' -o %T | grep -qx idle"
check "with lodgerd stopped: the prolog logged why it did nothing" sh -c \
    "journalctl -b -t lodgerctl -o cat | grep 'job $sj_off: nothing done'"
journalctl -b -t lodgerctl -o cat | tail -n 6 | note
check "lodgerd started again" sh -c 'systemctl start lodgerd && systemctl -q is-active lodgerd'
# Slurm is left idle (and stopped): the checks after this place jobs Slurm knows nothing of.
systemctl stop slurmd slurmctld
