//! Finding a job's processes and threads in /proc: start times (to tell a process from a later one
//! that reused its pid), the parent links that give a process's descendants ([`ProcessTable`],
//! read in full or kept in step by whoever reads the process events), and the thread ids
//! under `/proc/PID/task`; a process's CPU time from its CPU-time clock; and node-wide files read
//! every pass through one descriptor kept open ([`KeptFile`]). Reads the proc root it is given
//! and those clocks, nothing else.
//!
//! Hand-written rather than through the procfs crate on this path: it runs every tick for every
//! process of every job and needs three fields of `stat`; the crate parses all fifty-odd fields
//! into a fresh struct (and a `String` for the command name) per call. The crate is used where it
//! fits (`/proc/PID/cgroup`, in `enforce::cgroup` and `enforce::rtgroup`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::read_small;

/// Default mount point of procfs.
pub const DEFAULT_PROC_ROOT: &str = "/proc";

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

/// What lodger needs from `/proc/PID/stat`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub ppid: u32,
    /// The process group.
    pub pgrp: u32,
    /// Clock ticks after boot: with the pid, identifies one process for its whole life.
    pub start_time: u64,
    /// False for zombies and dead tasks: they hold their pid but run nothing.
    pub running: bool,
}

/// Parses `/proc/PID/stat`. The command name (field 2) may hold spaces and parentheses, so fields
/// are counted from the last `)`.
pub fn parse_stat(text: &[u8]) -> Option<ProcStat> {
    let close = text.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(text.get(close + 1..)?).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    // After the name: state (3), ppid (4), pgrp (5), ... starttime (22).
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    let start_time = fields.nth(22 - 6)?.parse().ok()?;
    let running = !matches!(state, "Z" | "X" | "x");
    Some(ProcStat {
        ppid,
        pgrp,
        start_time,
        running,
    })
}

/// True for the errors that mean "the process or thread is gone".
/// The CPU time of the whole process `pid` (every thread, the exited ones included), in ns,
/// from its POSIX CPU-time clock (`clock_getcpuclockid(3)`; Linux asks no permission to read
/// it): one syscall, no file. `None` when the process is gone.
pub fn process_cpu_ns(pid: u32) -> Option<u64> {
    let pid = libc::clockid_t::try_from(pid).ok().filter(|p| *p > 0)?;
    // The kernel's encoding of a process's CPU-time clock (`MAKE_PROCESS_CPUCLOCK(pid,
    // CPUCLOCK_SCHED)`), as glibc's clock_getcpuclockid builds it, without the extra
    // clock_getres call it makes to check the pid: clock_gettime fails the same way.
    let clock = (!pid << 3) | 2;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u64::try_from(ts.tv_nsec).ok()?;
    Some(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
}

/// The CPU time of `pids` together, from their clocks ([`process_cpu_ns`]); a process gone
/// counts nothing.
pub fn processes_cpu_ns(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|&p| process_cpu_ns(p))
        .fold(0u64, u64::saturating_add)
}

/// The real and effective uids of `pid` (the `Uid:` line of `<proc_root>/PID/status`), None
/// when it is gone or unreadable. Not the owner of `/proc/PID`, which a process made
/// non-dumpable shows as root.
pub fn uids(proc_root: &Path, pid: u32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(proc_root.join(pid.to_string()).join("status")).ok()?;
    let mut ids = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .map(|u| u.parse::<u32>().ok());
    Some((ids.next()??, ids.next()??))
}

pub fn is_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// Reads /proc with buffers kept between calls, so a sweep does not allocate per process.
#[derive(Debug)]
pub struct ProcReader {
    root: PathBuf,
    path: PathBuf,
    buf: Vec<u8>,
}

impl ProcReader {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            path: PathBuf::with_capacity(root.as_os_str().len() + 32),
            buf: Vec::with_capacity(512),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn set_path(&mut self, parts: &[&str]) {
        self.path.clear();
        self.path.push(&self.root);
        for p in parts {
            self.path.push(p);
        }
    }

