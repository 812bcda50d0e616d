#!/bin/bash
# The root cargo tests inside the e2e VM (run by the guest's lodger-e2e.service as root, when
# the host ran `tests/e2e/run-vm.sh --cargo-tests`; run-vm.sh shares this script as guest.sh).
#
# The host built the test binaries (`cargo test --no-run`); they embed absolute paths
# (CARGO_MANIFEST_DIR, CARGO_BIN_EXE_*), so the checkout, the target directory and the fixtures
# are mounted read-only at the host's paths (9p tags and paths in /mnt/e2e/mounts). Skip logs go
# to /mnt/e2e/skips (LODGER_SKIP_DIR), temporary files to the guest's /tmp.
#
# /mnt/e2e/tests lists the binaries, `LABEL<TAB>EXECUTABLE<TAB>TEST THREADS<TAB>ARGS` per line,
# LABEL as cargo's `Running` line names it, ARGS more libtest arguments (a filter, --skip). Each
# runs from the checkout, as `cargo test` runs it, with its output in cargo's form appended to
# /mnt/e2e/results.txt; then scripts/test-summary reads that log and the skip logs and appends
# the summary (`host: ...` with this guest's shape, then `suite: N passed, F failed,
# S skipped`). Doc-tests are not run here: rustdoc compiles them at
# run time. The VM powers off when this script exits.
set -u
share=/mnt/e2e
out=$share/results.txt
: >"$out"
touch "$share/booted"
say() { echo "$*" | tee -a "$out" >/dev/null; }

say "guest up: $(cut -d' ' -f1 /proc/uptime) s since the kernel started;" \
    "$(nproc) CPUs, $(stat -fc %T /sys/fs/cgroup), kernel $(uname -r)"
mounted=1
while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "$path"
    if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro,cache=loose "$tag" "$path" \
        >>"$out" 2>&1; then
        say "mount of $tag at $path failed"
        mounted=0
    fi
done <"$share/mounts"
repo=$(cat "$share/repo")
export HOME=/root LODGER_SKIP_DIR=$share/skips RUST_BACKTRACE=1
mkdir -p "$LODGER_SKIP_DIR"
# The host's LODGER_* settings (fixtures, which skips must fail).
# shellcheck disable=SC1091
. "$share/env"

if [ "$mounted" = 1 ]; then
    cd "$repo" || exit 1
    start=$SECONDS
    while IFS=$'\t' read -r label exe threads args; do
        [ -n "$label" ] || continue
        t=$SECONDS
        say "     Running $label ($exe)"
        [ -z "$args" ] || say "     (here with: $args; the rest of it ran on the host)"
        # A binary that hangs is stopped: it then has no `test result:` line, which the summary
        # counts as a failure.
        # shellcheck disable=SC2086 # ARGS: libtest arguments, split at spaces
        timeout --kill-after=10 "${LODGER_E2E_TEST_TIMEOUT:-900}" \
            "$exe" --test-threads="$threads" $args </dev/null >>"$out" 2>&1
        status=$?
        [ "$status" != 124 ] || say "$label: stopped after ${LODGER_E2E_TEST_TIMEOUT:-900} s"
        say "($label: $((SECONDS - t)) s, exit $status)"
    done <"$share/tests"
    say "(all test binaries: $((SECONDS - start)) s)"
fi
python3 "$repo/scripts/test-summary" --from-log "$out" --skip-dir "$LODGER_SKIP_DIR" \
    >"$share/summary.txt" 2>&1
echo $? >"$share/summary.status"
cat "$share/summary.txt" >>"$out"
sync
exit 0
