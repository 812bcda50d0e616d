# lodger %preun ($1: 0 on erase, 1 on upgrade): %systemd_preun written out, preceded by a drain
# (every job released, every inference instance stopped). A stopped lodgerd leaves its jobs pinned
# and SCHED_RR and its instances running on purpose (an upgrade must not disturb training or
# serving), so erasing the package has to undo them first.
if [ "$1" -eq 0 ]; then
    if [ -d /run/systemd/system ]; then
        # Jobs left by a lodgerd that is not running: start it to re-adopt and release them.
        if ! systemctl --quiet is-active lodgerd.service && [ -s /var/lib/lodger/state.json ]; then
            systemctl start lodgerd.service || :
        fi
        if systemctl --quiet is-active lodgerd.service; then
            lodgerctl drain >/dev/null ||
                echo "lodger: could not release every job; see 'journalctl -u lodgerd'" >&2
        fi
    fi
    systemctl --no-reload disable --now lodgerd.service >/dev/null 2>&1 || :
    # lodger's own parent cgroups, if empty (rmdir removes nothing else).
    parent=$(sed -n '/^\[cgroup\]/,/^\[/s/^[[:space:]]*parent[[:space:]]*=[[:space:]]*"\([^"/]*\)".*/\1/p' \
        /etc/lodger/lodger.toml 2>/dev/null | head -n 1)
    for dir in /sys/fs/cgroup/"${parent:-lodger}" /sys/fs/cgroup/*/"${parent:-lodger}"; do
        [ -d "$dir" ] && rmdir "$dir" 2>/dev/null || :
    done
fi
