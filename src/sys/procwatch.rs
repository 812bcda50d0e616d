//! The kernel side of watching only lodger's own processes (issue 21 item 2): an eBPF socket
//! filter on the proc connector's socket (`sys::procevents`) that lets through the events of
//! the processes in a kernel map (lodger's jobs' processes) and drops every other process's, and
//! that adds a watched process's new child to the map itself, in the forking task's context,
//! before the child can run, so no fork inside a job outruns it. Touches the `bpf(2)` syscall
//! (a hash map and a program) and the socket it is attached to.
//!
//! Why: on a node that forks all the time outside every job (a CI runner, a build beside the
//! GPUs), every fork, exec and exit on the node was a datagram lodgerd's agent thread read
//! (`scripts/bench-spine`, the busy node: 2.3-2.5 µs of lodgerd's CPU per process created
//! outside every job, most of it the kernel handing over the datagrams). A filter that knows
//! only a fixed list of pids would miss a job's child forked before lodgerd could add it, and
//! that child's own children; this one follows the job's tree as it grows, so what passes is
//! exactly the events of processes descended from a watched one.
//!
//! Why by hand: the program is a few dozen instructions, and the crates that load eBPF (aya,
//! libbpf-rs) load it from an ELF object built by an eBPF toolchain (bpf-linker or clang) that
//! the build would then need. `bpf(2)`'s attributes and the instruction encoding below are
//! written from the kernel's UAPI header (`linux/bpf.h`).
//!
//! What the map holds is a superset of what lodger needs, never less: an entry is added for
//! every process lodger sweeps as a job's ([`Watch::watch`]) and by the program for every new
//! process whose parent's process is in it, and removed only when lodger has not seen the
//! process in a job for [`FORGET_AFTER`] ([`Watch::prune`]): not at its exit, since a thread's
//! `execve` ends the leader first (an exit event for the pid) and goes on under the same pid.
//! A pid reused by another program meanwhile lets that program's events through, which lodger
//! takes as it takes any process's events. When the map is full the program cannot watch a new
//! child: it passes the fork whole and sets a flag in a second, one-entry map, which lodger
//! reads after a drain that saw a new process ([`Watch::missed_a_fork`]) and answers by reading
//! every process's events for a minute (`procevents::REWATCH_AFTER`), then loading the program
//! again with a new map, whose entries the jobs' next sweeps add.
//!
//! The program never cuts a datagram short, though a socket filter may (its return value is
//! the length kept). The connector broadcasts each event to every listener, and for the first
//! one the kernel hands the filter the broadcast's own buffer rather than a copy
//! (`do_one_broadcast` in `net/netlink/af_netlink.c` takes a reference while nobody else holds
//! one): a length cut there is the length every later listener gets, whatever its own filter
//! says. The first version marked a full map by passing the fork cut to its headers, and in
//! the VM suite another test's lodger socket, subscribed before it, read those forks cut short
//! and took its own map for full. Two connector sockets show it, the later one with a classic
//! filter that returns 40: the earlier one gets 40-byte datagrams. A datagram that still
//! arrives cut short (another program's filter) is read as events lost.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// A connector datagram's headers before its `struct proc_event`, which the program reads
/// and `procevents` parses: `struct nlmsghdr`, 16 bytes.
pub(super) const NLMSG_HDR: usize = 16;
/// `struct cn_msg` without its payload: `cb_id` (idx, val), seq, ack, len (u16), flags (u16).
pub(super) const CN_MSG_HDR: usize = 20;

/// How many processes the map holds. An entry costs the kernel about 80 bytes (allocated as it
/// is added: `BPF_F_NO_PREALLOC`); a node's jobs have far fewer processes, but a job forking
/// short-lived children keeps [`FORGET_AFTER`]'s worth of the ended ones in it.
pub const MAX_WATCHED: u32 = 65_536;
/// A process lodger has not seen in any job's sweep for this long leaves the map. Every job is
/// swept at least once per `quiet::FULL_SWEEP_EVERY` (10 s), so three times that leaves room
/// for slow ticks without dropping a process a job still has (which a sweep would watch again,
/// walking its tree).
pub const FORGET_AFTER: Duration = Duration::from_secs(30);

