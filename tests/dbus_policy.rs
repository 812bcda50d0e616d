//! The packaged D-Bus policy (`packaging/dbus/org.lodger1.conf`) enforced by a real bus: a private
//! `dbus-daemon` whose configuration is the system bus's default policy (deny method calls and
//! name ownership, as Debian's and Fedora's system.conf do) plus that file, and a lodgerd on it.
//! Checks that a non-root caller can read but that the bus itself refuses its mutating calls,
//! before lodgerd's own check is ever reached, and that root can do everything.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use common::{bin, need_root, wait_until, Workload, WAIT};

const NOBODY: u32 = 65534;

fn policy_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/dbus/org.lodger1.conf")
}

/// A `dbus-daemon` configured like the system bus, with lodger's policy included.
struct SystemLikeBus {
    child: Child,
    address: String,
}

impl SystemLikeBus {
    fn start(dir: &Path) -> SystemLikeBus {
        let socket = dir.join("system_bus_socket");
        let conf = dir.join("system.conf");
        // The default context of dbus's own system.conf, abridged to what matters here.
        std::fs::write(
            &conf,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Properties"/>
  </policy>
  <include>{policy}</include>
</busconfig>
"#,
                socket = socket.display(),
                policy = policy_file().display()
            ),
        )
        .expect("write bus config");
        let mut child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", conf.display()))
            .args(["--nofork", "--nopidfile", "--print-address"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("dbus-daemon (install the dbus package)");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("dbus-daemon address");
        let address = line.trim().to_string();
        assert!(!address.is_empty(), "dbus-daemon printed no address");
        // Every local user may connect to a system bus.
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777))
            .expect("chmod socket");
        SystemLikeBus { child, address }
    }
}

