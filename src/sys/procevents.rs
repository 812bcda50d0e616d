//! The kernel's process events: the netlink proc connector (`linux/cn_proc.h`), which reports
//! every fork (a new process or a new thread), exec and exit on the node. Read without blocking,
//! as the processes they touch. A socket filter (`filter`) lets only forks, execs and the exits
//! of whole processes through: a thread's exit, a rename and the rest wake nobody. Touches one
//! netlink socket and nothing else.
//!
//! Why by hand: no maintained crate wraps it (the `cnproc` crate reads one event per blocking
//! call and is unmaintained); the protocol is three fixed C structs, defined below from the
//! kernel's UAPI headers (`linux/netlink.h`, `linux/connector.h`, `linux/cn_proc.h`).
//!
//! Subscribing needs CAP_NET_ADMIN before Linux 6.6, and the initial pid and user namespaces
//! always: the kernel reports pids as the initial namespace sees them, and ignores a subscription
//! from any other namespace (a container) without a word. Its answer to a subscription is an
//! acknowledgement, and [`ProcEvents::open`] waits for it ([`CONFIRM_WITHIN`]): without one, or
//! with a refusal, it fails and the caller sweeps /proc every tick as before. A socket whose
//! subscription the kernel ignored still receives other subscribers' events (in another
//! namespace's pids) or none at all. Events are lost when the socket's buffer overflows between
//! reads (a fork storm): [`Drained::lost`] says so, and the caller must then treat every process
//! as touched.
//!
//! [`ProcEvents::watch_jobs`] narrows what passes to the processes the caller watches and the
//! children they fork (`sys::procwatch`, an eBPF filter), so that a node forking outside every
//! job costs lodgerd nothing; where eBPF is not to be had, every process's events are read.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use super::procwatch::{Watch, CN_MSG_HDR, NLMSG_HDR};
use super::set_option;

/// `struct proc_event`: `what` (u32), `cpu` (u32), `timestamp_ns` (u64), then the union.
const EVENT_DATA: usize = 16;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
/// `PROC_EVENT_NONE`: the kernel's acknowledgement of a subscription, its error in `ack.err`.
const PROC_EVENT_NONE: u32 = 0;
const PROC_EVENT_FORK: u32 = 0x0000_0001;
const PROC_EVENT_EXEC: u32 = 0x0000_0002;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// `SO_ATTACH_FILTER` (`asm-generic/socket.h`; the libc crate defines it only for Android).
const SO_ATTACH_FILTER: libc::c_int = 26;
/// Datagrams read by one `recvmmsg`, and the room for each: an event is 16 + 20 + 40 bytes
/// (`nlmsghdr`, `cn_msg`, `proc_event`); a longer datagram is truncated and its event skipped.
const BATCH: usize = 64;
const DATAGRAM: usize = 256;
/// Asked for (root may exceed `net.core.rmem_max`): about a thousand events between two reads.
const RECV_BUFFER: libc::c_int = 1 << 20;
/// How long after the watch was lost ([`Drained::unwatched`]) it is loaded again, with a new,
/// empty map: a job that filled the map may have ended, and a refused entry may have been the
/// kernel short of memory for a moment. Until then every process's events are read, as
/// without eBPF. Lost again within [`REWATCH_HELD`], the wait doubles, up to
/// [`REWATCH_AFTER_MOST`]: a job that keeps filling the map is not met with a new map (and two
/// log lines) every minute and a half.
pub const REWATCH_AFTER: Duration = Duration::from_secs(60);
pub const REWATCH_AFTER_MOST: Duration = Duration::from_secs(64 * 60);
/// A watch that held this long was not lost to the same cause as the one before it.
pub const REWATCH_HELD: Duration = Duration::from_secs(10 * 60);
/// How long [`ProcEvents::open`] waits for the kernel to acknowledge the subscription. The
/// kernel answers while handling the request, so the answer is there at once; it never comes
/// where the kernel ignores the request (another pid or user namespace).
pub const CONFIRM_WITHIN: Duration = Duration::from_secs(1);