/// Where `struct proc_event` starts, and how much of it the program reads: `what`, `cpu`,
/// `timestamp_ns`, then the first four u32 of the union (fork: parent pid and tgid, child pid
/// and tgid; exec and exit: pid, tgid, ...). Every event is as long as the whole union.
const EVENT_AT: i32 = (NLMSG_HDR + CN_MSG_HDR) as i32;
const EVENT_READ: i32 = 32;
const PROC_EVENT_FORK: i32 = 0x0000_0001;
const PROC_EVENT_EXEC: i32 = 0x0000_0002;
/// `PROC_EVENT_EXIT` (0x8000_0000), as the 32-bit immediate the program compares with.
const PROC_EVENT_EXIT: i32 = i32::MIN;

// bpf(2) commands, map and program types, helpers (`linux/bpf.h`).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;
const BPF_ANY: u64 = 0;
const HELPER_MAP_LOOKUP_ELEM: i32 = 1;
const HELPER_MAP_UPDATE_ELEM: i32 = 2;
const HELPER_SKB_LOAD_BYTES: i32 = 26;
/// `SO_ATTACH_BPF` (`asm-generic/socket.h`; the libc crate defines it only for some targets).
const SO_ATTACH_BPF: libc::c_int = 50;

/// `union bpf_attr` for `BPF_MAP_CREATE`, up to the map's name.
#[repr(C)]
#[derive(Default)]
struct MapCreate {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

/// `union bpf_attr` for the element commands.
#[repr(C)]
#[derive(Default)]
struct MapElem {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `union bpf_attr` for `BPF_PROG_LOAD`, up to the program's name.
#[repr(C)]
#[derive(Default)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// `struct bpf_insn`: opcode, destination register in the low nibble and source in the high
/// one, offset, immediate.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a repr(C) prefix of `union bpf_attr` for `cmd`, valid for its size; the
    // kernel reads (and for some commands writes) no more than that size.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

fn owned(rc: libc::c_long) -> io::Result<OwnedFd> {
    let raw = libc::c_int::try_from(rc).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: `raw` is a descriptor the kernel just returned to this process, owned by nobody
    // else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn name(s: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (o, b) in out.iter_mut().zip(s.bytes().take(15)) {
        *o = b;
    }
    out
}

/// The processes whose events pass, in the kernel and as lodger last confirmed them.
#[derive(Debug)]
pub struct Watch {
    map: OwnedFd,
    /// One u32 the program sets when it could not add a watched process's new child.
    missed: OwnedFd,
    /// How many processes the map holds.
    max: u32,
    /// Each watched process and when lodger last saw it in a job (or learnt of its fork).
    seen: HashMap<u32, Instant>,
    pruned: Option<Instant>,
}

impl Watch {
    /// Creates the map and loads the program; attaches it to `socket`, replacing any filter
    /// there. Fails where the kernel has no eBPF or lodgerd may not use it (no CAP_BPF or
    /// CAP_SYS_ADMIN: a container), or refuses the program.
    pub fn attach(socket: &OwnedFd) -> io::Result<Watch> {
        Watch::attach_holding(socket, MAX_WATCHED)
    }

    /// [`Watch::attach`] with a map of `max` processes (the tests fill a small one).
    pub fn attach_holding(socket: &OwnedFd, max: u32) -> io::Result<Watch> {
        let mut create = MapCreate {
            map_type: BPF_MAP_TYPE_HASH,
            key_size: 4,
            value_size: 4,
            max_entries: max,
            map_flags: BPF_F_NO_PREALLOC,
            map_name: name("lodger_watch"),
            ..MapCreate::default()
        };
        let map = owned(bpf(BPF_MAP_CREATE, &mut create)?)?;
        let mut flag = MapCreate {
            map_type: BPF_MAP_TYPE_ARRAY,
            key_size: 4,
            value_size: 4,
            max_entries: 1,
            map_name: name("lodger_missed"),
            ..MapCreate::default()
        };
        let missed = owned(bpf(BPF_MAP_CREATE, &mut flag)?)?;
        let prog = load(&program(map.as_raw_fd(), missed.as_raw_fd()))?;
        let fd: libc::c_int = prog.as_raw_fd();
        super::set_option(socket, SO_ATTACH_BPF, &fd)?;
        // The socket holds the program now, and the program the map; `prog` may close.
        Ok(Watch {
            map,
            missed,
            max,
            seen: HashMap::new(),
            pruned: None,
        })
    }

