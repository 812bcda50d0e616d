//! The process events' parsing, filter and subscription, against crafted datagrams and (as root) the kernel.

use super::*;

/// A datagram as the kernel sends it: nlmsghdr, cn_msg, proc_event.
pub(crate) fn event(what: u32, data: &[u32]) -> Vec<u8> {
    let payload = EVENT_DATA + 4 * data.len();
    let total = NLMSG_HDR + CN_MSG_HDR + payload;
    let mut m = Vec::new();
    m.extend_from_slice(&(total as u32).to_ne_bytes());
    m.extend_from_slice(&[0; 12]);
    m.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
    m.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
    m.extend_from_slice(&[0; 8]);
    m.extend_from_slice(&(payload as u16).to_ne_bytes());
    m.extend_from_slice(&[0; 2]);
    m.extend_from_slice(&what.to_ne_bytes());
    m.extend_from_slice(&[0; 12]); // cpu, timestamp
    for d in data {
        m.extend_from_slice(&d.to_ne_bytes());
    }
    m
}

#[test]
fn forks_execs_and_exits_touch_their_processes() {
    let mut seen = Vec::new();
    // A thread of 100 (tid 101) and a new process 200 forked by 100.
    let mut d = event(PROC_EVENT_FORK, &[100, 100, 101, 100]);
    d.extend(event(PROC_EVENT_FORK, &[100, 100, 200, 200]));
    d.extend(event(PROC_EVENT_EXEC, &[200, 200]));
    d.extend(event(PROC_EVENT_EXIT, &[101, 100, 0, 0, 1, 1]));
    d.extend(event(0x0000_0004, &[300, 300, 0, 0])); // a UID change: nothing
    let mut events = Vec::new();
    assert_eq!(parse(&d, &mut |e: Event| events.push(e)), (5, false));
    seen.extend(events.iter().flat_map(Event::touched).flatten());
    assert_eq!(seen, [100, 100, 100, 200, 200, 100]);
    assert_eq!(
        events[..2],
        [
            Event::Fork {
                parent_tgid: 100,
                child_pid: 101,
                child_tgid: 100
            },
            Event::Fork {
                parent_tgid: 100,
                child_pid: 200,
                child_tgid: 200
            }
        ]
    );
    assert_eq!(
        events[3],
        Event::Exit {
            pid: 101,
            tgid: 100
        }
    );
}

#[test]
fn truncated_or_foreign_messages_are_skipped() {
    let d = event(PROC_EVENT_EXEC, &[7, 7]);
    let mut seen = Vec::new();
    assert_eq!(
        parse(&d[..d.len() - 10], &mut |e| seen.push(e)),
        (0, true),
        "cut short"
    );
    let mut other = d.clone();
    other[NLMSG_HDR..NLMSG_HDR + 4].copy_from_slice(&9u32.to_ne_bytes());
    assert_eq!(parse(&other, &mut |e| seen.push(e)), (0, false));
    assert_eq!(parse(&[], &mut |e| seen.push(e)), (0, false));
    assert!(seen.is_empty());
}

/// The kernel's acknowledgement of a subscription: `event` with `ack` set to `cookie` + 1.
fn acknowledged(cookie: u32, err: u32) -> Vec<u8> {
    let mut d = event(PROC_EVENT_NONE, &[err]);
    d[NLMSG_HDR + 12..NLMSG_HDR + 16].copy_from_slice(&cookie.wrapping_add(1).to_ne_bytes());
    d
}

#[test]
fn the_acknowledgement_is_recognised_by_its_cookie() {
    assert_eq!(acknowledgement(&acknowledged(41, 0), 41), Some(0));
    let eperm = u32::try_from(libc::EPERM).expect("errno");
    assert_eq!(
        acknowledgement(&acknowledged(41, eperm), 41),
        Some(libc::EPERM)
    );
    // Another subscriber's, an event, a truncated one: not ours.
    assert_eq!(acknowledgement(&acknowledged(7, 0), 41), None);
    assert_eq!(
        acknowledgement(&event(PROC_EVENT_EXEC, &[42, 42]), 41),
        None
    );
    let ours = acknowledged(41, 0);
    assert_eq!(acknowledgement(&ours[..ours.len() - 8], 41), None);
    assert_eq!(acknowledgement(&[], 41), None);
    // The cookie goes out in the subscription's `ack` field.
    let listen = listen_message(41);
    assert_eq!(u32_at(&listen, NLMSG_HDR + 12), Some(41));
}

