//! The v1 `net_cls` hierarchy for the tests that shape network traffic (tests/tc_netns.rs,
//! tests/crash.rs): the mounted one, or one mounted for the test and unmounted after it.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use lodger::sys::cgroupfs::find_net_cls_mount;

/// The v1 net_cls hierarchy: the mounted one, or one mounted here (and unmounted on drop).
pub struct NetClsMount {
    pub path: PathBuf,
    pub ours: Option<tempfile::TempDir>,
}

impl NetClsMount {
    pub fn find_or_mount() -> Result<NetClsMount, String> {
        let mountinfo =
            std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| e.to_string())?;
        if let Some(path) = find_net_cls_mount(&mountinfo) {
            return Ok(NetClsMount { path, ours: None });
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = dir.path().to_path_buf();
        let out = Command::new("mount")
            .args(["-t", "cgroup", "-o", "net_cls", "lodger-test-net_cls"])
            .arg(&path)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "cannot mount the net_cls hierarchy: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(NetClsMount {
            path,
            ours: Some(dir),
        })
    }
}

/// Cgroups of the net_cls hierarchy, live and dying, from /proc/cgroups.
pub fn net_cls_cgroups() -> Option<u32> {
    let text = std::fs::read_to_string("/proc/cgroups").ok()?;
    text.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&"net_cls"))
        .and_then(|f| f.get(2)?.parse().ok())
}

impl Drop for NetClsMount {
    fn drop(&mut self) {
        if self.ours.is_none() {
            return;
        }
        // A v1 hierarchy unmounted while a removed cgroup is still dying outlives the mount,
        // unseen: wait for the kernel to finish with it first.
        let deadline = Instant::now() + Duration::from_secs(5);
        while net_cls_cgroups().is_some_and(|n| n > 1) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = Command::new("umount").arg(&self.path).status();
    }
}