    /// Watches process `tgid`, seen in a job at `now`: its events pass from now on, and its new
    /// children's. True when it was not watched before (one `bpf(2)` call).
    pub fn watch(&mut self, tgid: u32, now: Instant) -> io::Result<bool> {
        if let Some(at) = self.seen.get_mut(&tgid) {
            *at = now;
            return Ok(false);
        }
        let (key, value) = (tgid, 1u32);
        let mut attr = MapElem {
            map_fd: self.map_fd(),
            key: std::ptr::addr_of!(key) as u64,
            value: std::ptr::addr_of!(value) as u64,
            flags: BPF_ANY,
            ..MapElem::default()
        };
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr)?;
        self.seen.insert(tgid, now);
        Ok(true)
    }

    /// Records a new process the program watched at its fork (its event passed), at `now`.
    pub fn forked(&mut self, tgid: u32, now: Instant) {
        self.seen.insert(tgid, now);
    }

    /// Whether the program has failed to watch a watched process's new child (the map was
    /// full): from then on the map holds less than the jobs' processes. One `bpf(2)` call; a
    /// failed read counts as a miss.
    pub fn missed_a_fork(&self) -> bool {
        let (key, mut value) = (0u32, 0u32);
        let mut attr = MapElem {
            map_fd: fd_u32(&self.missed),
            key: std::ptr::addr_of!(key) as u64,
            value: std::ptr::addr_of_mut!(value) as u64,
            ..MapElem::default()
        };
        bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).map_or(true, |_| value != 0)
    }

    /// Whether `tgid` is watched, as far as lodger knows.
    #[cfg(test)]
    pub(crate) fn watches(&self, tgid: u32) -> bool {
        self.seen.contains_key(&tgid)
    }

    /// How many processes are watched, as far as lodger knows.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.seen.len()
    }

    /// Unwatches every process not seen for [`FORGET_AFTER`], at most once a second.
    pub fn prune(&mut self, now: Instant) {
        if self
            .pruned
            .is_some_and(|p| now.saturating_duration_since(p) < Duration::from_secs(1))
        {
            return;
        }
        self.pruned = Some(now);
        let fd = self.map_fd();
        self.seen.retain(|&tgid, at| {
            if now.saturating_duration_since(*at) < FORGET_AFTER {
                return true;
            }
            let key = tgid;
            let mut attr = MapElem {
                map_fd: fd,
                key: std::ptr::addr_of!(key) as u64,
                ..MapElem::default()
            };
            // ENOENT: already gone. Another error keeps it, to be tried again.
            match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
                Ok(_) => false,
                Err(e) => e.raw_os_error() != Some(libc::ENOENT),
            }
        });
    }

    /// Takes every process in the map that lodger does not know of as seen at `now`, so that
    /// [`Watch::prune`] unwatches it in time unless a sweep finds it in a job: after events were
    /// lost, the program may have watched children whose forks lodger never read.
    pub fn adopt(&mut self, now: Instant) {
        let mut key: Option<u32> = None;
        let mut next = 0u32;
        // At most the map's size: a map that changes as it is walked may start over.
        for _ in 0..self.max {
            let mut attr = MapElem {
                map_fd: self.map_fd(),
                key: key.as_ref().map_or(0, |k| std::ptr::from_ref(k) as u64),
                value: std::ptr::addr_of_mut!(next) as u64,
                ..MapElem::default()
            };
            if bpf(BPF_MAP_GET_NEXT_KEY, &mut attr).is_err() {
                // ENOENT: the last key; any other error ends the walk as well.
                return;
            }
            self.seen.entry(next).or_insert(now);
            key = Some(next);
        }
    }

    fn map_fd(&self) -> u32 {
        fd_u32(&self.map)
    }
}

