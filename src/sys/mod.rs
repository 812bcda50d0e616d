//! The kernel vocabularies that sensing and enforcement share, one module per interface: how
//! `/proc`, cgroupfs and resctrl are laid out, read and written, the one runner for external
//! programs (`tc`, `ip`, `nft`), blocking work waited for within a bound, and a bounded look at
//! paths that may hang, the reader of small kernel files they share (`read_small`) and a socket
//! option setter (`set_option`). Each takes its root (or program) as an argument; nothing here
//! imports `sense`, `policy`, `enforce` or `agent`.

pub mod bounded;
pub mod cgroupfs;
pub mod command;
pub mod procevents;
pub mod procfs;
pub mod procwatch;
pub mod resctrlfs;
pub mod stall;

/// Reads the whole file at `path` into `buf` (cleared first): open, read until the end, close.
/// By hand because `std`'s `read_to_end` on a `File` first asks for the file's size and
/// position (`statx`, `lseek`), two of its six system calls, and a /proc or cgroupfs file has no
/// size to give. A registration reads a few small /proc files per thread and a job's cpuset
/// files (issue 21 item 1).
pub fn read_small(path: &std::path::Path, buf: &mut Vec<u8>) -> std::io::Result<()> {
    use std::io::Read;
    const CHUNK: usize = 512;
    let mut f = std::fs::File::open(path)?;
    buf.clear();
    loop {
        let len = buf.len();
        buf.resize(len + CHUNK, 0);
        match f.read(&mut buf[len..]) {
            Ok(0) => {
                buf.truncate(len);
                return Ok(());
            }
            Ok(n) => buf.truncate(len + n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => buf.truncate(len),
            Err(e) => {
                buf.truncate(len);
                return Err(e);
            }
        }
    }
}

/// `setsockopt(fd, SOL_SOCKET, opt, value)`: the proc connector's socket and its filters
/// (`procevents`, `procwatch`), whose filter attachments (`SO_ATTACH_FILTER`, `SO_ATTACH_BPF`)
/// take the kernel's own structs, built with `libc` like the rest of those two files.
pub(crate) fn set_option<T>(
    fd: &std::os::fd::OwnedFd,
    opt: libc::c_int,
    value: &T,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `value` is a live `T` of the size given; the kernel reads no more than that.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            std::ptr::from_ref(value).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