/// One process event, as [`ProcEvents::drain`] hands it on (pids as the initial pid namespace
/// sees them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A new task: a process when `child_pid == child_tgid`, else a thread of `child_tgid`.
    /// `parent_tgid` is the new task's real parent's process, the `ppid` /proc shows for it (a
    /// thread's is its process's parent, as the kernel's `real_parent`).
    Fork {
        parent_tgid: u32,
        child_pid: u32,
        child_tgid: u32,
    },
    Exec {
        tgid: u32,
    },
    /// A task's exit: a process's when `pid == tgid` (the filter drops the other threads', but
    /// events queued before it was attached may hold some). Reported after the kernel gave the
    /// task's children to their new parent (`exit_notify` runs before the connector is told).
    Exit {
        pid: u32,
        tgid: u32,
    },
}

impl Event {
    /// The processes the event touched: both sides of a fork (the parent's process and the
    /// child's, the same process for a thread of the parent's), the process of an exec or exit.
    pub fn touched(&self) -> [Option<u32>; 2] {
        match *self {
            Event::Fork {
                parent_tgid,
                child_tgid,
                ..
            } => [Some(parent_tgid), Some(child_tgid)],
            Event::Exec { tgid } | Event::Exit { tgid, .. } => [Some(tgid), None],
        }
    }
}

/// What one drain found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    pub events: u64,
    /// The socket overflowed: some events since the last drain are gone.
    pub lost: bool,
    /// The kernel's map of watched processes was full: every process's events pass
    /// ([`ProcEvents::watch_jobs`] undone) until [`REWATCH_AFTER`], and `lost` is set.
    pub unwatched: bool,
    /// A datagram arrived shorter than its header says (another listener's filter cut it for
    /// every listener: `sys::procwatch`'s module doc): an event is unread, and `lost` is set.
    pub cut: bool,
    /// The watch, lost [`REWATCH_AFTER`] or more ago, is loaded again with an empty map: from
    /// now on only watched processes' events pass, and none is watched yet.
    pub rewatched: bool,
}

/// Where a reader of process events gets them: the kernel's connector ([`ProcEvents`]), or in
/// a unit test a script of events and losses (overflowing the socket on demand is unreliable,
/// so what a caller does with [`Drained::lost`] is tested against a script).
pub trait Source: std::fmt::Debug + Send {
    /// Reads every pending event and calls `on` for each, in order; never blocks. As
    /// [`ProcEvents::drain`].
    fn drain(&mut self, on: &mut dyn FnMut(Event)) -> io::Result<Drained>;

    /// Lets process `tgid`'s events (and its new children's) through from now on, seen in a job
    /// at `now`: `Ok(true)` when it was not watched before. Where every process's events pass
    /// (the default), `Ok(false)`. An error means every process's events pass (for a while:
    /// [`REWATCH_AFTER`]).
    fn watch(&mut self, _tgid: u32, _now: Instant) -> io::Result<bool> {
        Ok(false)
    }

    /// Whether only watched processes' events pass.
    fn watching(&self) -> bool {
        false
    }