impl Drop for SystemLikeBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a program against the bus, as root or as `uid` (with that uid as gid, no supplementary
/// groups: the bus sees an ordinary user).
fn run_as(uid: Option<u32>, bus: &SystemLikeBus, program: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .stdin(Stdio::null());
    if let Some(uid) = uid {
        // std drops supplementary groups when root sets a uid.
        cmd.uid(uid).gid(uid);
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}

fn busctl(uid: Option<u32>, bus: &SystemLikeBus, args: &[&str]) -> Output {
    let mut full = vec!["--address", bus.address.as_str()];
    full.extend_from_slice(args);
    run_as(uid, bus, Path::new("busctl"), &full)
}

fn text(out: &Output) -> String {
    format!(
        "exit {}; stdout: {}; stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The bus daemon's own refusal (`org.freedesktop.DBus.Error.AccessDenied`), as opposed to
/// lodgerd's `org.lodger1.Error.AccessDenied`, whose message names the uid. busctl reports the
/// former as "Access denied"; lodgerctl quotes the daemon's "Rejected send message ..." text.
fn refused_by_bus(out: &Output, member: &str) -> bool {
    let err = String::from_utf8_lossy(&out.stderr);
    !out.status.success()
        && (err.trim() == "Call failed: Access denied"
            || (err.contains("Rejected send message") && err.contains(member)))
}

/// A lodgerd child, stopped (SIGTERM, as systemd does) when dropped, also when a check fails.
struct Lodgerd(Child);

impl Drop for Lodgerd {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = self.0.wait();
    }
}

fn write_config(dir: &Path, name: &str) -> PathBuf {
    let state = dir.join(format!("{name}-state"));
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "[node]\nreserved_cpus = \"0\"\n\n[agent]\ninterval_ms = 100\nstate_dir = \"{}\"\n",
            state.display()
        ),
    )
    .expect("write config");
    config
}

#[test]
fn bus_policy_lets_everyone_read_and_only_root_change() {
    let test = "bus_policy_lets_everyone_read_and_only_root_change";
    if !need_root(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bus = SystemLikeBus::start(dir.path());

    // Nobody but root may own the name: a lodgerd started as an ordinary user is refused by the
    // bus. Its state directory is its own so that owning the name is the first thing to fail.
    let config = write_config(dir.path(), "nobody");
    let state = dir.path().join("nobody-state");
    std::fs::create_dir(&state).expect("mkdir");
    nix::unistd::chown(
        &state,
        Some(nix::unistd::Uid::from_raw(NOBODY)),
        Some(nix::unistd::Gid::from_raw(NOBODY)),
    )
    .expect("chown");
    let config_arg = config.to_str().expect("utf-8 path");
    let out = run_as(
        Some(NOBODY),
        &bus,
        &bin("lodgerd"),
        &["--sim", "--config", config_arg],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        err.contains("not allowed to own the service \"org.lodger1\""),
        "{}",
        text(&out)
    );

    // lodgerd as root owns it. --sim: this test is about who may call what, not enforcement.
    let config = write_config(dir.path(), "root");
    let mut daemon = Lodgerd(
        Command::new(bin("lodgerd"))
            .args(["--sim", "--config"])
            .arg(&config)
            .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn lodgerd"),
    );
    wait_until(WAIT, "lodgerd to own org.lodger1", || {
        if let Ok(Some(status)) = daemon.0.try_wait() {
            panic!("lodgerd exited early ({status})");
        }
        busctl(None, &bus, &["status", "org.lodger1"])
            .status
            .success()
    });
    let w = Workload::train(1);
    let pid = w.pid().to_string();
    let ctl = bin("lodgerctl");

    // Everyone may read: the read-only methods, properties, introspection.
    for args in [&["list"][..], &["status"], &["--json", "list"]] {
        let out = run_as(Some(NOBODY), &bus, &ctl, args);
        assert!(out.status.success(), "lodgerctl {args:?}: {}", text(&out));
    }
    for args in [
        &["introspect", "org.lodger1", "/org/lodger1"][..],
        &[
            "get-property",
            "org.lodger1",
            "/org/lodger1",
            "org.lodger1.Manager",
            "Free",
        ],
        &[
            "call",
            "org.lodger1",
            "/org/lodger1",
            "org.lodger1.Manager",
            "GetStatus",
        ],
        &[
            "call",
            "org.lodger1",
            "/org/lodger1",
            "org.freedesktop.DBus.Properties",
            "GetAll",
            "s",
            "org.lodger1.Manager",
        ],
    ] {
        let out = busctl(Some(NOBODY), &bus, args);
        assert!(out.status.success(), "busctl {args:?}: {}", text(&out));
    }

    // The bus refuses an ordinary user's mutating calls: lodgerd never sees them.
    let register = [
        "call",
        "org.lodger1",
        "/org/lodger1",
        "org.lodger1.Manager",
        "RegisterJob",
        "a{sv}",
        "3",
        "kind",
        "s",
        "training",
        "pids",
        "au",
        "1",
        &pid,
        "cores",
        "u",
        "1",
    ];
    let out = busctl(Some(NOBODY), &bus, &register);
    assert!(refused_by_bus(&out, "RegisterJob"), "{}", text(&out));
    let out = run_as(
        Some(NOBODY),
        &bus,
        &ctl,
        &["register", "training", "--pid", &pid, "--cores", "1"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(refused_by_bus(&out, "RegisterJob"), "{}", text(&out));
    // Deny by default: a method the policy does not name is refused by the bus, not answered by
    // lodgerd with UnknownMethod.
    let unknown = [
        "call",
        "org.lodger1",
        "/org/lodger1",
        "org.lodger1.Manager",
        "Shutdown",
    ];
    let out = busctl(Some(NOBODY), &bus, &unknown);
    assert!(refused_by_bus(&out, "Shutdown"), "{}", text(&out));
    let out = busctl(None, &bus, &unknown);
    assert!(
        !out.status.success() && !refused_by_bus(&out, "Shutdown"),
        "root's call should reach lodgerd: {}",
        text(&out)
    );

    // Root may register (with busctl and with lodgerctl) and unregister.
    let out = busctl(None, &bus, &register);
    assert!(out.status.success(), "{}", text(&out));
    let id = String::from_utf8_lossy(&out.stdout)
        .split('"')
        .nth(1)
        .expect("an id in busctl's reply")
        .to_string();
    let out = run_as(Some(NOBODY), &bus, &ctl, &["show", &id]);
    assert!(out.status.success(), "{}", text(&out));
    let out = busctl(
        Some(NOBODY),
        &bus,
        &[
            "call",
            "org.lodger1",
            "/org/lodger1",
            "org.lodger1.Manager",
            "UnregisterJob",
            "s",
            &id,
        ],
    );
    assert!(refused_by_bus(&out, "UnregisterJob"), "{}", text(&out));
    let out = run_as(None, &bus, &ctl, &["unregister", &id]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run_as(
        None,
        &bus,
        &ctl,
        &[
            "--json", "register", "training", "--pid", &pid, "--cores", "1",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let out = run_as(None, &bus, &ctl, &["unregister", "--all"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = run_as(Some(NOBODY), &bus, &ctl, &["--json", "list"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "[]",
        "{}",
        text(&out)
    );

    drop(daemon);
}
