# The trust boundary on the packaged install (docs/security.md): the installed D-Bus policy and
# lodgerd refuse a member's registration of pid 1, a kernel thread or a system service's cgroup,
# refuse pid 1 to root too, and let every user read `lodgerctl top`. Sourced by guest.sh after
# "who may change jobs" (the users e2e-user and e2e-member exist); uses its helpers.
phase "trust boundary: what a member may name"
# refused_with USER TEXT ARGS...: lodgerctl ARGS as USER (or root) exits 1 saying TEXT.
refused_with() {
    local user=$1 want=$2 out status
    shift 2
    if [ "$user" = root ]; then
        out=$(lodgerctl "$@" 2>&1)
    else
        out=$(runuser -u "$user" -- lodgerctl "$@" 2>&1)
    fi
    status=$?
    echo "exit $status: $out"
    [ "$status" = 1 ] && grep -qF -- "$want" <<<"$out"
}
check "member refused pid 1" \
    refused_with e2e-member "process 1 is the init process" register training --pid 1 --cores 1
check "root refused pid 1 too" \
    refused_with root "process 1 is the init process" register training --pid 1 --cores 1
check "member refused a kernel thread (kthreadd, pid 2)" \
    refused_with e2e-member "process 2 is a kernel thread" register training --pid 2 --cores 1
check "member refused /system.slice/systemd-journald.service" \
    refused_with e2e-member "is a system service's cgroup" \
    register training --cgroup /system.slice/systemd-journald.service --cores 1
# The packaged unit's bounding set has no CAP_SETUID: until instances start as transient units,
# a member's inference job is refused with that reason rather than run as root.
check "member's inference job refused: lodgerd cannot switch to the member (CAP_SETUID)" \
    refused_with e2e-member "CAP_SETUID" register offline --max-instances 1 -- /bin/sleep 600
check "every user may read (lodgerctl top --once)" runuser -u e2e-user -- lodgerctl top --once
check "the refusals registered nothing" sh -c "! lodgerctl --json list | grep -q '\"pids\":\[1\]'"
