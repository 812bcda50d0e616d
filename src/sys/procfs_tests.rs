//! Tests of `sys::procfs`: parsing `stat`, the reader, the process table, open files.

use super::*;
use crate::testutil::fake_proc;

/// Each thread's children are read from its `children` file; a thread that is gone has
/// none; a proc root without `thread-self/children` does not list children.
#[test]
fn children_are_read_per_thread() {
    let root = tempfile::tempdir().expect("tempdir");
    let write = |rel: &str, text: &str| {
        let path = root.path().join(rel);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(path, text).expect("write");
    };
    write("10/task/10/children", "11 12 ");
    write("10/task/13/children", "14\n");
    write("10/task/15/children", "");
    let mut reader = ProcReader::new(root.path());
    assert!(!reader.lists_children());
    let mut out = Vec::new();
    for tid in [10, 13, 15, 16] {
        reader.children(10, tid, &mut out).expect("children");
    }
    assert_eq!(out, [11, 12, 14]);
    write("thread-self/children", "");
    assert!(reader.lists_children());
}

/// This process's child is listed under the thread that spawned it, on this kernel.
#[test]
fn a_spawned_child_is_listed_under_its_thread() {
    let mut reader = ProcReader::new(Path::new("/proc"));
    if !reader.lists_children() {
        crate::privileged::not_applicable(
            "a_spawned_child_is_listed_under_its_thread",
            "this kernel has no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)",
        );
        return;
    }
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    let tid = nix::unistd::gettid().as_raw() as u32;
    let mut out = Vec::new();
    let read = reader.children(std::process::id(), tid, &mut out);
    let _ = child.kill();
    let _ = child.wait();
    read.expect("children");
    assert!(out.contains(&child.id()), "{out:?} lacks {}", child.id());
}

/// A file this process holds open is found open by this process, and a path nobody opened
/// by no one.
#[test]
fn holding_open_finds_this_process_on_its_own_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("held");
    let _file = fs::File::create(&path).expect("create");
    let proc_root = Path::new("/proc");
    assert!(holding_open(proc_root, &path).contains(&std::process::id()));
    assert!(holding_open(proc_root, &dir.path().join("never opened")).is_empty());
}

#[test]
fn list_pids_takes_the_numeric_entries_and_names_a_missing_root() {
    let root = tempfile::tempdir().expect("tempdir");
    for name in ["1", "42", "self", "sys", "4242x"] {
        fs::create_dir(root.path().join(name)).expect("mkdir");
    }
    fs::write(root.path().join("7"), "").expect("write");
    let mut pids = list_pids(root.path()).expect("list");
    pids.sort_unstable();
    assert_eq!(pids, vec![1, 7, 42]);
    let gone = root.path().join("nope");
    let err = list_pids(&gone).expect_err("missing root");
    assert!(err.to_string().contains("nope"), "{err}");
}

#[test]
fn a_kept_file_reads_its_whole_content_again_and_reopens_after_a_replacement() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("stat");
    // Longer than one read's first buffer, so the loop reads it in parts.
    let long: String = (0..2000).map(|i| format!("cpu{i} 1 2 3\n")).collect();
    fs::write(&path, &long).expect("write");
    let mut kept = KeptFile::new(path.clone());
    let mut buf = b"stale".to_vec();
    kept.read_into(&mut buf).expect("first read");
    assert_eq!(buf, long.as_bytes());
    // Rewritten in place: the kept descriptor sees the new, shorter content.
    fs::write(&path, "cpu 9\n").expect("rewrite");
    kept.read_into(&mut buf).expect("second read");
    assert_eq!(buf, b"cpu 9\n");
    // A read that fails (a directory opens but does not read) keeps no descriptor, so the
    // next read opens the path again and finds what is there now.
    let odd = dir.path().join("odd");
    fs::create_dir(&odd).expect("mkdir");
    let mut kept = KeptFile::new(odd.clone());
    assert!(kept.read_into(&mut buf).is_err());
    assert!(kept.file.is_none() && buf.is_empty());
    fs::remove_dir(&odd).expect("rmdir");
    fs::write(&odd, "some 1\n").expect("write");
    kept.read_into(&mut buf).expect("reopened");
    assert_eq!(buf, b"some 1\n");
    // Gone: the open's error.
    let mut gone = KeptFile::new(dir.path().join("nope"));
    let err = gone.read_into(&mut buf).expect_err("absent");
    assert_eq!(err.kind(), io::ErrorKind::NotFound);
    assert_eq!(gone.path(), dir.path().join("nope"));
}