    /// Lets every process's events through from now on.
    fn unwatch(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Source for ProcEvents {
    fn drain(&mut self, on: &mut dyn FnMut(Event)) -> io::Result<Drained> {
        ProcEvents::drain(self, on)
    }

    fn watch(&mut self, tgid: u32, now: Instant) -> io::Result<bool> {
        ProcEvents::watch(self, tgid, now)
    }

    fn watching(&self) -> bool {
        self.watch.is_some()
    }

    fn unwatch(&mut self) -> io::Result<()> {
        ProcEvents::unwatch(self)
    }
}

/// A subscription to the node's process events.
#[derive(Debug)]
pub struct ProcEvents {
    fd: OwnedFd,
    buf: Vec<u8>,
    /// Only these processes' events pass ([`ProcEvents::watch_jobs`]).
    watch: Option<Watch>,
    /// The size of the watch's map.
    watch_max: u32,
    /// After the watch was lost (its map full, or the kernel refusing an entry): when to load
    /// it again.
    rewatch: Option<Instant>,
    /// The wait before the next load after a loss, and when the watch was last loaded again.
    rewatch_wait: Duration,
    rewatched_at: Option<Instant>,
}

impl ProcEvents {
    /// Opens a non-blocking connector socket and subscribes to process events; fails unless
    /// the kernel acknowledges the subscription within [`CONFIRM_WITHIN`].
    pub fn open() -> io::Result<ProcEvents> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_CONNECTOR,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a socket this function just opened and owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size: libc::c_int = RECV_BUFFER;
        for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            if set_option(&fd, opt, &size).is_ok() {
                break;
            }
        }
        let mut addr = sockaddr(CN_IDX_PROC);
        // SAFETY: `addr` is a valid sockaddr_nl of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of_mut!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let cookie = cookie();
        let listen = listen_message(cookie);
        let kernel = sockaddr(0);
        // SAFETY: the message and the address are valid for the lengths given.
        let sent = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                listen.as_ptr().cast(),
                listen.len(),
                0,
                std::ptr::addr_of!(kernel).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        confirm(&fd, cookie, CONFIRM_WITHIN)?;
        // Only now: the filter drops acknowledgements. Events queued before it are read by the
        // first drain; a thread's exit among them touches its process once, which costs a sweep.
        attach(&fd, &filter())?;
        Ok(ProcEvents {
            fd,
            buf: vec![0; BATCH * DATAGRAM],
            watch: None,
            watch_max: crate::sys::procwatch::MAX_WATCHED,
            rewatch: None,
            rewatch_wait: REWATCH_AFTER,
            rewatched_at: None,
        })
    }

    /// From now on only the events of watched processes ([`ProcEvents::watch`]) and of the
    /// processes they fork pass (`sys::procwatch`): none until the first is watched. Fails where
    /// eBPF cannot be loaded (no CAP_BPF or CAP_SYS_ADMIN, a kernel without it), and every
    /// process's events still pass.
    pub fn watch_jobs(&mut self) -> io::Result<()> {
        self.watch = Some(Watch::attach(&self.fd)?);
        self.watch_max = crate::sys::procwatch::MAX_WATCHED;
        Ok(())
    }

    /// [`ProcEvents::watch_jobs`] with a map of `max` processes (a test fills a small one).
    #[cfg(test)]
    pub(crate) fn watch_jobs_holding(&mut self, max: u32) -> io::Result<()> {
        self.watch = Some(Watch::attach_holding(&self.fd, max)?);
        self.watch_max = max;
        Ok(())
    }

    /// See [`Source::watch`]. On an error (the kernel's map is full) every process's events
    /// pass until the watch is loaded again ([`REWATCH_AFTER`]).
    pub fn watch(&mut self, tgid: u32, now: Instant) -> io::Result<bool> {
        let Some(watch) = &mut self.watch else {
            return Ok(false);
        };
        match watch.watch(tgid, now) {
            Ok(new) => Ok(new),
            Err(e) => {
                self.lose_watch(now)?;
                Err(e)
            }
        }
    }

    /// Lets every process's events through again, for good: the classic filter replaces the
    /// watch.
    pub fn unwatch(&mut self) -> io::Result<()> {
        self.rewatch = None;
        self.watch = None;
        attach(&self.fd, &filter())
    }

    /// The watch could not follow the jobs' processes: every process's events pass, and the
    /// watch is loaded again, with a new map, [`REWATCH_AFTER`] from `now` (or longer: see
    /// there).
    fn lose_watch(&mut self, now: Instant) -> io::Result<()> {
        self.unwatch()?;
        let again_soon = self
            .rewatched_at
            .is_some_and(|at| now.saturating_duration_since(at) < REWATCH_HELD);
        self.rewatch_wait = if again_soon {
            (self.rewatch_wait * 2).min(REWATCH_AFTER_MOST)
        } else {
            REWATCH_AFTER
        };
        self.rewatch = Some(now + self.rewatch_wait);
        Ok(())
    }

