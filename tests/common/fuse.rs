//! A FUSE filesystem that never answers, for tests of what lodgerd does when a path it must
//! look at hangs (a hard NFS mount whose server is down).

use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;

/// A FUSE filesystem that never answers, mounted on a fresh directory (root only): a `stat`
/// below it blocks as on a hung NFS or FUSE mount. Dropping it aborts the connection (what is
/// blocked there gets ENOTCONN) and detaches the mount.
pub struct HungMount {
    pub dir: tempfile::TempDir,
    fuse: Option<fs::File>,
}

impl HungMount {
    /// Mounts it, or says why it cannot (no /dev/fuse, not permitted).
    pub fn new() -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
        let fuse = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .map_err(|e| format!("cannot open /dev/fuse: {e}"))?;
        let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
        let target = c(&dir.path().display().to_string());
        let opts = c(&format!(
            "fd={},rootmode=40000,user_id=0,group_id=0",
            fuse.as_raw_fd()
        ));
        let (source, fstype) = (c("lodger-hung"), c("fuse"));
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(format!(
                "cannot mount a FUSE filesystem: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Self {
            dir,
            fuse: Some(fuse),
        })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for HungMount {
    fn drop(&mut self) {
        // The last descriptor of the connection closed: the kernel aborts it.
        drop(self.fuse.take());
        let target = std::ffi::CString::new(self.dir.path().display().to_string()).expect("no NUL");
        // SAFETY: a NUL-terminated path that outlives the call.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}