#[test]
fn a_kept_proc_stat_is_generated_anew_at_each_read() {
    // The real /proc: reading the same descriptor again from offset 0 must give the
    // counters as they are now, not the first read's text.
    let mut kept = KeptFile::new(PathBuf::from("/proc/stat"));
    let mut first = Vec::new();
    kept.read_into(&mut first).expect("/proc/stat");
    let total = |text: &[u8]| -> u64 {
        let text = std::str::from_utf8(text).expect("utf-8");
        let line = text.lines().next().expect("cpu line");
        line.split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse::<u64>().ok())
            .sum()
    };
    let before = total(&first);
    assert!(before > 0, "{}", String::from_utf8_lossy(&first));
    // Burn this thread's CPU until the node's jiffies move (USER_HZ is at most 1000).
    let mut again = Vec::new();
    let start = std::time::Instant::now();
    loop {
        kept.read_into(&mut again).expect("/proc/stat again");
        if total(&again) > before || start.elapsed() > std::time::Duration::from_secs(10) {
            break;
        }
        std::hint::black_box((0..10_000u64).sum::<u64>());
    }
    assert!(
        total(&again) > before,
        "the counters never moved through the kept descriptor"
    );
    assert!(kept.file.is_some(), "the descriptor was not kept");
}

#[test]
fn stat_with_odd_command_names() {
    let line = b"1234 (a) b (c)) S 77 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 3 0 98765 1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
    let s = parse_stat(line).expect("parses");
    assert_eq!(s.ppid, 77);
    assert_eq!(s.pgrp, 1234);
    assert_eq!(s.start_time, 98765);
    assert!(s.running);
    let zombie = b"5 (x) Z 1 5 5 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 42 0 0";
    let z = parse_stat(zombie).expect("parses");
    assert!(!z.running);
    assert_eq!(z.start_time, 42);
    assert_eq!(parse_stat(b""), None);
    assert_eq!(parse_stat(b"1 (truncated) S 1 2"), None);
}

#[test]
fn reads_own_stat_and_threads() {
    let mut r = ProcReader::new(Path::new(DEFAULT_PROC_ROOT));
    let me = std::process::id();
    let stat = r.stat(me).expect("read").expect("alive");
    assert!(stat.running);
    assert_eq!(
        r.stat(me).expect("read").map(|s| s.start_time),
        Some(stat.start_time)
    );
    let mut tids = Vec::new();
    assert!(r.threads(me, &mut tids).expect("read"));
    assert!(tids.contains(&me));
    // pid_max itself is never a pid.
    let pid_max: u32 = fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4_194_304);
    assert_eq!(r.stat(pid_max).expect("read"), None);
    assert!(!r.threads(pid_max, &mut tids).expect("read"));
    assert!(r.last_pid().is_some());
}

#[test]
fn descendants_follow_parent_links() {
    // 1 → 10 → 11 → 12, 10 → 13, 2 → 20
    let t = ProcessTable::from_pairs(&[(1, 10), (10, 11), (11, 12), (10, 13), (2, 20)]);
    let mut out = vec![10];
    t.descendants(&[10], &mut out);
    out.sort_unstable();
    assert_eq!(out, vec![10, 11, 12, 13]);
    let mut none = Vec::new();
    t.descendants(&[12], &mut none);
    assert!(none.is_empty());
}

fn descendants_of(t: &ProcessTable, root: u32) -> Vec<u32> {
    let mut out = Vec::new();
    t.descendants(&[root], &mut out);
    out.sort_unstable();
    out
}

/// Kept in step by events: a fork adds a child; an exit orphans the exited process's
/// children until `settle` reads their new parent (a subreaper in the tree keeps them in
/// it, init takes them out of it); an orphan gone meanwhile is left out; a reused pid is
/// the new process, with its own parent and none of the old one's children.
#[test]
fn the_table_follows_forks_exits_and_reparenting() {
    // 10 (a subreaper) → 11 → 12, 11 → 13; 20 → 21 → 22.
    let mut t = ProcessTable::from_pairs(&[(1, 10), (10, 11), (11, 12), (11, 13), (1, 20)]);
    t.fork(20, 21);
    t.fork(21, 22);
    assert_eq!(descendants_of(&t, 20), vec![21, 22]);
    // 11 exits: 12 went to the subreaper 10, 13 exited too (a zombie now); 21 exits and
    // 22 went to init.
    let proc = fake_proc(&[(10, 1, "S"), (12, 10, "S"), (13, 10, "Z"), (22, 1, "S")]);
    let mut reader = ProcReader::new(proc.path());
    t.exit(11);
    t.exit(21);
    assert_eq!(
        descendants_of(&t, 10),
        Vec::<u32>::new(),
        "orphans wait for settle"
    );
    t.settle(&mut reader).expect("settle");
    assert_eq!(descendants_of(&t, 10), vec![12]);
    assert_eq!(descendants_of(&t, 20), Vec::<u32>::new());
    assert_eq!(descendants_of(&t, 1), vec![10, 12, 20, 22]);
    assert_eq!(t.len(), 4);
    // The pid 12 exits and is reused by a child of 20: not the subreaper's any more.
    // Its child 30 exited with it (no stat: gone when settle reads it).
    let proc = fake_proc(&[(10, 1, "S"), (12, 20, "S"), (22, 1, "S")]);
    let mut reader = ProcReader::new(proc.path());
    t.fork(12, 30);
    t.exit(12);
    t.fork(20, 12);
    t.settle(&mut reader).expect("settle");
    assert_eq!(descendants_of(&t, 10), Vec::<u32>::new());
    assert_eq!(descendants_of(&t, 20), vec![12]);
    // A fork whose pid's exit was never seen replaces the old entry.
    t.fork(10, 12);
    assert_eq!(descendants_of(&t, 20), Vec::<u32>::new());
    assert_eq!(descendants_of(&t, 10), vec![12]);
}

