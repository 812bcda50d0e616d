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
# A member's inference instance: started by systemd as a transient unit (lodgerd's unit keeps
# its hardening: no CAP_SETUID, ProtectHome=yes), it runs as the member, in the member's home
# (hidden from lodgerd itself), in lodger-instances.slice, and its reports reach lodgerd through
# descriptor 3. `{{`/`}}` are literal braces in a command template.
poll_for() { # seconds command...
    local i
    for ((i = 0; i < $1 * 5; i++)); do "${@:2}" && return 0; sleep 0.2; done
    return 1
}
member_home=/home/e2e-member
install -d -o e2e-member -g "$(id -g e2e-member)" -m 0700 "$member_home"
out_i=$(runuser -u e2e-member -- lodgerctl --json register offline --max-instances 1 \
    --cwd "$member_home" -- /bin/sh -c '{{ id -u; id -g; pwd; grep NoNewPrivs /proc/self/status;
        cat /proc/self/cgroup; }} >ids.tmp && mv ids.tmp ids
        while :; do echo "{{\"items\":1,\"latency_ms\":5}}" >&3; sleep 0.2; done' 2>&1)
job_i=$(field "$out_i" id)
check "member's inference job registered ($out_i)" test -n "$job_i"
check "member's instance started within 120 s" poll_for 120 test -s "$member_home/ids"
ids=$(cat "$member_home/ids" 2>/dev/null)
echo "$ids" | note
check_eq "member's instance runs as the member (uid)" "$(sed -n 1p <<<"$ids")" "$(id -u e2e-member)"
check_eq "member's instance runs in the member's group (gid)" "$(sed -n 2p <<<"$ids")" "$(id -g e2e-member)"
check_eq "member's instance runs in the member's home" "$(sed -n 3p <<<"$ids")" "$member_home"
check "member's instance has no new privileges" grep -q "NoNewPrivs:.*1" <<<"$ids"
check "member's instance runs in lodger-instances.slice" grep -q "/lodger-instances.slice/lodger-" <<<"$ids"
has_reports() { lodgerctl --json show "$job_i" | grep -q '"p50_ms"'; }
check "member's instance's reports reach lodgerd (descriptor 3)" poll_for 60 has_reports
check "lodgerd's unit has no CAP_SETUID/CAP_SETGID" \
    sh -c '! systemctl show -p CapabilityBoundingSet --value lodgerd | grep -qi "cap_set[ug]id"'
check_eq "lodgerd's unit keeps ProtectHome=yes" "$(systemctl show -p ProtectHome --value lodgerd)" yes
check "member may unregister $job_i" runuser -u e2e-member -- lodgerctl unregister "$job_i"
# The instance's units are lodger-<job>-<index>-<pid>-<n>.service (not lodger-e2e.service, this
# suite's own unit).
instance_gone() { ! pgrep -u e2e-member -f latency_ms >/dev/null && \
    ! systemctl list-units --all --no-legend "lodger-$job_i-*.service" | grep -q .; }
check "member's instance and its unit gone within 60 s" poll_for 60 instance_gone
if ! instance_gone; then
    { systemctl list-units --all --no-legend 'lodger*'; pgrep -a -u e2e-member;
      journalctl -b -u lodgerd -o cat | grep -E "$job_i|unit|instance|WARN|ERROR" | tail -n 30; } 2>&1 | note
fi
check "every user may read (lodgerctl top --once)" runuser -u e2e-user -- lodgerctl top --once
check "the refusals registered nothing" sh -c "! lodgerctl --json list | grep -q '\"pids\":\[1\]'"