    /// Loads the watch again if it was lost and its time has come; true if it was. A failure
    /// tries again after the same wait.
    fn rewatch_if_due(&mut self, now: Instant) -> bool {
        if self.watch.is_some() || !self.rewatch.is_some_and(|at| now >= at) {
            return false;
        }
        match Watch::attach_holding(&self.fd, self.watch_max) {
            Ok(w) => {
                self.watch = Some(w);
                self.rewatch = None;
                self.rewatched_at = Some(now);
                true
            }
            Err(_) => {
                self.rewatch = Some(now + self.rewatch_wait);
                false
            }
        }
    }

    /// Reads every pending event and calls `on` for each, in the kernel's order. Never blocks.
    ///
    /// Up to `BATCH` (64) datagrams a syscall (`recvmmsg`): every process event on the node that
    /// passes the filter is one datagram, and on a node running builds or short-lived jobs a
    /// `recv` each was most of an idle lodgerd's agent thread (issue 21).
    pub fn drain(&mut self, mut on: impl FnMut(Event)) -> io::Result<Drained> {
        let mut out = Drained::default();
        let now = Instant::now();
        let (mut cut, mut forks) = (false, false);
        loop {
            // SAFETY: all-zero is a valid `iovec` and `mmsghdr` (null pointers, zero lengths);
            // each is pointed at its own part of `buf` below.
            let mut iov: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            for (part, (v, m)) in self
                .buf
                .chunks_exact_mut(DATAGRAM)
                .zip(iov.iter_mut().zip(msgs.iter_mut()))
            {
                v.iov_base = part.as_mut_ptr().cast();
                v.iov_len = part.len();
                m.msg_hdr.msg_iov = v;
                m.msg_hdr.msg_iovlen = 1;
            }
            // SAFETY: `msgs` holds BATCH headers, each with one iovec over its own DATAGRAM
            // bytes of `buf`, all alive for the call; no timeout.
            let n = unsafe {
                libc::recvmmsg(
                    self.fd.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    BATCH as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => break,
                    Some(libc::EINTR) => continue,
                    // The kernel dropped events for want of room; reading goes on.
                    Some(libc::ENOBUFS) => {
                        out.lost = true;
                        continue;
                    }
                    _ => return Err(e),
                }
            }
            let received = usize::try_from(n).unwrap_or(0).min(BATCH);
            let (watch, forks) = (&mut self.watch, &mut forks);
            let mut each = |e: Event| {
                // A new process of a watched one: the filter watches it already.
                if let (
                    Some(w),
                    Event::Fork {
                        child_pid,
                        child_tgid,
                        ..
                    },
                ) = (watch.as_mut(), e)
                {
                    if child_pid == child_tgid {
                        w.forked(child_tgid, now);
                        *forks = true;
                    }
                }
                on(e);
            };
            for (m, part) in msgs
                .iter()
                .zip(self.buf.chunks_exact(DATAGRAM))
                .take(received)
            {
                let len = usize::try_from(m.msg_len).unwrap_or(0).min(DATAGRAM);
                let (events, short) = parse(&part[..len], &mut each);
                out.events += events;
                cut |= short;
            }
            if received < BATCH {
                // Fewer than asked: the queue is empty (the next call would say EAGAIN).
                break;
            }
        }
        out.cut = cut;
        out.lost |= cut;
        // A new process read, or events lost: the program may have had no room for one.
        if (forks || out.lost) && self.watch.as_ref().is_some_and(Watch::missed_a_fork) {
            self.lose_watch(now)?;
            out.unwatched = true;
            out.lost = true;
        }
        out.rewatched = self.rewatch_if_due(now);
        if let Some(w) = &mut self.watch {
            if out.lost {
                w.adopt(now);
            }
            w.prune(now);
        }
        Ok(out)
    }
}