/// A non-blocking Unix datagram pair: the kernel's end and lodgerd's, for the tests.
pub(crate) fn datagram_pair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair: {}", io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned here.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// `confirm` on a Unix datagram pair standing in for the kernel: other datagrams are passed
/// over, an acceptance confirms, a refusal is its error, silence is an error that says why.
#[test]
fn confirm_waits_for_this_subscriptions_answer() {
    let send = |fd: &OwnedFd, d: &[u8]| {
        // SAFETY: the datagram is valid for its length.
        let sent = unsafe { libc::send(fd.as_raw_fd(), d.as_ptr().cast(), d.len(), 0) };
        assert_eq!(sent, d.len() as isize);
    };
    let (tx, rx) = datagram_pair();
    send(&tx, &event(PROC_EVENT_FORK, &[1, 1, 2, 2]));
    send(&tx, &acknowledged(7, 0));
    send(&tx, &acknowledged(41, 0));
    confirm(&rx, 41, CONFIRM_WITHIN).expect("accepted");

    let (tx, rx) = datagram_pair();
    send(
        &tx,
        &acknowledged(41, u32::try_from(libc::EPERM).expect("errno")),
    );
    let err = confirm(&rx, 41, CONFIRM_WITHIN).expect_err("refused");
    assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");

    let (tx, rx) = datagram_pair();
    send(&tx, &acknowledged(7, 0));
    let err = confirm(&rx, 41, Duration::from_millis(20)).expect_err("no answer");
    assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
    assert!(err.to_string().contains("namespaces"), "{err}");
}

const CHILD_ENV: &str = "LODGER_TEST_PROCEVENTS_CHILD";

/// Run by `a_subscription_from_another_pid_namespace_is_refused` inside a new pid
/// namespace: says whether `open` succeeded.
#[test]
#[ignore = "run by a_subscription_from_another_pid_namespace_is_refused in a child pid namespace"]
fn open_in_this_namespace() {
    assert_eq!(
        std::env::var(CHILD_ENV).as_deref(),
        Ok("1"),
        "run by its parent test"
    );
    match ProcEvents::open() {
        Ok(_) => println!("PROCEVENTS: opened"),
        Err(e) => println!("PROCEVENTS: refused: {e}"),
    }
}

