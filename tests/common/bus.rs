//! A private `dbus-daemon` with a permissive policy, for tests: the end-to-end tests' bus
//! (`common::PrivateBus`) and the lib's own tests that serve a fake on a bus (they include this
//! file by path). Uses only std and tempfile, so both can.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A private bus with a permissive policy, reachable by any local user (so a non-root caller
/// can be tested), removed on drop.
pub struct PrivateBus {
    pub(crate) child: Child,
    pub address: String,
    _dir: tempfile::TempDir,
}

impl PrivateBus {
    /// Starts a `dbus-daemon` on a socket in a directory of its own, with a policy that lets
    /// everyone own, send and receive anything.
    pub fn start() -> PrivateBus {
        PrivateBus::with_config(|socket| {
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"#,
                socket.display()
            )
        })
    }

    /// Starts a `dbus-daemon` with the configuration `config` gives for the socket path it must
    /// listen on; any local user may connect to the socket.
    pub fn with_config(config: impl FnOnce(&Path) -> String) -> PrivateBus {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let socket = dir.path().join("bus");
        let conf = dir.path().join("bus.conf");
        std::fs::write(&conf, config(&socket)).expect("write bus config");
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
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777))
            .expect("chmod socket");
        PrivateBus {
            child,
            address,
            _dir: dir,
        }
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
