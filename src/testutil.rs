//! Helpers shared by the unit tests: recorded fixture trees and writable copies of them.

use std::fs;
use std::path::{Path, PathBuf};

/// `tests/fixtures/<relative>` in the source tree.
pub fn fixture(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(relative)
}

/// The recorded resctrl tree `name` (`intel-mba-mbm`, `amd`, `none`).
pub fn resctrl_fixture(name: &str) -> PathBuf {
    fixture("resctrl").join(name)
}

/// Copies the tree at `src` into `dst` (made if missing): files and directories only.
pub fn copy_tree(src: &Path, dst: &Path) {
    fs::create_dir_all(dst).expect("create copy root");
    for entry in fs::read_dir(src).expect("read fixture dir") {
        let entry = entry.expect("fixture entry");
        let to = dst.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_tree(&entry.path(), &to);
        } else {
            fs::copy(entry.path(), &to).expect("copy fixture file");
        }
    }
}

/// A writable copy of `src` in a new temporary directory.
pub fn copy_of(src: &Path) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    copy_tree(src, tmp.path());
    tmp
}

/// What the kernel does on rmdir of a cgroup or resctrl group: its files go with it. A plain
/// directory standing in for one needs them removed first. A missing group is left alone.
pub fn simulate_kernel_rmdir(group: &Path) {
    let Ok(entries) = fs::read_dir(group) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            fs::remove_dir_all(&path).expect("remove kernel dir");
        } else {
            fs::remove_file(&path).expect("remove kernel file");
        }
    }
}

/// Writes `content` to `path`, making its parent directories.
pub fn write(path: &Path, content: &str) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("create parent");
    }
    fs::write(path, content).expect("write file");
}

/// A minimal mounted resctrl with MBM and the given default-group counter contents.
pub fn minimal_resctrl(root: &Path, domains: &[(&str, &str)]) {
    use crate::sys::resctrlfs::{MBM_TOTAL_BYTES, MON_DATA, MON_FEATURES, NUM_RMIDS};
    write(
        &root.join(MON_FEATURES),
        "llc_occupancy\nmbm_total_bytes\nmbm_local_bytes\n",
    );
    write(&root.join(NUM_RMIDS), "224\n");
    for (domain, content) in domains {
        write(
            &root.join(MON_DATA).join(domain).join(MBM_TOTAL_BYTES),
            content,
        );
    }
}

/// A fake proc root holding `PID/stat` for each `(pid, ppid, state)`.
pub fn fake_proc(procs: &[(u32, u32, &str)]) -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tempdir");
    for &(pid, ppid, state) in procs {
        fake_process(root.path(), pid, ppid, state);
    }
    root
}

/// Adds process `pid` (parent `ppid`, in `state`) to the fake proc root at `root`.
pub fn fake_process(root: &Path, pid: u32, ppid: u32, state: &str) {
    let stat = format!(
        "{pid} (p) {state} {ppid} {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {} 0 0\n",
        1000 + pid
    );
    write(&root.join(pid.to_string()).join("stat"), &stat);
}