fn fd_u32(fd: &OwnedFd) -> u32 {
    u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX)
}

fn load(program: &[Insn]) -> io::Result<OwnedFd> {
    let license = c"Apache-2.0";
    let mut log = vec![0u8; 4096];
    let mut attr = ProgLoad {
        prog_type: BPF_PROG_TYPE_SOCKET_FILTER,
        insn_cnt: u32::try_from(program.len()).map_err(|_| io::ErrorKind::InvalidInput)?,
        insns: program.as_ptr() as u64,
        license: license.as_ptr() as u64,
        prog_name: name("lodger_watch"),
        ..ProgLoad::default()
    };
    match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => owned(fd),
        Err(first) if first.raw_os_error() == Some(libc::EACCES) => {
            // The verifier refused it: load again with its log, to say why.
            attr.log_level = 1;
            attr.log_size = log.len() as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
            let _ = bpf(BPF_PROG_LOAD, &mut attr);
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let last = text.lines().rev().take(3).collect::<Vec<_>>().join(" / ");
            Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("the kernel refused the program ({first}): {last}"),
            ))
        }
        Err(e) => Err(e),
    }
}

// Registers (r10 is the read-only frame pointer) and the opcodes the program uses.
const R0: u8 = 0;
const R1: u8 = 1;
const R2: u8 = 2;
const R3: u8 = 3;
const R4: u8 = 4;
const R10: u8 = 10;
const MOV64_IMM: u8 = 0xb7;
const MOV64_REG: u8 = 0xbf;
const ADD64_IMM: u8 = 0x07;
const LDX_W: u8 = 0x61;
const ST_W: u8 = 0x62;
const LD_IMM64: u8 = 0x18;
const JA: u8 = 0x05;
const JNE_REG: u8 = 0x5d;
const JEQ_REG: u8 = 0x1d;
const JEQ32_IMM: u8 = 0x16;
const JNE32_IMM: u8 = 0x56;
const JEQ_IMM: u8 = 0x15;
const JNE_IMM: u8 = 0x55;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
/// `BPF_PSEUDO_MAP_FD`: a 64-bit load's immediate is a map's descriptor.
const PSEUDO_MAP_FD: u8 = 1;

/// A few instructions at a time, with jumps to labels resolved at the end.
#[derive(Default)]
struct Asm {
    code: Vec<Insn>,
    labels: HashMap<&'static str, usize>,
    jumps: Vec<(usize, &'static str)>,
}

impl Asm {
    fn op(&mut self, code: u8, dst: u8, src: u8, off: i16, imm: i32) -> &mut Self {
        self.code.push(Insn {
            code,
            regs: dst | (src << 4),
            off,
            imm,
        });
        self
    }
    fn jump(&mut self, code: u8, dst: u8, src: u8, imm: i32, to: &'static str) -> &mut Self {
        self.jumps.push((self.code.len(), to));
        self.op(code, dst, src, 0, imm)
    }
    fn label(&mut self, name: &'static str) -> &mut Self {
        self.labels.insert(name, self.code.len());
        self
    }
    /// `r1 = a map` (two instructions).
    fn map(&mut self, fd: i32) -> &mut Self {
        self.op(LD_IMM64, R1, PSEUDO_MAP_FD, 0, fd)
            .op(0, 0, 0, 0, 0)
    }
    /// `r2 = the frame pointer + off`: a pointer to the stack.
    fn stack(&mut self, reg: u8, off: i32) -> &mut Self {
        self.op(MOV64_REG, reg, R10, 0, 0)
            .op(ADD64_IMM, reg, 0, 0, off)
    }
    /// Goes on only if the u32 on the stack at `key` is in the map; else to "drop".
    fn watched(&mut self, fd: i32, key: i32) -> &mut Self {
        self.map(fd)
            .stack(R2, key)
            .op(CALL, 0, 0, 0, HELPER_MAP_LOOKUP_ELEM)
            .jump(JEQ_IMM, R0, 0, 0, "drop")
    }