/// As root: in a pid namespace of its own (lodgerd in a container) the kernel ignores the
/// subscription, and what the socket receives (other subscribers' events, in the initial
/// namespace's pids, or nothing) must not pass for events: `open` fails with why.
#[test]
fn a_subscription_from_another_pid_namespace_is_refused() {
    const TEST: &str = "a_subscription_from_another_pid_namespace_is_refused";
    if !crate::privileged::need_root(TEST) {
        return;
    }
    // A subscriber of our own in the initial namespace, so that events flow meanwhile. A
    // test host that is itself in a container cannot subscribe at all: that is this test's
    // subject, not its failure.
    let _here = match ProcEvents::open() {
        Ok(p) => p,
        Err(e) => {
            crate::privileged::skip(TEST, &format!("cannot subscribe here either: {e}"));
            return;
        }
    };
    let exe = std::env::current_exe().expect("test binary");
    let out = match std::process::Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(exe)
        .args([
            "--exact",
            "sys::procevents::tests::open_in_this_namespace",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            crate::privileged::skip(TEST, &format!("cannot run unshare(1): {e}"));
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && !stdout.contains("PROCEVENTS:") {
        // unshare itself refused (root without CAP_SYS_ADMIN).
        crate::privileged::skip(TEST, &format!("unshare --pid failed: {stderr}"));
        return;
    }
    assert!(
        stdout.contains("PROCEVENTS: refused") && stdout.contains("namespaces"),
        "open in a child pid namespace: {stdout}\n{stderr}"
    );
}

/// The socket filter, run by the kernel on a Unix datagram socket (same classic BPF, same
/// absolute offsets from the datagram's start): forks, execs and process exits pass; thread
/// exits and other events do not.
#[test]
fn the_filter_keeps_forks_execs_and_process_exits() {
    let (tx, rx) = datagram_pair();
    attach(&rx, &filter()).expect("attach the filter");
    let cases = [
        (event(PROC_EVENT_FORK, &[100, 100, 101, 100]), true),
        (event(PROC_EVENT_FORK, &[100, 100, 200, 200]), true),
        (event(PROC_EVENT_EXEC, &[200, 200]), true),
        (event(PROC_EVENT_EXIT, &[200, 200, 0, 0, 1, 1]), true),
        (event(PROC_EVENT_EXIT, &[101, 100, 0, 0, 1, 1]), false),
        (event(0x0000_0200, &[101, 100]), false), // a rename (PROC_EVENT_COMM)
        (event(0, &[0, 0]), false),               // the subscription's reply
    ];
    let mut buf = [0u8; 256];
    for (i, (datagram, kept)) in cases.iter().enumerate() {
        // SAFETY: the datagram is valid for its length.
        let sent =
            unsafe { libc::send(tx.as_raw_fd(), datagram.as_ptr().cast(), datagram.len(), 0) };
        assert_eq!(sent, datagram.len() as isize, "case {i}");
        // SAFETY: `buf` is valid for writes of its length.
        let got = unsafe { libc::recv(rx.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        assert_eq!(got > 0, *kept, "case {i}: received {got}");
    }
}

/// As root: the kernel reports this test's own child processes, and one drain reads far more
/// events than one `recvmmsg` batch holds (each child is a fork, an exec and an exit)
/// without losing any.
#[test]
fn one_drain_reads_every_batch_of_events() {
    const TEST: &str = "one_drain_reads_every_batch_of_events";
    if !crate::privileged::need_root(TEST) {
        return;
    }
    let mut events = ProcEvents::open().expect("subscribe to process events");
    let mut children = std::collections::HashSet::new();
    for _ in 0..3 * BATCH {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        children.insert(child.id());
        child.wait().expect("wait");
    }
    let mut seen = std::collections::HashSet::new();
    let drained = events
        .drain(|e| {
            seen.extend(e.touched().into_iter().flatten());
        })
        .expect("drain events");
    assert!(!drained.lost, "events were lost");
    assert!(drained.events >= 3 * 3 * BATCH as u64, "{drained:?}");
    let missed: Vec<_> = children.difference(&seen).collect();
    assert!(missed.is_empty(), "no event for children {missed:?}");
}

/// A shell that forks `/bin/true` on each line it reads, and says when it is done: its forks
/// are its own, whatever else the test process forks meanwhile.
struct Forker {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Forker {
    fn start() -> Forker {
        use std::process::{Command, Stdio};
        let mut child = Command::new("sh")
            .args(["-c", "while read x; do /bin/true; echo done; done"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        Forker {
            child,
            stdin,
            stdout,
        }
    }

    fn fork(&mut self) {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "go").expect("the shell listens");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("the shell answers");
        assert_eq!(line.trim(), "done");
    }
}

impl Drop for Forker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The processes `events` reports forked by `parent`, and what the drain found.
fn forked_by(events: &mut ProcEvents, parent: u32) -> (Drained, Vec<u32>) {
    let mut kids = Vec::new();
    let d = events
        .drain(|e| {
            if let Event::Fork {
                parent_tgid,
                child_pid,
                child_tgid,
            } = e
            {
                if parent_tgid == parent && child_pid == child_tgid {
                    kids.push(child_tgid);
                }
            }
        })
        .expect("drain");
    (d, kids)
}

/// The watch map's size in these tests: filling lodgerd's own (65,536) took memory and time
/// from the tests running beside them.
const SMALL: u32 = 64;

/// Fills `events`'s watch map until the kernel takes no more (E2BIG), with pids above any
/// `pid_max` (no process of the node's); through the watch itself, so the refusal does not
/// undo it. The kernel's count decides, not lodger's own: a Debian 12 guest (Linux 6.1, 4
/// CPUs) took one entry more than the map's size.
fn fill(events: &mut ProcEvents) {
    let now = Instant::now();
    let watch = events.watch.as_mut().expect("watching");
    let mut fake = 1u32 << 30;
    loop {
        match watch.watch(fake, now) {
            Ok(true) => fake += 1,
            Ok(false) => panic!("{fake} watched twice"),
            Err(e) if e.raw_os_error() == Some(libc::E2BIG) => return,
            Err(e) => panic!("watch {fake}: {e}"),
        }
        assert!(fake < (1 << 30) + 2 * SMALL, "the map never filled");
    }
}

/// As root, where eBPF loads: a watched process's forks are reported and others' are not; once
/// the kernel's map is full, a fork whose child the program cannot watch is read as events
/// lost, a process lodger cannot watch is an error, and either way every process's events pass
/// until the watch is loaded again, with an empty map, `REWATCH_AFTER` later.
#[test]
fn a_full_watch_map_is_read_as_events_lost_and_every_event_passes_after() {
    const TEST: &str = "a_full_watch_map_is_read_as_events_lost_and_every_event_passes_after";
    if !crate::privileged::need_root(TEST) {
        return;
    }
    let mut events = ProcEvents::open().expect("subscribe to process events");
    if let Err(e) = events.watch_jobs_holding(SMALL) {
        crate::privileged::skip(TEST, &format!("cannot load the eBPF filter: {e}"));
        return;
    }
    let mut sh = Forker::start();
    let pid = sh.child.id();
    sh.fork();
    let (d, kids) = forked_by(&mut events, pid);
    assert!(kids.is_empty(), "reported unwatched: {d:?}");
    assert!(events.watch(pid, Instant::now()).expect("watch the shell"));
    sh.fork();
    let (d, kids) = forked_by(&mut events, pid);
    assert_eq!(kids.len(), 1, "{d:?}");
    assert!(!d.lost);
    // The map full (the shell and its child in it): the next child cannot be watched.
    fill(&mut events);
    sh.fork();
    let (d, kids) = forked_by(&mut events, pid);
    assert!(d.lost && d.unwatched && !d.cut, "{d:?}");
    assert_eq!(
        kids.len(),
        1,
        "the fork the map had no room for is read whole"
    );
    assert!(!Source::watching(&events), "still watching");
    // Every process's events now, for a while.
    assert!(
        events
            .rewatch
            .is_some_and(|at| at > Instant::now() + REWATCH_AFTER / 2),
        "no new watch planned: {:?}",
        events.rewatch
    );
    sh.fork();
    let (d, kids) = forked_by(&mut events, pid);
    assert_eq!(kids.len(), 1);
    assert!(!d.rewatched && !Source::watching(&events));
    // Its time come, the watch is loaded again with an empty map: nothing passes until the
    // shell is watched again, and its forks then.
    events.rewatch = Some(Instant::now());
    let (d, _) = forked_by(&mut events, pid);
    assert!(d.rewatched && Source::watching(&events), "{d:?}");
    assert!(events.rewatch.is_none());
    sh.fork();
    assert!(
        forked_by(&mut events, pid).1.is_empty(),
        "the new map holds nothing"
    );
    assert!(events
        .watch(pid, Instant::now())
        .expect("watch the shell again"));
    sh.fork();
    assert_eq!(forked_by(&mut events, pid).1.len(), 1);
    // Full again soon after: the next load waits twice as long.
    fill(&mut events);
    sh.fork();
    assert!(forked_by(&mut events, pid).0.unwatched);
    assert!(
        events
            .rewatch
            .is_some_and(|at| at > Instant::now() + REWATCH_AFTER * 3 / 2),
        "the wait did not grow: {:?}",
        events.rewatch
    );
    // Undone on purpose, the watch stays off.
    events.unwatch().expect("unwatch");
    assert!(events.rewatch.is_none());

    // The same full map met by lodger's own watch: an error, and every event passes.
    let mut events = ProcEvents::open().expect("subscribe to process events");
    events
        .watch_jobs_holding(SMALL)
        .expect("the filter loaded a moment ago");
    fill(&mut events);
    assert!(events.watch(pid, Instant::now()).is_err());
    assert!(!Source::watching(&events));
    assert!(events.rewatch.is_some(), "no new watch planned");
    sh.fork();
    assert_eq!(forked_by(&mut events, pid).1.len(), 1);
}

/// A lodger socket whose map is full leaves every other listener's events whole: the
/// connector hands the first listener's filter its own buffer, so a filter that cut a fork
/// short cut it for the sockets subscribed before it too (the VM suite's safety-net test read
/// another test's cut forks as its own map full). Both kinds of listener are subscribed before
/// the full one, where a cut reached them.
#[test]
fn a_full_watch_map_leaves_other_listeners_events_whole() {
    const TEST: &str = "a_full_watch_map_leaves_other_listeners_events_whole";
    if !crate::privileged::need_root(TEST) {
        return;
    }
    let mut every = ProcEvents::open().expect("subscribe to process events");
    let mut narrow = ProcEvents::open().expect("subscribe to process events");
    if let Err(e) = narrow.watch_jobs_holding(SMALL) {
        crate::privileged::skip(TEST, &format!("cannot load the eBPF filter: {e}"));
        return;
    }
    let mut full = ProcEvents::open().expect("subscribe to process events");
    full.watch_jobs_holding(SMALL)
        .expect("the filter loaded a moment ago");
    let mut sh = Forker::start();
    let pid = sh.child.id();
    assert!(full.watch(pid, Instant::now()).expect("watch the shell"));
    fill(&mut full);
    for _ in 0..3 {
        sh.fork();
    }
    let (d, kids) = forked_by(&mut full, pid);
    assert!(d.unwatched && kids.len() == 3, "{d:?} {kids:?}");
    let (d, kids) = forked_by(&mut every, pid);
    assert!(!d.cut && !d.lost, "every event read: {d:?}");
    assert_eq!(kids.len(), 3, "every event read");
    let (d, kids) = forked_by(&mut narrow, pid);
    assert!(
        !d.cut && !d.lost && !d.unwatched,
        "a watch of nothing: {d:?}"
    );
    assert!(kids.is_empty(), "a watch of nothing read {kids:?}");
    assert!(Source::watching(&narrow));
}