/// A thread other than the leader calls `execve`: the kernel ends the leader first (an exit
/// event for the pid), and the process goes on under the same pid, with its children. It
/// stays in the table (it was dropped with its children until the next full read, up to
/// `FULL_SWEEP_EVERY`: not pinned, not in the training class, missed by a release).
#[test]
fn an_exec_from_another_thread_keeps_the_process_and_its_children() {
    let mut t = ProcessTable::from_pairs(&[(1, 10), (10, 11), (11, 12)]);
    let proc = fake_proc(&[(10, 1, "S"), (11, 10, "R"), (12, 11, "S")]);
    let mut reader = ProcReader::new(proc.path());
    t.exit(11);
    t.exec(11);
    t.settle(&mut reader).expect("settle");
    assert_eq!(descendants_of(&t, 10), vec![11, 12]);
    assert_eq!(t.unsettled(), 0);
}

/// A process whose leader ended first (`pthread_exit` in `main`) ends with its last thread,
/// whose exit names only that thread: its children went to init (or a subreaper), and are
/// no longer listed under the dead pid, which a new process may reuse.
#[test]
fn a_process_ending_with_a_thread_other_than_its_leader_gives_up_its_children() {
    let mut t = ProcessTable::from_pairs(&[(1, 10), (10, 11), (11, 12), (11, 13)]);
    // The leader ends first: a zombie while its other thread runs; the children stay.
    let zombie = fake_proc(&[(10, 1, "S"), (11, 10, "Z"), (12, 11, "S"), (13, 11, "S")]);
    t.exit(11);
    t.settle(&mut ProcReader::new(zombie.path()))
        .expect("settle");
    // Then its last thread ends: the children go to init.
    let gone = fake_proc(&[(10, 1, "S"), (12, 1, "S"), (13, 1, "S")]);
    t.thread_exit(11);
    t.settle(&mut ProcReader::new(gone.path())).expect("settle");
    assert_eq!(descendants_of(&t, 10), Vec::<u32>::new());
    // The pid is reused by a child of 10: only the new process is 10's.
    t.fork(10, 11);
    assert_eq!(descendants_of(&t, 10), vec![11]);
}

#[test]
fn scan_finds_this_process_and_its_parent() {
    let mut r = ProcReader::new(Path::new(DEFAULT_PROC_ROOT));
    let mut t = ProcessTable::default();
    t.rescan(&mut r).expect("scan");
    assert!(!t.is_empty());
    let parent = std::os::unix::process::parent_id();
    let mut out = Vec::new();
    t.descendants(&[parent], &mut out);
    assert!(out.contains(&std::process::id()));
}

/// `read_small` reads a file whole whatever its length against its 512-byte reads (empty, one
/// read, several), replaces what the buffer held, and says a missing file is gone.
#[test]
fn read_small_reads_whole_files_into_the_buffer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut buf = b"left from before".to_vec();
    for len in [0usize, 1, 511, 512, 513, 5_000] {
        let text: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
        let path = dir.path().join(format!("f{len}"));
        fs::write(&path, &text).expect("write");
        read_small(&path, &mut buf).expect("read");
        assert_eq!(buf, text, "a file of {len} bytes");
    }
    // A real /proc file, whose size the kernel does not know.
    read_small(Path::new("/proc/self/stat"), &mut buf).expect("read /proc/self/stat");
    let pid = std::process::id().to_string();
    assert!(
        buf.starts_with(pid.as_bytes()),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
    let e = read_small(&dir.path().join("missing"), &mut buf).expect_err("missing");
    assert!(is_gone(&e));
}
