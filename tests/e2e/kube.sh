#!/bin/bash
# The Kubernetes phase of the e2e suite (run-vm.sh --kubernetes), inside a Debian 13 guest:
# containerd 1.7 from Debian with NRI enabled, lodgerd installed from the package with
# `[kubernetes] nri = true`, and pods and containers created through the CRI as kubelet would
# (cri.py: Debian ships no kubelet or crictl; host networking, so no CNI). Images are built here
# from the guest's own binaries and imported with `ctr images import`: no registry is reachable.
# Checks that an annotated training container's threads run SCHED_RR on a consolidated cpuset,
# that an unannotated one is untouched, that removing the pod unregisters its job, and that
# lodgerd joins containerd again after containerd restarts.
. "$(dirname "$0")/lib.sh"
cri() { python3 "$share/cri.py" "$@"; }
log_since() { journalctl -u lodgerd -o cat --since "@$1" 2>/dev/null; }
# check_got name value: passes when cri.py printed something; else notes its error.
check_got() {
    if [ -n "$2" ]; then pass "$1 ($2)"; else
        fail "$1"
        tail -n 4 "$share/cri.err" | note
    fi
}
# start_pod POD CTR [KEY=VALUE annotation...]: RunPodSandbox POD (namespace e2e, cgroup parent
# /kubepods/pod-POD), CreateContainer CTR in it running the training emulator, StartContainer, as
# kubelet does, with a check each; sets pod_id and ctr_id.
start_pod() {
    local name=$1 ctr=$2 parent=/kubepods/pod-$1
    shift 2
    pod_id=$(cri run-pod "$name" "uid-$name" "$parent" "$@" 2>"$share/cri.err")
    check_got "RunPodSandbox $name" "$pod_id"
    ctr_id=$(cri create "$pod_id" "$name" "uid-$name" "$parent" "$ctr" docker.io/library/train:local -- \
        /bin/train_emulator --workers 3 --gpu-step-ms 20 2>"$share/cri.err")
    check_got "CreateContainer $ctr" "$ctr_id"
    check "StartContainer $ctr" cri start "$ctr_id"
}
wait_for() { # seconds command...: until command succeeds
    local end=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do [ $SECONDS -lt $end ] || return 1; sleep 0.5; done
}

phase "containerd with NRI"
containerd --version 2>&1 | note
mkdir -p /etc/containerd
cat >/etc/containerd/config.toml <<'TOML'
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/library/pause:local"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = "/var/run/nri/nri.sock"
TOML
check "containerd restarted with NRI enabled" systemctl restart containerd
check "the NRI socket is there" wait_for 30 test -S /var/run/nri/nri.sock
check "the CRI answers (Version)" cri version
cri version 2>&1 | note

phase "images from the guest's own binaries"
rootfs=$(mktemp -d)
mkdir -p "$rootfs/bin" "$rootfs/lib64" "$rootfs/lib/x86_64-linux-gnu" "$rootfs/tmp"
cp /usr/bin/busybox "$rootfs/bin/busybox"
for app in sh sleep; do ln -s busybox "$rootfs/bin/$app"; done
check "pause image imported" sh -c "python3 $share/cri.py image docker.io/library/pause:local \
    $rootfs /tmp/pause.tar /bin/busybox sleep 2147483647 && \
    ctr -n k8s.io images import /tmp/pause.tar"
cp "$share/train_emulator" "$rootfs/bin/"
for lib in $(ldd "$share/train_emulator" | grep -o '/[^ ]*'); do cp -L "$lib" "$rootfs$lib"; done
check "workload image imported" sh -c "python3 $share/cri.py image docker.io/library/train:local \
    $rootfs /tmp/train.tar /bin/train_emulator --workers 3 --gpu-step-ms 20 && \
    ctr -n k8s.io images import /tmp/train.tar"
ctr -n k8s.io images ls -q 2>&1 | note

phase "lodgerd as an NRI plugin"
since=$(date +%s)
check "install the package" apt-get install -y -qq "$share"/lodger_*.deb
sed -i 's/^nri = false$/nri = true/' /etc/lodger/lodger.toml
check "[kubernetes] nri = true in /etc/lodger/lodger.toml" grep -qx 'nri = true' /etc/lodger/lodger.toml
check "lodgerd --check-config" lodgerd --check-config
check "systemctl enable --now lodgerd" systemctl enable --now lodgerd
check "lodgerd registered with containerd" wait_for 30 sh -c \
    "journalctl -u lodgerd -o cat --since @$since | grep -q 'NRI: registered with the runtime'"
check "configured by containerd 1.7 (lodger's sweep sets the class)" sh -c \
    "journalctl -u lodgerd -o cat --since @$since | grep 'NRI: configured by containerd' | grep -q sweep"
