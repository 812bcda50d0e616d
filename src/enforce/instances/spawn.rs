//! Starting one instance: fork/exec with its environment and placeholders, the report channel
//! (a FIFO lodgerd can open again after a restart, or a pipe), and the setup the child does
//! before exec (process group, cgroup or affinity, the owner's identity, the report descriptor). Touches fork/exec and the child's cgroupfs and affinity
//! (and, with affinity placement and network shaping on v2, the cgroup2 directory instances start
//! in).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use tracing::{debug, warn};

use super::error::{InstanceError, TemplateProblem};
use super::host::Host;
use super::identity::Credentials;
use super::supervisor::{Run, Slot};
use super::template::show_argv;
use super::unit;
use super::{
    InstanceKey, InstanceOutput, ENV_BATCH, ENV_CPUS, ENV_INSTANCE, ENV_JOB, ENV_PARENT,
    ENV_REPORT_FD, ENV_THREADS, REPORT_FD, REPORT_PIPE_BYTES, THREAD_ENV,
};
use crate::enforce::sched::CpuMask;
use crate::enforce::PinMethod;
use crate::sys::cgroupfs as cgroup;

impl Host {
    pub(super) fn spawn(&mut self, slot: &mut Slot, now: Instant) -> Result<Run, InstanceError> {
        let key = slot.key();
        let spec = &slot.spec;
        let argv = slot.template.expand(spec);
        let Some((program, args)) = argv.split_first() else {
            return Err(InstanceError::Template {
                job: spec.job.clone(),
                template: show_argv(&spec.argv),
                problem: TemplateProblem::Empty,
            });
        };

        // Where systemd is PID 1, every instance is a transient unit in lodger's slice: systemd
        // switches to its owner (docs/security.md), and stopping or restarting lodgerd's own
        // unit does not touch it (issue 17).
        if let Some(systemd) = unit::systemd() {
            let (program, args) = (program.clone(), args.to_vec());
            return self.spawn_unit(slot, now, systemd, program, args);
        }

        let mut procs_file = None;
        let mut mask = None;
        match self.placement {
            PinMethod::Cgroup => {
                let cg = self.instance_cgroup(&key);
                let cgroup_err = |source| InstanceError::Cgroup {
                    key: key.clone(),
                    source,
                };
                self.ensure_cgroup(&cg, &spec.cpus, &spec.mems)
                    .map_err(cgroup_err)?;
                slot.cgroup = Some(cg.clone());
                // Whatever is still in it was left by an earlier process of this instance.
                let mut left = Vec::new();
                self.cpusets.procs(&cg, &mut left).map_err(cgroup_err)?;
                if !left.is_empty() {
                    // Usually what an earlier process left, killed and not yet gone.
                    debug!(instance = %key, "killing leftover processes {left:?} in its cgroup");
                    self.kill_cgroup(&cg).map_err(|e| match e {
                        InstanceError::Hierarchy(source) => cgroup_err(source),
                        e => e,
                    })?;
                }
                let path = self.cpusets.dir(&cg).join(cgroup::CGROUP_PROCS);
                let file = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|source| InstanceError::OpenProcs {
                        key: key.clone(),
                        path: path.clone(),
                        source,
                    })?;
                procs_file = Some(file);
            }
            PinMethod::Affinity => {
                mask = Some(CpuMask::from_cpuset(&spec.cpus));
                if let Some(dir) = &self.settings.start_cgroup {
                    procs_file = start_cgroup_procs(dir, &key);
                }
            }
        }

        // Its memory limit: in the cgroup it joins (v2), or in a twin in v1's memory hierarchy.
        let memory_max = self.memory_limit(spec.memory_max);
        let memory_procs = self
            .prepare_memory(&self.instance_cgroup(&key), memory_max)
            .map_err(|source| InstanceError::Cgroup {
                key: key.clone(),
                source,
            })?;
        slot.memory_max = memory_max;

        let (report_read, report_write) = self.report_channel(&key)?;

