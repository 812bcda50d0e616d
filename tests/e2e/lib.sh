# The guest scripts' shared part (sourced by guest.sh and kube.sh): results, checks, phases,
# and the helpers that read threads' scheduling from /proc.
set -u
share=/mnt/e2e
out=$share/results.txt
: >"$out"
touch "$share/booted"
export DEBIAN_FRONTEND=noninteractive

passed=0 failed=0
pass() { echo "PASS $*" | tee -a "$out"; passed=$((passed + 1)); }
fail() { echo "FAIL $*" | tee -a "$out"; failed=$((failed + 1)); }
note() { sed 's/^/     /' | tee -a "$out"; }
check() { # name command...
    local name=$1
    shift
    if "$@" >"$share/last.log" 2>&1; then pass "$name"; else
        fail "$name"
        tail -n 15 "$share/last.log" | note
    fi
}
# check_eq name actual expected: says both when they differ.
check_eq() {
    if [ "$2" = "$3" ]; then pass "$1"; else
        fail "$1"
        echo "got '$2', want '$3'" | note
    fi
}
# Marks the start of a phase, with the time the previous one took.
phase_name="" phase_start=$SECONDS
phase() {
    [ -z "$phase_name" ] || echo "($phase_name: $((SECONDS - phase_start)) s)" | note
    echo "-- $1" | tee -a "$out"
    phase_name=$1 phase_start=$SECONDS
}
finish() {
    phase_name=${phase_name:-?}
    echo "($phase_name: $((SECONDS - phase_start)) s; checks took $SECONDS s in all)" | note
    echo "$passed passed, $failed failed" | tee -a "$out"
    sync
    exit 0
}

# --- helpers ---
# "2-5,8" -> "2 3 4 5 8"
expand() {
    local part out=() a b i
    IFS=, read -ra parts <<<"$1"
    for part in "${parts[@]}"; do
        [ -n "$part" ] || continue
        a=${part%-*} b=${part#*-}
        for ((i = a; i <= b; i++)); do out+=("$i"); done
    done
    echo "${out[@]}"
}
# A string field of lodgerctl's one-line JSON.
field() { sed -n "s/.*\"$2\":\"\\([^\"]*\\)\".*/\\1/p" <<<"$1"; }
# "policy rt_priority" of a thread, from /proc/PID/task/TID/stat (fields 41 and 40).
sched_of() {
    local stat
    stat=$(cat "$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    echo "${39} ${38}"
}
# Every thread of $1 is SCHED_RR (policy 2) at priority $2 (or $2 + 1: with training.role_priorities,
# threads that mostly wait run one above the busy ones) and allowed exactly CPUs $3.
all_rr_on() {
    local pid=$1 prio=$2 cpus=$3 t n=0
    for t in /proc/"$pid"/task/*; do
        n=$((n + 1))
        case "$(sched_of "$t")" in
            "2 $prio" | "2 $((prio + 1))") ;;
            *) echo "thread ${t##*/}: policy/prio $(sched_of "$t")"; return 1 ;;
        esac
        grep -q "^Cpus_allowed_list:[[:space:]]*$cpus\$" "$t/status" ||
            { echo "thread ${t##*/}: $(grep Cpus_allowed_list "$t/status")"; return 1; }
    done
    echo "$n threads SCHED_RR/$prio on $cpus"
    [ "$n" -ge 4 ]
}
# CPU lists $1 and $2 share no CPU.
disjoint() {
    local c
    for c in $(expand "$1"); do [[ " $(expand "$2") " != *" $c "* ]] || return 1; done
}