    /// The stat of a process; `None` when it is gone.
    pub fn stat(&mut self, pid: u32) -> Result<Option<ProcStat>, ProcError> {
        let pid_s = pid.to_string();
        self.set_path(&[&pid_s, "stat"]);
        match read_small(&self.path, &mut self.buf) {
            Ok(()) => Ok(parse_stat(&self.buf)),
            Err(e) if is_gone(&e) => Ok(None),
            Err(source) => Err(ProcError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// The thread ids of a process, appended to `out`; `Ok(false)` when the process is gone.
    pub fn threads(&mut self, pid: u32, out: &mut Vec<u32>) -> Result<bool, ProcError> {
        let pid_s = pid.to_string();
        self.set_path(&[&pid_s, "task"]);
        let entries = match fs::read_dir(&self.path) {
            Ok(e) => e,
            Err(e) if is_gone(&e) => return Ok(false),
            Err(source) => {
                return Err(ProcError::Read {
                    path: self.path.clone(),
                    source,
                })
            }
        };
        for entry in entries {
            // A thread exiting while the directory is listed is simply not listed.
            let Ok(entry) = entry else { continue };
            if let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
                out.push(tid);
            }
        }
        Ok(true)
    }

    /// Whether the kernel lists each thread's children (`/proc/PID/task/TID/children`, built
    /// with CONFIG_PROC_CHILDREN, as distribution kernels are), tried on the calling thread's own
    /// entry. Without it, descendants are found from every process's parent ([`ProcessTable`]).
    pub fn lists_children(&mut self) -> bool {
        self.set_path(&["thread-self", "children"]);
        self.path.exists()
    }

    /// The children of thread `tid` of process `pid` (a child is listed under the thread that
    /// forked it), appended to `out`; none when the thread is gone. The kernel builds the list
    /// as it is read, so a child forked or reaped meanwhile may be missing: callers read again
    /// until nothing changes.
    pub fn children(&mut self, pid: u32, tid: u32, out: &mut Vec<u32>) -> Result<(), ProcError> {
        let (pid_s, tid_s) = (pid.to_string(), tid.to_string());
        self.set_path(&[&pid_s, "task", &tid_s, "children"]);
        match read_small(&self.path, &mut self.buf) {
            Ok(()) => {
                out.extend(
                    self.buf
                        .split(u8::is_ascii_whitespace)
                        .filter_map(|w| std::str::from_utf8(w).ok()?.parse::<u32>().ok()),
                );
                Ok(())
            }
            Err(e) if is_gone(&e) => Ok(()),
            Err(source) => Err(ProcError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// Appends to `out` every descendant of the processes in `roots` that is not already in
    /// `out` (`out` may hold the roots themselves), walked through each of their threads'
    /// [`children`](Self::children): what [`ProcessTable::descendants`] finds, read from the
    /// kernel as it is now at a cost of the tree's own threads, not the node's processes. A child
    /// the kernel gave to another thread of its process, or to a subreaper in the tree, is
    /// listed there; one whose fork is under way is not yet.
    pub fn descendants(&mut self, roots: &[u32], out: &mut Vec<u32>) -> Result<(), ProcError> {
        self.walk_tree(roots, out, |_, _| Ok::<(), ProcError>(()))
    }

    /// [`Self::descendants`], calling `visit` with each process of the trees (the roots
    /// included) and its threads before its children are read: a move pins a process's threads
    /// there, so a child forked after that is born on the new CPUs, and each thread is listed
    /// once.
    pub fn walk_tree<E: From<ProcError>>(
        &mut self,
        roots: &[u32],
        out: &mut Vec<u32>,
        mut visit: impl FnMut(u32, &[u32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut seen: HashSet<u32> = out.iter().chain(roots).copied().collect();
        let mut stack = roots.to_vec();
        let (mut tids, mut kids) = (Vec::new(), Vec::new());
        while let Some(pid) = stack.pop() {
            tids.clear();
            if !self.threads(pid, &mut tids)? {
                continue;
            }
            visit(pid, &tids)?;
            kids.clear();
            for &tid in &tids {
                self.children(pid, tid, &mut kids)?;
            }
            for &kid in &kids {
                if seen.insert(kid) {
                    out.push(kid);
                    stack.push(kid);
                }
            }
        }
        Ok(())
    }

    /// How many threads `pid` has, from the link count of `/proc/PID/task` (the kernel counts
    /// each thread as a link of that directory, beside `.` and `..`): one `stat`, where listing
    /// the directory makes an entry for every thread (issue 21). `None`: the process is gone.
    pub fn thread_count(&mut self, pid: u32) -> Result<Option<u64>, ProcError> {
        use std::os::unix::fs::MetadataExt;
        let pid_s = pid.to_string();
        self.set_path(&[&pid_s, "task"]);
        match fs::metadata(&self.path) {
            Ok(m) => Ok(Some(m.nlink().saturating_sub(2))),
            Err(e) if is_gone(&e) => Ok(None),
            Err(source) => Err(ProcError::Read {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// The thread ids of each of `pids`, appended to `tids` (for moving whole processes into a
    /// resctrl group, which moves single threads). Returns the pids that are gone or list no
    /// thread.
    pub fn threads_of(&mut self, pids: &[u32], tids: &mut Vec<u32>) -> Result<Vec<u32>, ProcError> {
        let mut gone = Vec::new();
        for &pid in pids {
            let before = tids.len();
            if !self.threads(pid, tids)? || tids.len() == before {
                gone.push(pid);
            }
        }
        Ok(gone)
    }

    /// The pid of the most recently created task (the fifth field of `/proc/loadavg`). It moves on
    /// every fork and clone, so an unchanged value means no process appeared since it was read.
    pub fn last_pid(&mut self) -> Option<u32> {
        self.set_path(&["loadavg"]);
        read_small(&self.path, &mut self.buf).ok()?;
        std::str::from_utf8(&self.buf)
            .ok()?
            .split_ascii_whitespace()
            .nth(4)?
            .parse()
            .ok()
    }
}

/// A file the kernel generates anew at each read from its start (`/proc/stat`, the PSI files),
/// kept open and read again with `pread` at offset 0 rather than opened every pass. Opening
/// `/proc/stat` walks the path and allocates a buffer sized for every possible CPU, and closing
/// frees it: that was half of an idle lodgerd's CPU sensing (issue 21), more than generating the
/// text. seq_file restarts a read at offset 0 from the first record, as `top` relies on.
///
/// A read that fails drops the descriptor, so the next read opens the path again: a file that
/// was replaced or unmounted is found anew, and one that is gone reports the open's error.
#[derive(Debug)]
pub struct KeptFile {
    path: PathBuf,
    file: Option<File>,
}

impl KeptFile {
    pub fn new(path: PathBuf) -> Self {
        Self { path, file: None }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole file into `buf` (replacing what it held): through the kept descriptor, or
    /// opened again when there is none or reading through it failed. The error is the open's or
    /// the read's.
    pub fn read_into(&mut self, buf: &mut Vec<u8>) -> io::Result<()> {
        if let Some(file) = &self.file {
            if read_from_start(file, buf).is_ok() {
                return Ok(());
            }
            self.file = None;
        }
        let file = File::open(&self.path)?;
        read_from_start(&file, buf)?;
        self.file = Some(file);
        Ok(())
    }
}

/// Reads `file` from offset 0 to its end into `buf`, growing it as needed.
fn read_from_start(file: &File, buf: &mut Vec<u8>) -> io::Result<()> {
    let mut len = 0;
    buf.clear();
    loop {
        if buf.len() - len < 1024 {
            buf.resize((buf.len() * 2).max(4096), 0);
        }
        let offset = u64::try_from(len).unwrap_or(u64::MAX);
        match file.read_at(&mut buf[len..], offset) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                buf.clear();
                return Err(e);
            }
        }
    }
    buf.truncate(len);
    Ok(())
}

/// The pid of every process under the proc root (its numeric entries), in directory order.
/// Entries that vanish while being listed are left out.
pub fn list_pids(proc_root: &Path) -> Result<Vec<u32>, ProcError> {
    let entries = fs::read_dir(proc_root).map_err(|source| ProcError::Read {
        path: proc_root.to_path_buf(),
        source,
    })?;
    Ok(entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .collect())
}

/// The processes under the proc root with `path` open, by pid (the kernel says nothing of who
/// holds a `flock`, so a blocked lock is explained from their descriptors). Processes whose
/// descriptors cannot be read (gone, or another user's without the right) are left out.
pub fn holding_open(proc_root: &Path, path: &Path) -> Vec<u32> {
    let target = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let pids = list_pids(proc_root).unwrap_or_default();
    pids.into_iter()
        .filter(|pid| {
            fs::read_dir(proc_root.join(pid.to_string()).join("fd"))
                .into_iter()
                .flatten()
                .flatten()
                .any(|fd| fs::read_link(fd.path()).is_ok_and(|t| t == target))
        })
        .collect()
}

/// Every process's parent, for finding descendants: read in one pass over /proc ([`Self::rescan`]),
/// and kept in step from the kernel's process events by whoever reads them ([`Self::fork`],
/// [`Self::exit`], then [`Self::settle`] before it is used).
#[derive(Debug, Default, Clone)]
pub struct ProcessTable {
    /// (ppid, pid): a process's children are a range.
    children: BTreeSet<(u32, u32)>,
    /// pid → ppid, for the entry an exit or a reused pid replaces.
    parent: HashMap<u32, u32>,
    /// Processes to read again at the next [`Self::settle`]: those whose parent exited (the
    /// kernel gave them to another parent, a subreaper, another thread of the parent's process
    /// or init, which no event names) and an exited process itself (see [`Self::exit`]).
    recheck: Vec<u32>,
    /// Reused by `rescan`.
    scratch: Vec<(u32, u32)>,
}

impl ProcessTable {
    /// Reads the parent of every process under the proc root. Processes that exit meanwhile are
    /// left out. Reuses the table's storage.
    pub fn rescan(&mut self, reader: &mut ProcReader) -> Result<(), ProcError> {
        let root = reader.root().to_path_buf();
        let mut pairs = std::mem::take(&mut self.scratch);
        pairs.clear();
        for pid in list_pids(&root)? {
            if let Some(stat) = reader.stat(pid)? {
                if stat.running {
                    pairs.push((stat.ppid, pid));
                }
            }
        }
        self.recheck.clear();
        self.parent.clear();
        self.parent
            .extend(pairs.iter().map(|&(ppid, pid)| (pid, ppid)));
        // Sorted first, so the set is built in bulk.
        pairs.sort_unstable();
        self.children = pairs.iter().copied().collect();
        self.scratch = pairs;
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.parent.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parent.is_empty()
    }

    /// Process `pid`'s parent is `ppid` now (it was forked, or a reused pid's earlier process
    /// left no exit).
    fn set_parent(&mut self, pid: u32, ppid: u32) {
        if let Some(was) = self.parent.insert(pid, ppid) {
            self.children.remove(&(was, pid));
        }
        self.children.insert((ppid, pid));
    }

    /// A fork event: process `child` was created with parent `parent` (a thread is no entry).
    pub fn fork(&mut self, parent: u32, child: u32) {
        self.set_parent(child, parent);
    }

    /// A process's exit event (its thread-group leader's): `pid` has ended, and its children
    /// have another parent, read again by the next [`Self::settle`]; until then they are no
    /// one's descendants. The leader's end is not always the process's: a thread other than the
    /// leader that calls `execve` ends the leader first (an exit event for the pid), then goes
    /// on as the process under the same pid, and its exec event ([`Self::exec`]) puts it back.
    /// The pid is not read again here: on a busy node most exits are processes' ends, and a
    /// read per exit (a failed `open`) was most of the table's upkeep.
    pub fn exit(&mut self, pid: u32) {
        self.forget(pid);
        let children: Vec<(u32, u32)> = self
            .children
            .range((pid, 0)..=(pid, u32::MAX))
            .copied()
            .collect();
        for (ppid, child) in children {
            self.children.remove(&(ppid, child));
            self.parent.remove(&child);
            self.recheck.push(child);
        }
    }

    /// A thread other than the leader of process `tgid` ended: if it was the process's last (its
    /// leader ended before it), the kernel gave the process's children to another parent, and
    /// no event names them: they are read again by the next [`Self::settle`].
    pub fn thread_exit(&mut self, tgid: u32) {
        let children = self.children.range((tgid, 0)..=(tgid, u32::MAX));
        self.recheck.extend(children.map(|&(_, child)| child));
    }

    /// An exec event: process `tgid` runs, whatever ended its leader (see [`Self::exit`]); one
    /// the table lost is read again by the next [`Self::settle`].
    pub fn exec(&mut self, tgid: u32) {
        if !self.parent.contains_key(&tgid) {
            self.recheck.push(tgid);
        }
    }

    /// How many processes wait for the next [`Self::settle`]: a table its reader stopped using
    /// would otherwise gather them for ever.
    pub fn unsettled(&self) -> usize {
        self.recheck.len()
    }

    fn forget(&mut self, pid: u32) {
        if let Some(was) = self.parent.remove(&pid) {
            self.children.remove(&(was, pid));
        }
    }

    /// Reads the parent of each process to read again (`exit`, `thread_exit`, `exec`) as /proc
    /// shows it now; one gone meanwhile, or a zombie, is left out. Each is read once.
    pub fn settle(&mut self, reader: &mut ProcReader) -> Result<(), ProcError> {
        while let Some(pid) = self.recheck.pop() {
            match reader.stat(pid) {
                Ok(Some(stat)) if stat.running => self.set_parent(pid, stat.ppid),
                Ok(_) => self.forget(pid),
                Err(e) => {
                    self.recheck.push(pid);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Appends to `out` every descendant of the processes in `roots` that is not already in `out`
    /// (`out` may hold the roots themselves).
    pub fn descendants(&self, roots: &[u32], out: &mut Vec<u32>) {
        // A set, not `contains` on the vectors: a job can have thousands of processes.
        let mut seen: HashSet<u32> = out.iter().chain(roots).copied().collect();
        let mut stack: Vec<u32> = roots.to_vec();
        while let Some(p) = stack.pop() {
            for &(_, child) in self.children.range((p, 0)..=(p, u32::MAX)) {
                if seen.insert(child) {
                    out.push(child);
                    stack.push(child);
                }
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn from_pairs(pairs: &[(u32, u32)]) -> Self {
        let mut t = Self::default();
        for &(ppid, pid) in pairs {
            t.set_parent(pid, ppid);
        }
        t
    }
}

#[cfg(test)]
#[path = "procfs_tests.rs"]
mod tests;