        // Who it runs as, where, with which environment: never lodgerd's own (docs/security.md).
        let creds = Credentials::resolve(&spec.identity, nix::unistd::getuid().as_raw()).map_err(
            |reason| InstanceError::Identity {
                key: key.clone(),
                reason,
            },
        )?;
        // The child's chdir, open and exec block on a filesystem that does not answer, and
        // lodgerd's spawn waits for the exec: look at those paths first, within a bound.
        // A program named by a relative path is looked up from the instance's directory.
        let program_path = program
            .contains('/')
            .then(|| Path::new(creds.cwd()).join(program.as_str()));
        let paths: Vec<&Path> = [Some(Path::new(creds.cwd())), creds.output().map(Path::new)]
            .into_iter()
            .chain([program_path.as_deref()])
            .flatten()
            .collect();
        crate::sys::stall::answers_within(&paths, crate::sys::stall::PATH_PATIENCE).map_err(
            |reason| InstanceError::Unanswered {
                key: key.clone(),
                reason,
            },
        )?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_clear()
            .envs(creds.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .env(ENV_REPORT_FD, REPORT_FD.to_string())
            .env(ENV_THREADS, spec.threads.to_string())
            .env(ENV_BATCH, spec.batch.to_string())
            .env(ENV_INSTANCE, spec.index.to_string())
            .env(ENV_CPUS, spec.cpus.to_string())
            .env(ENV_JOB, spec.job.as_str())
            .env(ENV_PARENT, &self.parent)
            .process_group(0);
        for var in THREAD_ENV {
            cmd.env(var, spec.threads.to_string());
        }
        match &self.settings.output {
            InstanceOutput::Inherit => {}
            InstanceOutput::Null => {
                cmd.stdout(Stdio::null()).stderr(Stdio::null());
            }
            InstanceOutput::Directory(dir) => {
                let path = dir.join(format!("{key}.log"));
                let open = || OpenOptions::new().create(true).append(true).open(&path);
                let (out, err) =
                    open()
                        .and_then(|f| Ok((f.try_clone()?, f)))
                        .map_err(|source| InstanceError::Output {
                            key: key.clone(),
                            path: path.clone(),
                            source,
                        })?;
                cmd.stdout(out).stderr(err);
            }
        }
        let setup = ChildSetup {
            // SAFETY: sched_param is plain integers (one on glibc, padding on musl): all-zero is
            // valid, and is priority 0.
            param: unsafe { std::mem::zeroed() },
            policy: if spec.offline && self.settings.offline_idle {
                libc::SCHED_IDLE
            } else {
                libc::SCHED_OTHER
            },
            procs_fd: procs_file.as_ref().map(AsRawFd::as_raw_fd),
            memory_procs_fd: memory_procs.as_ref().map(AsRawFd::as_raw_fd),
            mask,
            report_fd: report_write.as_raw_fd(),
            creds,
        };
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls (sched_setscheduler, write,
        // sched_setaffinity, setgroups, setresgid, setresuid, chdir, open, dup2, close, fcntl)
        // on values prepared before the fork: it allocates nothing, takes no lock and touches no
        // state shared with other threads.
        unsafe {
            cmd.pre_exec(move || setup.apply());
        }
        let output = spec.identity.launch.output.as_ref();
        let child = cmd.spawn().map_err(|source| InstanceError::Spawn {
            key: key.clone(),
            program: program.clone(),
            source: match (source.raw_os_error(), output) {
                (Some(libc::ENXIO), Some(out)) => io::Error::new(
                    source.kind(),
                    format!(
                        "{source}: its output {out} is a FIFO or socket nobody reads; start its \
                         reader first, or name a regular file"
                    ),
                ),
                _ => source,
            },
        })?;
        // The child has its own copies (or has exec'd): without ours, the pipe ends when the
        // instance and its children are gone.
        drop(report_write);
        drop(procs_file);
        drop(memory_procs);
        Ok(Run {
            pid: child.id(),
            child: Some(child),
            unit: None,
            adopted: None,
            started: now,
            report: Some(File::from(report_read)),
        })
    }
}

/// `cgroup.procs` of the cgroup2 directory affinity-placed instances start in (created if
/// missing), open for writing. `None`, after a warning, when it cannot be: the instance then
/// starts in lodgerd's cgroup (network shaping moves it there later, its earlier sockets aside).
fn start_cgroup_procs(dir: &Path, key: &InstanceKey) -> Option<File> {
    let open = || {
        fs::create_dir_all(dir)?;
        OpenOptions::new()
            .write(true)
            .open(dir.join(cgroup::CGROUP_PROCS))
    };
    match open() {
        Ok(file) => Some(file),
        Err(e) => {
            warn!(instance = %key, "cannot start it in {}: {e}", dir.display());
            None
        }
    }
}

impl Host {
    /// Starts the instance as a transient unit of systemd: systemd switches to the owner, places
    /// it in lodger's slice on its CPUs and supervises it; lodgerd keeps the report pipe's read
    /// end and a pidfd on the main process.
    fn spawn_unit(
        &mut self,
        slot: &mut Slot,
        now: Instant,
        systemd: &unit::Systemd,
        program: String,
        args: Vec<String>,
    ) -> Result<Run, InstanceError> {
        let key = slot.key();
        let spec = &slot.spec;
        let identity_err = |reason| InstanceError::Identity {
            key: key.clone(),
            reason,
        };
        let creds = Credentials::resolve(&spec.identity, nix::unistd::getuid().as_raw())
            .map_err(identity_err)?;
        let (gid, groups) = creds.groups().unwrap_or((0, &[]));
        let mut env: Vec<String> = creds.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        env.extend([
            format!("{ENV_REPORT_FD}={REPORT_FD}"),
            format!("{ENV_THREADS}={}", spec.threads),
            format!("{ENV_BATCH}={}", spec.batch),
            format!("{ENV_INSTANCE}={}", spec.index),
            format!("{ENV_CPUS}={}", spec.cpus),
            format!("{ENV_JOB}={}", spec.job.as_str()),
            format!("{ENV_PARENT}={}", self.parent),
        ]);
        env.extend(THREAD_ENV.iter().map(|v| format!("{v}={}", spec.threads)));
        let (output, output_fd) = match &self.settings.output {
            InstanceOutput::Inherit => (unit::UnitOutput::Journal, None),
            InstanceOutput::Null => (unit::UnitOutput::Null, None),
            InstanceOutput::Directory(dir) => {
                let path = dir.join(format!("{key}.log"));
                let file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(|source| InstanceError::Output {
                        key: key.clone(),
                        path: path.clone(),
                        source,
                    })?;
                (unit::UnitOutput::Descriptor, Some(OwnedFd::from(file)))
            }
        };
        let mut argv = vec![program];
        argv.extend(args);
        let unit_spec = unit::UnitSpec {
            name: unit::unit_name(&key.to_string()),
            description: format!("lodger inference instance {key}"),
            instance: key.to_string(),
            job: spec.job.to_string(),
            slices: self.slices.clone(),
            user: creds.user.clone(),
            gid,
            groups: groups.to_vec(),
            cwd: creds.cwd().to_string(),
            env,
            argv,
            output_file: creds.output().map(str::to_string),
            output,
            cpus: spec.cpus.clone(),
            stop_grace: self.settings.stop_grace,
            memory_max: self.memory_limit(spec.memory_max),
            memory_high_percent: self.settings.memory_high_percent,
            netns: unit::own_netns(),
        };
        slot.memory_max = unit_spec.memory_max;
        let (report_read, report_write) = self.report_channel(&key)?;
        let pid = systemd
            .start(&unit_spec, &report_write, output_fd.as_ref())
            .map_err(identity_err)?;
        // systemd holds its own copy until the unit is collected.
        drop(report_write);
        let pidfd = pidfd_open(pid).map_err(|source| {
            systemd.abandon(&unit_spec.name);
            InstanceError::Spawn {
                key: key.clone(),
                program: unit_spec.argv[0].clone(),
                source,
            }
        })?;
        debug!(instance = %key, unit = %unit_spec.name, pid, "started as a transient unit");
        Ok(Run {
            pid,
            child: None,
            unit: Some((unit_spec.name, pidfd)),
            adopted: None,
            started: now,
            report: Some(File::from(report_read)),
        })
    }
}

impl Host {
    /// An instance's report channel: (lodgerd's read end, non-blocking; the instance's end), both
    /// close-on-exec. A FIFO under [`InstanceSettings::report_dir`] when set (see there), else
    /// an anonymous pipe.
    ///
    /// [`InstanceSettings::report_dir`]: super::InstanceSettings::report_dir
    pub(super) fn report_channel(
        &self,
        key: &InstanceKey,
    ) -> Result<(OwnedFd, OwnedFd), InstanceError> {
        let err = |source| InstanceError::Pipe {
            key: key.clone(),
            source,
        };
        match &self.settings.report_dir {
            Some(dir) => report_fifo(&report_path(dir, key)).map_err(err),
            None => report_pipe().map_err(err),
        }
    }
}

/// Where instance `key`'s report FIFO is under `dir`.
pub(super) fn report_path(dir: &Path, key: &InstanceKey) -> std::path::PathBuf {
    dir.join(format!("{key}.report"))
}

/// A new FIFO at `path` (one left by an earlier process of the instance is replaced): the
/// instance's end opened for reading and writing (a FIFO with a reader never fails a write with
/// EPIPE, and it is its own reader while lodgerd is away), lodgerd's opened for reading,
/// non-blocking. The directory is lodgerd's alone (0700): the instance inherits its descriptor
/// and never needs the path.
fn report_fifo(path: &Path) -> io::Result<(OwnedFd, OwnedFd)> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(dir) = path.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600))
        .map_err(io::Error::from)?;
    let write = OpenOptions::new().read(true).write(true).open(path)?;
    let write = above_report_fd(OwnedFd::from(write))?;
    // SAFETY: fcntl on an open descriptor we own, with an integer argument; best effort.
    unsafe {
        libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, REPORT_PIPE_BYTES);
    }
    let read = open_report_fifo(path)?;
    Ok((read, write))
}