    /// The program, every jump's offset counted from the instruction after it.
    fn finish(mut self) -> Vec<Insn> {
        for (at, to) in &self.jumps {
            let target = self.labels.get(to).copied().unwrap_or(*at + 1);
            let off = target as i64 - (*at as i64 + 1);
            self.code[*at].off = i16::try_from(off).unwrap_or(0);
        }
        self.code
    }
}

/// The filter: keep the events of watched processes, drop the rest; watch a watched process's
/// new child. On the stack after the load: `what` at -32, the union's first four u32 at -16,
/// -12, -8 and -4 (fork: parent pid, parent tgid, child pid, child tgid; exec and exit: pid,
/// tgid). The key is a process's tgid: for a new process its parent's (the fork's parent
/// tgid), for a new thread its own process's (the fork's child tgid: a thread's parent is its
/// process's parent, the kernel's `real_parent`), for an exec or exit the process's. A thread's
/// exit is dropped, as the classic filter does (`procevents::filter`). A new child the map
/// has no room for sets the flag in `missed` (key 0 at -40); its fork passes whole.
fn program(map: i32, missed: i32) -> Vec<Insn> {
    let mut a = Asm::default();
    // r0 = bpf_skb_load_bytes(skb = r1, EVENT_AT, fp - 32, EVENT_READ)
    a.op(MOV64_IMM, R2, 0, 0, EVENT_AT)
        .stack(R3, -EVENT_READ)
        .op(MOV64_IMM, R4, 0, 0, EVENT_READ)
        .op(CALL, 0, 0, 0, HELPER_SKB_LOAD_BYTES)
        // Too short to be an event: let lodger see (and skip) it.
        .jump(JNE_IMM, R0, 0, 0, "pass")
        .op(LDX_W, R1, R10, -32, 0)
        .jump(JEQ32_IMM, R1, 0, PROC_EVENT_FORK, "fork")
        .jump(JEQ32_IMM, R1, 0, PROC_EVENT_EXEC, "lookup")
        .jump(JNE32_IMM, R1, 0, PROC_EVENT_EXIT, "drop")
        // An exit: a thread's (pid != tgid) is dropped.
        .op(LDX_W, R1, R10, -16, 0)
        .op(LDX_W, R2, R10, -12, 0)
        .jump(JNE_REG, R1, R2, 0, "drop")
        .label("lookup")
        .watched(map, -12)
        .jump(JA, 0, 0, 0, "pass")
        .label("fork")
        // A new thread (child pid != child tgid): its own process's key, since its parent is
        // its process's parent.
        .op(LDX_W, R1, R10, -8, 0)
        .op(LDX_W, R2, R10, -4, 0)
        .jump(JEQ_REG, R1, R2, 0, "process")
        .watched(map, -4)
        .jump(JA, 0, 0, 0, "pass")
        // A new process: kept, and watched from now on, when its parent's process is watched.
        .label("process")
        .watched(map, -12)
        .op(ST_W, R10, 0, -36, 1)
        .map(map)
        .stack(R2, -4)
        .stack(R3, -36)
        .op(MOV64_IMM, R4, 0, 0, BPF_ANY as i32)
        .op(CALL, 0, 0, 0, HELPER_MAP_UPDATE_ELEM)
        .jump(JEQ_IMM, R0, 0, 0, "pass")
        // The map is full: the flag says so, and the fork passes whole (never cut: see the
        // module doc).
        .op(ST_W, R10, 0, -40, 0)
        .map(missed)
        .stack(R2, -40)
        .op(CALL, 0, 0, 0, HELPER_MAP_LOOKUP_ELEM)
        .jump(JEQ_IMM, R0, 0, 0, "pass")
        .op(ST_W, R0, 0, 0, 1)
        .label("pass")
        .op(MOV64_IMM, R0, 0, 0, -1)
        .op(EXIT, 0, 0, 0, 0)
        .label("drop")
        .op(MOV64_IMM, R0, 0, 0, 0)
        .op(EXIT, 0, 0, 0, 0);
    a.finish()
}

#[cfg(test)]
#[path = "procwatch_tests.rs"]
mod tests;