/// The classic BPF program the socket runs on each datagram before queueing it: keeps forks,
/// execs and exits where `process_pid == process_tgid` (a process, not one of its threads), drops
/// the rest (thread exits, renames, uid/gid/sid changes, ptrace, the subscription's reply). A
/// busy node forks and ends threads all the time; lodger needs a thread's start (to schedule it)
/// but not its end. Absolute loads read big-endian, so each constant is the host-order value's
/// bytes read that way.
fn filter() -> Vec<libc::sock_filter> {
    const WHAT: u32 = (NLMSG_HDR + CN_MSG_HDR) as u32;
    const PID: u32 = WHAT + EVENT_DATA as u32;
    let be = |v: u32| u32::from_be_bytes(v.to_ne_bytes());
    let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    let load = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
    let jeq = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
    // Jump offsets count from the next instruction: 8 keeps, 9 drops.
    vec![
        /* 0 */ op(load, 0, 0, WHAT),
        /* 1 */ op(jeq, 6, 0, be(PROC_EVENT_FORK)),
        /* 2 */ op(jeq, 5, 0, be(PROC_EVENT_EXEC)),
        /* 3 */ op(jeq, 0, 5, be(PROC_EVENT_EXIT)),
        /* 4 */ op(load, 0, 0, PID),
        /* 5 */ op(libc::BPF_MISC | libc::BPF_TAX, 0, 0, 0),
        /* 6 */ op(load, 0, 0, PID + 4),
        /* 7 */ op(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_X, 0, 1, 0),
        /* 8 */ op(libc::BPF_RET | libc::BPF_K, 0, 0, u32::MAX),
        /* 9 */ op(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
    ]
}

fn attach(fd: &OwnedFd, program: &[libc::sock_filter]) -> io::Result<()> {
    let prog = libc::sock_fprog {
        len: u16::try_from(program.len()).map_err(|_| io::ErrorKind::InvalidInput)?,
        filter: program.as_ptr().cast_mut(),
    };
    // `prog` points at `program`, which outlives the call (the kernel copies it).
    set_option(fd, SO_ATTACH_FILTER, &prog)
}

fn sockaddr(groups: u32) -> libc::sockaddr_nl {
    // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    addr.nl_groups = groups;
    addr
}

/// A value to recognise the kernel's acknowledgement of this socket's subscription by: every
/// subscriber receives every acknowledgement, and the kernel overwrites the sequence number
/// (it answers with `ack` + 1).
fn cookie() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    std::process::id().rotate_left(16) ^ nanos
}

/// Waits up to `within` for the kernel's acknowledgement of the subscription sent with `cookie`:
/// `Ok` when it accepted, its error when it refused, and an error saying why it may never answer
/// when nothing came. Other datagrams (events, other subscribers' acknowledgements) are dropped.
fn confirm(fd: &OwnedFd, cookie: u32, within: Duration) -> io::Result<()> {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; DATAGRAM];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the kernel did not acknowledge the subscription within {} ms: lodgerd is \
                     not in the initial pid and user namespaces (a container), or lacks \
                     CAP_NET_ADMIN on a kernel before 6.6",
                    within.as_millis()
                ),
            ));
        }
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd, for the length given.
        if unsafe { libc::poll(&mut pfd, 1, ms) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Nothing yet, or events dropped before the answer: wait on.
                Some(libc::EAGAIN | libc::EINTR | libc::ENOBUFS) => continue,
                _ => return Err(e),
            }
        }
        let len = usize::try_from(n).unwrap_or(0).min(buf.len());
        match acknowledgement(&buf[..len], cookie) {
            Some(0) => return Ok(()),
            Some(err) => {
                return Err(io::Error::new(
                    io::Error::from_raw_os_error(err).kind(),
                    format!(
                        "the kernel refused the subscription ({})",
                        io::Error::from_raw_os_error(err)
                    ),
                ))
            }
            None => {}
        }
    }
}

