//! The watch filter, run by the kernel on a Unix datagram socket (the same program, the same
//! offsets from the datagram's start) fed crafted events: what passes, what the program watches
//! by itself, what lodger unwatches, and a full map. Root: loading eBPF needs CAP_BPF.

use super::*;
use crate::sys::procevents::tests::{datagram_pair, event};

const EV_FORK: u32 = 0x0000_0001;
const EV_EXEC: u32 = 0x0000_0002;
const EV_EXIT: u32 = 0x8000_0000;
const EV_COMM: u32 = 0x0000_0200;

struct Pair {
    tx: OwnedFd,
    rx: OwnedFd,
    watch: Watch,
}

impl Pair {
    fn new(test: &str) -> Option<Pair> {
        Pair::holding(test, MAX_WATCHED)
    }

    fn holding(test: &str, max: u32) -> Option<Pair> {
        if !crate::privileged::need_root(test) {
            return None;
        }
        let (tx, rx) = datagram_pair();
        match Watch::attach_holding(&rx, max) {
            Ok(watch) => Some(Pair { tx, rx, watch }),
            Err(e) => {
                crate::privileged::skip(test, &format!("cannot load the eBPF filter: {e}"));
                None
            }
        }
    }

    /// Sends `datagram`; the length lodger receives, `None` when the filter dropped it.
    fn pass(&self, datagram: &[u8]) -> Option<usize> {
        // SAFETY: the datagram is valid for its length.
        let sent = unsafe {
            libc::send(
                self.tx.as_raw_fd(),
                datagram.as_ptr().cast(),
                datagram.len(),
                0,
            )
        };
        assert_eq!(sent, datagram.len() as isize, "send");
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is valid for writes of its length.
        let got = unsafe {
            libc::recv(
                self.rx.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        usize::try_from(got).ok()
    }

    fn passes(&self, what: u32, data: &[u32]) -> bool {
        self.pass(&full(what, data)).is_some()
    }
}

/// An event as long as the kernel sends every one, whatever its kind: the union's whole 24
/// bytes (an exit's six u32), `data` first.
fn full(what: u32, data: &[u32]) -> Vec<u8> {
    let mut six = [0u32; 6];
    for (s, d) in six.iter_mut().zip(data) {
        *s = *d;
    }
    event(what, &six)
}

/// fork: parent pid, parent tgid, child pid, child tgid; exec: pid, tgid; exit: pid, tgid,
/// code, signal, parent pid, parent tgid.
#[test]
fn only_watched_processes_and_the_children_they_fork_pass() {
    let Some(mut p) = Pair::new("only_watched_processes_and_the_children_they_fork_pass") else {
        return;
    };
    let now = Instant::now();
    // Nothing watched: nothing passes.
    assert!(!p.passes(EV_FORK, &[100, 100, 200, 200]));
    assert!(!p.passes(EV_EXEC, &[100, 100]));
    assert!(!p.passes(EV_EXIT, &[100, 100, 0, 0, 1, 1]));
    // A child forked while its parent was not watched is not watched later either.
    assert!(!p.passes(EV_EXEC, &[200, 200]));

    assert!(p.watch.watch(100, now).expect("watch"));
    assert!(
        !p.watch.watch(100, now).expect("watch again"),
        "already watched"
    );
    assert!(p.passes(EV_EXEC, &[100, 100]));
    // A new thread: its parent is its process's parent.
    assert!(p.passes(EV_FORK, &[1, 1, 101, 100]), "a new thread");
    assert!(
        !p.passes(EV_EXIT, &[101, 100, 0, 0, 1, 1]),
        "a thread's exit"
    );
    assert!(!p.passes(EV_COMM, &[101, 100]), "a rename");
    assert!(!p.passes(0, &[0, 0]), "a subscription's reply");
    // A new process of a watched one is watched by the program, and so are its own children,
    // with no word from lodger.
    assert!(p.passes(EV_FORK, &[101, 100, 300, 300]));
    assert!(p.passes(EV_EXEC, &[300, 300]));
    assert!(p.passes(EV_FORK, &[300, 300, 400, 400]));
    assert!(p.passes(EV_FORK, &[300, 300, 401, 400]));
    assert!(p.passes(EV_EXIT, &[400, 400, 0, 0, 300, 300]));
    // The leader's exit passes and leaves the process watched: a thread's execve ends the
    // leader first and goes on under its pid.
    assert!(p.passes(EV_EXIT, &[100, 100, 0, 0, 1, 1]));
    assert!(p.passes(EV_EXEC, &[100, 100]));
    // Processes outside, their children and threads, even a thread whose process's parent is
    // watched (a child forked before its parent was watched: lodger walks to it).
    assert!(!p.passes(EV_FORK, &[500, 500, 501, 501]));
    assert!(!p.passes(EV_FORK, &[500, 500, 502, 501]));
    assert!(!p.passes(EV_FORK, &[100, 100, 503, 501]));
    assert!(!p.passes(EV_EXEC, &[501, 501]));
    assert!(!p.passes(EV_EXIT, &[501, 501, 0, 0, 500, 500]));
    // Too short to read as an event: passed on for lodger to skip.
    assert!(p.pass(&[0u8; 20]).is_some());
    assert!(p.pass(&event(EV_EXEC, &[501, 501])).is_some());
    // Lodger knows of what it watched and of what it read forked.
    p.watch.forked(300, now);
    assert!(p.watch.watches(100) && p.watch.watches(300) && !p.watch.watches(400));
}

#[test]
fn a_process_no_sweep_saw_for_the_forget_time_is_unwatched_and_adopted_ones_too() {
    let Some(mut p) =
        Pair::new("a_process_no_sweep_saw_for_the_forget_time_is_unwatched_and_adopted_ones_too")
    else {
        return;
    };
    let t0 = Instant::now();
    p.watch.watch(100, t0).expect("watch 100");
    p.watch.watch(110, t0).expect("watch 110");
    // 200 is watched by the program; its fork was not read (events lost, say).
    assert!(p.passes(EV_FORK, &[100, 100, 200, 200]));
    p.watch.adopt(t0 + Duration::from_secs(5));
    assert!(p.watch.watches(200), "adopted from the map");
    assert_eq!(p.watch.len(), 3);
    // 110 is seen by a sweep later; 100 is not.
    p.watch.watch(110, t0 + FORGET_AFTER).expect("seen again");
    p.watch.prune(t0 + FORGET_AFTER + Duration::from_secs(1));
    assert!(
        !p.passes(EV_EXEC, &[100, 100]),
        "100 was not seen for the forget time"
    );
    assert!(
        p.passes(EV_EXEC, &[200, 200]),
        "200 was adopted 5 s later: not yet"
    );
    assert!(p.passes(EV_EXEC, &[110, 110]));
    // 200 falls due at 5 s past the forget time; a prune within a second of the last does
    // nothing.
    p.watch
        .prune(t0 + FORGET_AFTER + Duration::from_millis(4_900));
    assert!(p.passes(EV_EXEC, &[200, 200]));
    p.watch
        .prune(t0 + FORGET_AFTER + Duration::from_millis(5_500));
    assert!(p.passes(EV_EXEC, &[200, 200]));
    p.watch.prune(t0 + FORGET_AFTER + Duration::from_secs(7));
    assert!(!p.passes(EV_EXEC, &[200, 200]));
    assert!(p.passes(EV_EXEC, &[110, 110]));
    assert_eq!(p.watch.len(), 1);
    // Watched again: new to the map.
    assert!(p
        .watch
        .watch(100, t0 + FORGET_AFTER * 2)
        .expect("watch again"));
    assert!(p.passes(EV_EXEC, &[100, 100]));
}

/// A fork whose child the full map has no room for passes whole (a cut would reach every
/// listener: see the module doc), and the program sets the flag lodger reads.
#[test]
fn a_fork_the_full_map_cannot_watch_passes_whole_and_sets_the_flag() {
    const TEST: &str = "a_fork_the_full_map_cannot_watch_passes_whole_and_sets_the_flag";
    // A small map: filling lodgerd's own (65,536) took memory and time from the tests beside.
    let Some(mut p) = Pair::holding(TEST, 64) else {
        return;
    };
    let now = Instant::now();
    // Until the kernel says it is full: its count, not lodger's, decides (Linux 6.1 on 4 CPUs
    // took one more than the map's size).
    let mut tgid = 1;
    while p.watch.watch(tgid, now).is_ok() {
        tgid += 1;
        assert!(tgid < 1_000, "the map never filled");
    }
    assert!(p.watch.len() >= 64, "refused at {}", p.watch.len());
    // A thread needs no room.
    let thread = full(EV_FORK, &[1, 1, 8, 7]);
    assert_eq!(p.pass(&thread), Some(thread.len()));
    // Nor does an exec.
    assert!(p.passes(EV_EXEC, &[7, 7]));
    assert!(
        !p.watch.missed_a_fork(),
        "flagged before any fork was missed"
    );
    let fork = full(EV_FORK, &[7, 7, 1_000_000, 1_000_000]);
    assert_eq!(p.pass(&fork), Some(fork.len()), "cut or dropped");
    assert!(p.watch.missed_a_fork(), "the missed fork is not flagged");
    assert!(
        !p.passes(EV_EXEC, &[1_000_000, 1_000_000]),
        "watched after all"
    );
}

#[test]
fn every_jump_lands_inside_the_program() {
    let code = program(3, 4);
    for (at, insn) in code.iter().enumerate() {
        let class = insn.code & 0x07;
        let is_jump = (class == 0x05 || class == 0x06) && insn.code != CALL && insn.code != EXIT;
        if is_jump {
            let to = at as i64 + 1 + i64::from(insn.off);
            assert!(
                to > at as i64 && (to as usize) < code.len(),
                "instruction {at} jumps to {to} of {}",
                code.len()
            );
        }
    }
    assert_eq!(code.last().map(|i| i.code), Some(EXIT));
}