/// lodgerd's end of an instance's report FIFO: read only, non-blocking, close-on-exec (also to
/// hear an instance again after a restart).
pub(super) fn open_report_fifo(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let read = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    Ok(OwnedFd::from(read))
}

/// `fd`, or a close-on-exec duplicate of it numbered above [`REPORT_FD`]: the instance's end is
/// never one of the standard descriptors (the child's stdio is set up before `pre_exec` moves
/// it to [`REPORT_FD`]).
fn above_report_fd(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() >= REPORT_FD {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on an open descriptor; the result is checked.
    let dup = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, REPORT_FD + 1) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fcntl returned a new open descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// A pidfd on `pid` (Linux 5.3+), readable once the process exits.
pub(super) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new open descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A pipe for one instance's reports: (read end, non-blocking; write end), both close-on-exec.
/// The write end is never one of the standard descriptors (the child's stdio is set up before
/// `pre_exec` moves the write end to [`REPORT_FD`]).
pub(super) fn report_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds: [RawFd; 2] = [-1, -1];
    // SAFETY: `fds` is a writable array of two descriptors, as pipe2 requires.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded: both descriptors are open and owned by nobody else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let write = above_report_fd(write)?;
    // SAFETY: fcntl on an open descriptor we own; F_GETFL/F_SETFL take and return plain flags.
    unsafe {
        let flags = libc::fcntl(read.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(read.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
        // Best effort: the default 64 KiB also works, with an earlier block for a chatty instance.
        libc::fcntl(read.as_raw_fd(), libc::F_SETPIPE_SZ, REPORT_PIPE_BYTES);
    }
    Ok((read, write))
}

/// What the forked child does before exec. Built before the fork: `apply` allocates nothing.
/// No death signal: an instance outlives lodgerd (a restart adopts it, `adopt`).
pub(super) struct ChildSetup {
    /// Priority 0, for SCHED_OTHER or SCHED_IDLE.
    pub(super) param: libc::sched_param,
    /// SCHED_OTHER, or SCHED_IDLE for offline instances that yield to everything.
    pub(super) policy: libc::c_int,
    /// Cgroup placement: `cgroup.procs` of the instance's cgroup, open for writing.
    pub(super) procs_fd: Option<RawFd>,
    /// cgroup v1 with a memory limit: `cgroup.procs` of its memory cgroup, open for writing.
    pub(super) memory_procs_fd: Option<RawFd>,
    /// Affinity placement: the instance's CPUs.
    pub(super) mask: Option<CpuMask>,
    pub(super) report_fd: RawFd,
    /// The owner it becomes, once placed.
    pub(super) creds: Credentials,
}

impl ChildSetup {
    /// Runs in the child between fork and exec: async-signal-safe system calls only.
    pub(super) fn apply(&self) -> io::Result<()> {
        let fail = || Err(io::Error::last_os_error());
        // A child inherits the spawning thread's policy: instances are SCHED_OTHER, the class
        // training's SCHED_RR pre-empts (Cloud Reamer §III-A), or SCHED_IDLE for offline ones.
        // SAFETY: `self.param` is a valid sched_param that outlives the call.
        if unsafe { libc::sched_setscheduler(0, self.policy, &self.param) } != 0 {
            return fail();
        }
        for fd in [self.memory_procs_fd, self.procs_fd].into_iter().flatten() {
            // "0" moves the writing process: the child joins its cgroups before the program runs.
            // SAFETY: writes one byte from a static buffer to an open descriptor.
            if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
                return fail();
            }
        }
        if let Some(mask) = &self.mask {
            // One sched_setaffinity system call on the calling thread (tid 0).
            if let Err(errno) = mask.apply_to(0) {
                return Err(io::Error::from_raw_os_error(errno as i32));
            }
        }
        // The OOM killer takes a lodger before any training process (raising it needs no
        // privilege, but is done before the owner's credentials all the same).
        // SAFETY: open/write/close with a static path and buffer: async-signal-safe.
        unsafe {
            let fd = libc::open(
                c"/proc/self/oom_score_adj".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            );
            if fd < 0 {
                return fail();
            }
            let value = super::LODGER_OOM_SCORE_ADJ_TEXT;
            let written = libc::write(fd, value.as_ptr().cast(), value.len());
            libc::close(fd);
            if written != value.len() as isize {
                return fail();
            }
        }
        // Placed with lodgerd's rights; from here on the owner's.
        self.creds.apply()?;
        if self.report_fd == REPORT_FD {
            // dup2 onto itself keeps close-on-exec: clear it instead.
            // SAFETY: fcntl on an open descriptor with an integer argument.
            if unsafe { libc::fcntl(REPORT_FD, libc::F_SETFD, 0) } != 0 {
                return fail();
            }
        } else {
            // SAFETY: dup2 between descriptors; the new one does not have close-on-exec.
            if unsafe { libc::dup2(self.report_fd, REPORT_FD) } != REPORT_FD {
                return fail();
            }
        }
        Ok(())
    }
}