/// The error the kernel's acknowledgement of the subscription sent with `cookie` carries (0:
/// accepted), if `datagram` holds it.
fn acknowledgement(datagram: &[u8], cookie: u32) -> Option<i32> {
    let mut at = 0;
    while let Some(len) = u32_at(datagram, at).and_then(|l| usize::try_from(l).ok()) {
        if len < NLMSG_HDR || at + len > datagram.len() {
            return None;
        }
        let msg = &datagram[at..at + len];
        let ev = NLMSG_HDR + CN_MSG_HDR;
        if u32_at(msg, NLMSG_HDR) == Some(CN_IDX_PROC)
            && u32_at(msg, NLMSG_HDR + 12) == Some(cookie.wrapping_add(1))
            && u32_at(msg, ev) == Some(PROC_EVENT_NONE)
        {
            let err = u32_at(msg, ev + EVENT_DATA)?;
            return Some(i32::from_ne_bytes(err.to_ne_bytes()));
        }
        at += (len + 3) & !3;
    }
    None
}

/// nlmsghdr + cn_msg + `PROC_CN_MCAST_LISTEN`, in native byte order as netlink wants; the
/// kernel's acknowledgement carries `cookie` + 1.
fn listen_message(cookie: u32) -> Vec<u8> {
    let total = NLMSG_HDR + CN_MSG_HDR + 4;
    let mut m = Vec::with_capacity(total);
    m.extend_from_slice(&(total as u32).to_ne_bytes());
    m.extend_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
    m.extend_from_slice(&0u16.to_ne_bytes()); // flags
    m.extend_from_slice(&0u32.to_ne_bytes()); // seq
    m.extend_from_slice(&std::process::id().to_ne_bytes()); // port
    m.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
    m.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // seq
    m.extend_from_slice(&cookie.to_ne_bytes()); // ack
    m.extend_from_slice(&4u16.to_ne_bytes()); // len of the payload
    m.extend_from_slice(&0u16.to_ne_bytes()); // flags
    m.extend_from_slice(&PROC_CN_MCAST_LISTEN.to_ne_bytes());
    m
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let bytes = b.get(at..at + 4)?;
    Some(u32::from_ne_bytes(bytes.try_into().ok()?))
}

/// Walks the netlink messages of one datagram; returns how many process events it held, and
/// whether a message was cut short (shorter than its header says: a socket filter cut it, and
/// the event in it cannot be read).
fn parse(datagram: &[u8], on: &mut impl FnMut(Event)) -> (u64, bool) {
    let mut events = 0;
    let mut at = 0;
    while let Some(len) = u32_at(datagram, at).and_then(|l| usize::try_from(l).ok()) {
        if len < NLMSG_HDR || at + len > datagram.len() {
            return (events, len >= NLMSG_HDR);
        }
        let msg = &datagram[at..at + len];
        let idx = u32_at(msg, NLMSG_HDR);
        let ev = NLMSG_HDR + CN_MSG_HDR;
        if idx == Some(CN_IDX_PROC) {
            if let Some(what) = u32_at(msg, ev) {
                events += 1;
                let data = ev + EVENT_DATA;
                let field = |i: usize| u32_at(msg, data + 4 * i);
                let event = match what {
                    // parent_pid, parent_tgid, child_pid, child_tgid
                    PROC_EVENT_FORK => match (field(1), field(2), field(3)) {
                        (Some(parent_tgid), Some(child_pid), Some(child_tgid)) => {
                            Some(Event::Fork {
                                parent_tgid,
                                child_pid,
                                child_tgid,
                            })
                        }
                        _ => None,
                    },
                    // process_pid, process_tgid, ...
                    PROC_EVENT_EXEC => field(1).map(|tgid| Event::Exec { tgid }),
                    PROC_EVENT_EXIT => match (field(0), field(1)) {
                        (Some(pid), Some(tgid)) => Some(Event::Exit { pid, tgid }),
                        _ => None,
                    },
                    _ => None,
                };
                if let Some(event) = event {
                    on(event);
                }
            }
        }
        // NLMSG_ALIGN: messages start on 4-byte boundaries.
        at += (len + 3) & !3;
    }
    (events, false)
}

#[cfg(test)]
#[path = "procevents_tests.rs"]
pub(crate) mod tests;
