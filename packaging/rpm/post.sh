# lodger %post ($1: 1 on first install, 2 or more on upgrade). cargo-generate-rpm has no macros,
# so %systemd_post is written out: on first install the unit is preset, which enables it through
# /usr/lib/systemd/system-preset/50-lodger.preset (an admin's preset in /etc wins) without
# starting it: declare GPUs and reserved CPUs in /etc/lodger/lodger.toml first.
if command -v systemd-sysusers >/dev/null 2>&1; then
    systemd-sysusers lodger.conf || :
elif ! getent group lodger >/dev/null; then
    groupadd -r lodger || :
fi
if [ "$1" -eq 1 ]; then
    systemctl --no-reload preset lodgerd.service >/dev/null 2>&1 || :
fi
