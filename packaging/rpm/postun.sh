# lodger %postun ($1: 0 on erase, 1 on upgrade): %systemd_postun_with_restart written out (the
# upgraded lodgerd is restarted if it was running; it re-adopts its jobs), and on erase what
# Debian's purge removes: lodger's state, and the `lodger` group unless an admin put users in it.
# A modified /etc/lodger/lodger.toml is kept by rpm as lodger.toml.rpmsave.
systemctl daemon-reload >/dev/null 2>&1 || :
if [ "$1" -ge 1 ]; then
    systemctl try-restart lodgerd.service >/dev/null 2>&1 || :
fi
if [ "$1" -eq 0 ]; then
    systemctl reset-failed lodgerd.service >/dev/null 2>&1 || :
    rm -rf /var/lib/lodger
    # Directories the package does not own; left in place if an admin put files there.
    rmdir /etc/lodger /usr/share/doc/lodger /usr/libexec/lodger 2>/dev/null || :
    members=$(getent group lodger | cut -d: -f4)
    if getent group lodger >/dev/null; then
        if [ -z "$members" ]; then
            groupdel lodger || :
        else
            echo "lodger: keeping group 'lodger' (members: $members)" >&2
        fi
    fi
fi