log_since "$since" | grep NRI | note

phase "an annotated training pod and an unannotated one"
start_pod web-0 app
plain=$pod_id plain_ctr=$ctr_id
start_pod trainer-0 main lodger.dev/kind=training lodger.dev/cores=2
pod=$pod_id train_ctr=$ctr_id
job_json() { lodgerctl --json list | tr '}' '\n' | grep '"name":"e2e/trainer-0/main"'; }
check "lodgerctl list: e2e/trainer-0/main" wait_for 20 job_json
json=$(job_json)
echo "$json" | note
job=$(field "$json" id)
cpus=$(field "$json" cpus)
check_eq "$job: 2 CPUs" "$(expand "$cpus" | wc -w)" 2
check_eq "$job: the container's cgroup is on its CPUs" \
    "$(cat /sys/fs/cgroup/kubepods/pod-trainer-0/"$ctr_id"/cpuset.cpus.effective 2>&1)" "$cpus"
pid=$(cat /sys/fs/cgroup/kubepods/pod-trainer-0/"$ctr_id"/cgroup.procs | head -n 1)
check "$job: containerd created the container on them (NRI adjustment in its OCI spec)" sh -c \
    "ctr -n k8s.io containers info $ctr_id | grep -q '\"cpus\": \"$cpus\"'"
check "$job: every thread SCHED_RR/10 on its CPUs" wait_for 20 all_rr_on "$pid" 10 "$cpus"
all_rr_on "$pid" 10 "$cpus" 2>&1 | note
lodgerctl show "$job" 2>&1 | note
plain_pid=$(cat /sys/fs/cgroup/kubepods/pod-web-0/"$plain_ctr"/cgroup.procs | head -n 1)
check "the unannotated container's threads stay SCHED_OTHER" sh -c \
    "for t in /proc/$plain_pid/task/*; do awk '{ exit \$41 != 0 }' \"\$t/stat\" || exit 1; done"
check_eq "the unannotated container has no job" "$(lodgerctl --json list | grep -c web-0)" 0

phase "an online inference pod: its own instance, on leftover CPUs of its own"
start_pod serve-0 server lodger.dev/kind=online lodger.dev/cores=1
serve=$pod_id serve_ctr=$ctr_id ctr_id=$train_ctr
serve_json() { lodgerctl --json list | tr '}' '\n' | grep '"name":"e2e/serve-0/server"'; }
check "lodgerctl list: e2e/serve-0/server, running" wait_for 20 sh -c \
    "lodgerctl --json list | tr '}' '\\n' | grep '\"name\":\"e2e/serve-0/server\"' | grep -q '\"state\":\"running\"'"
serve_cpus=$(field "$(serve_json)" cpus)
check_eq "its cgroup is on its one CPU" \
    "$(cat /sys/fs/cgroup/kubepods/pod-serve-0/"$serve_ctr"/cpuset.cpus.effective 2>&1)" "$serve_cpus"
check "its CPU is not training's ($serve_cpus vs $cpus)" disjoint "$serve_cpus" "$cpus"
check "an online container's threads stay SCHED_OTHER" sh -c \
    "pid=\$(head -n 1 /sys/fs/cgroup/kubepods/pod-serve-0/$serve_ctr/cgroup.procs); \
     for t in /proc/\$pid/task/*; do awk '{ exit \$41 != 0 }' \"\$t/stat\" || exit 1; done"

phase "containerd restarts"
since=$(date +%s)
check "systemctl restart containerd" systemctl restart containerd
check "lodgerd joins containerd again" wait_for 60 sh -c \
    "journalctl -u lodgerd -o cat --since @$since | grep -q 'NRI: registered with the runtime'"
check "the running container keeps its job" job_json
log_since "$since" | grep NRI | note

phase "the pod removed"
cri stop "$ctr_id" >/dev/null 2>&1
check "StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox" sh -c \
    "python3 $share/cri.py remove $ctr_id && python3 $share/cri.py stop-pod $pod && \
     python3 $share/cri.py remove-pod $pod"
check "$job unregistered" wait_for 20 sh -c "! lodgerctl show $job"
for c in "$serve_ctr" "$plain_ctr"; do cri stop "$c" >/dev/null 2>&1; cri remove "$c" >/dev/null 2>&1; done
cri stop-pod "$serve" >/dev/null 2>&1
cri remove-pod "$serve" >/dev/null 2>&1
cri stop "$plain_ctr" >/dev/null 2>&1
cri remove "$plain_ctr" >/dev/null 2>&1
cri stop-pod "$plain" >/dev/null 2>&1
cri remove-pod "$plain" >/dev/null 2>&1
journalctl -u lodgerd -o cat | grep -E "WARN|ERROR" | tail -n 10 | note
finish
