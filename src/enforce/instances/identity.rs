//! Who an instance runs as (docs/security.md): its owner's uid, primary gid and supplementary
//! groups, in the working directory the caller sent, with no new privileges, a clean
//! environment and, when asked, its output appended to a file the owner opens. Resolved before
//! the fork (NSS lookups allocate); applied by the child in `pre_exec` with async-signal-safe
//! system calls only ([`Credentials::apply`]). Touches NSS and, to check a working directory,
//! the file system's metadata.

use std::ffi::CString;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::unistd::{Uid, User};
use serde::{Deserialize, Serialize};

use crate::job::Launch;

/// `PATH` of an instance unless its caller passes one (`--env PATH=...`).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// `LANG` of an instance unless its caller passes one.
pub const DEFAULT_LANG: &str = "C.UTF-8";
/// The working directory when the caller sent none (as `systemd-run` without `--same-dir`).
pub const DEFAULT_CWD: &str = "/";

/// An instance's owner and how its caller asked it to start.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Identity {
    /// The job's owner. The instance runs as this uid; as root only when root registered it
    /// for itself, as `systemd-run` does.
    pub uid: u32,
    /// Boxed: most instances are compared and moved far more often than they are started.
    #[serde(default)]
    pub launch: Box<Launch>,
}

/// A user as an instance needs it.
struct Account {
    name: String,
    home: PathBuf,
    gid: u32,
    groups: Vec<u32>,
}

fn account(uid: u32) -> Result<Account, String> {
    let user =
        User::from_uid(Uid::from_raw(uid)).map_err(|e| format!("cannot look up uid {uid}: {e}"))?;
    let Some(user) = user else {
        if uid == 0 {
            return Ok(Account {
                name: "root".into(),
                home: "/root".into(),
                gid: 0,
                groups: vec![0],
            });
        }
        return Err(format!(
            "uid {uid} has no account on this node (no passwd entry): lodger cannot start \
             processes for it"
        ));
    };
    let cname = CString::new(user.name.clone())
        .map_err(|_| format!("uid {uid}'s user name holds a NUL byte"))?;
    let groups = nix::unistd::getgrouplist(&cname, user.gid)
        .map_err(|e| format!("cannot list the groups of {} (uid {uid}): {e}", user.name))?
        .into_iter()
        .map(|g| g.as_raw())
        .collect();
    Ok(Account {
        name: user.name,
        home: user.dir,
        gid: user.gid.as_raw(),
        groups,
    })
}

/// Whether `uid` (in `gid` and `groups`) may search directory `meta` (its `x` bit for them).
fn may_enter(meta: &std::fs::Metadata, uid: u32, gid: u32, groups: &[u32]) -> bool {
    let mode = meta.mode();
    if uid == 0 {
        return true;
    }
    if meta.uid() == uid {
        mode & 0o100 != 0
    } else if meta.gid() == gid || groups.contains(&meta.gid()) {
        mode & 0o010 != 0
    } else {
        mode & 0o001 != 0
    }
}

/// `CAP_SETUID` and `CAP_SETGID` (bits 7 and 6 of `CapEff`).
const CAP_SETUID_SETGID: u64 = (1 << 7) | (1 << 6);

/// Whether this process may become another user (its effective capabilities hold `CAP_SETUID`
/// and `CAP_SETGID`; the packaged unit's bounding set leaves them out).
fn may_switch_user() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & CAP_SETUID_SETGID == CAP_SETUID_SETGID)
}

/// Checks at registration that lodgerd can start instances for `owner` at all (it has an
/// account, and lodgerd may switch to it) and that `launch.cwd`, if given, is a directory the
/// owner may enter (every directory on the way searchable by them). The child's `chdir` after
/// dropping to the owner is the final word; this gives the caller a clear message before
/// anything starts.
pub fn check_launch(owner: u32, launch: &Launch) -> Result<(), String> {
    let who = account(owner)?;
    // Started by systemd as a transient unit: systemd switches the uid and sees the owner's
    // directories, which lodgerd's sandbox may hide.
    let by_unit = owner != nix::unistd::geteuid().as_raw() && super::unit::systemd().is_some();
    if owner != nix::unistd::geteuid().as_raw() && !by_unit && !may_switch_user() {
        return Err(format!(
            "lodgerd cannot start processes as {} (uid {owner}): it lacks CAP_SETUID/CAP_SETGID \
             (docs/security.md: instances of other users need the transient-unit path or these \
             capabilities)",
            who.name
        ));
    }
    let Some(cwd) = &launch.cwd else {
        return Ok(());
    };
    let path = Path::new(cwd);
    if !path.is_absolute() {
        return Err(format!("working directory {cwd} is not an absolute path"));
    }
    // From the root down, each directory looked at only once the owner may enter the one above
    // it: lodgerd (root) says nothing about a path its owner could not look at (whether
    // another user's file exists, or is a file).
    let mut dirs: Vec<&Path> = path.ancestors().collect();
    dirs.reverse();
    for dir in dirs {
        // Registration runs on the agent's loop: a hung mount on the way must not stop it. Each
        // directory is looked at only once the owner may enter the one above it, as below.
        crate::sys::stall::answers_within(&[dir], crate::sys::stall::PATH_PATIENCE)
            .map_err(|e| format!("working directory {cwd}: {e}"))?;
        let meta = match std::fs::metadata(dir) {
            Ok(meta) => meta,
            // Hidden from lodgerd, not from the unit: systemd checks it when the unit starts.
            Err(_) if by_unit && !sandbox_hint(path).is_empty() => return Ok(()),
            Err(e) => {
                return Err(format!(
                    "working directory {cwd}: {e}{}",
                    sandbox_hint(path)
                ))
            }
        };
        if !meta.is_dir() {
            return Err(format!("working directory {cwd} is not a directory"));
        }
        if !may_enter(&meta, owner, who.gid, &who.groups) {
            // The sandbox shows what it hides as an empty directory nobody may enter.
            if by_unit && !sandbox_hint(path).is_empty() {
                return Ok(());
            }
            return Err(format!(
                "working directory {cwd}: {} (uid {owner}) may not enter {}{}",
                who.name,
                dir.display(),
                sandbox_hint(path)
            ));
        }
    }
    if owner == nix::unistd::geteuid().as_raw() {
        // No change of user: the kernel's own answer for lodgerd (whose service may lack
        // CAP_DAC_OVERRIDE, and whose sandbox may hide the directory).
        nix::unistd::access(path, nix::unistd::AccessFlags::X_OK).map_err(|e| {
            format!(
                "working directory {cwd}: lodgerd may not enter it ({e}){}",
                sandbox_hint(path)
            )
        })?;
    }
    Ok(())
}

/// Where the packaged unit's sandbox (`ProtectHome=`, `PrivateTmp=`) hides the caller's files
/// from lodgerd and the processes it forks, a hint saying so.
fn sandbox_hint(path: &Path) -> &'static str {
    let hidden = ["/home", "/root", "/run/user", "/tmp", "/var/tmp"];
    if hidden.iter().any(|h| path.starts_with(h)) {
        " (lodgerd's service sandbox hides /home, /root, /run/user and /tmp from the processes \
         it starts: choose another directory with --cwd)"
    } else {
        ""
    }
}

/// An identity resolved for one spawn: what the child becomes before exec.
pub(super) struct Credentials {
    /// None: stay who lodgerd is (root's own jobs, or a lodgerd run by the owner itself).
    drop_to: Option<DropTo>,
    /// The owner's user name (a transient unit's `User=`).
    pub(super) user: String,
    cwd: CString,
    output: Option<CString>,
    /// The instance's whole environment apart from what the spawner adds (`LODGER_*`, threads).
    pub(super) env: Vec<(String, String)>,
}

struct DropTo {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
}

impl Credentials {
    /// The primary gid and supplementary groups it switches to, if it switches.
    pub(super) fn groups(&self) -> Option<(u32, &[u32])> {
        self.drop_to.as_ref().map(|d| (d.gid, d.groups.as_slice()))
    }

    pub(super) fn cwd(&self) -> &str {
        self.cwd.to_str().unwrap_or(DEFAULT_CWD)
    }

    pub(super) fn output(&self) -> Option<&str> {
        self.output.as_deref().and_then(|c| c.to_str().ok())
    }
}

impl Credentials {
    /// Resolves `identity` for a spawn by a lodgerd running as `self_uid`.
    pub(super) fn resolve(identity: &Identity, self_uid: u32) -> Result<Self, String> {
        let who = account(identity.uid)?;
        let launch = &identity.launch;
        let mut env = vec![
            ("PATH".to_string(), DEFAULT_PATH.to_string()),
            ("HOME".to_string(), who.home.display().to_string()),
            ("USER".to_string(), who.name.clone()),
            ("LOGNAME".to_string(), who.name.clone()),
            ("LANG".to_string(), DEFAULT_LANG.to_string()),
        ];
        for entry in &launch.env {
            if let Some((k, v)) = entry.split_once('=') {
                env.retain(|(name, _)| name != k);
                env.push((k.to_string(), v.to_string()));
            }
        }
        let c = |what: &str, s: &str| {
            CString::new(s).map_err(|_| format!("{what} '{s}' holds a NUL byte"))
        };
        Ok(Self {
            user: who.name.clone(),
            drop_to: (identity.uid != self_uid).then_some(DropTo {
                uid: identity.uid,
                gid: who.gid,
                groups: who.groups,
            }),
            cwd: c("cwd", launch.cwd.as_deref().unwrap_or(DEFAULT_CWD))?,
            output: launch
                .output
                .as_deref()
                .map(|o| c("output", o))
                .transpose()?,
            env,
        })
    }

    /// Runs in the child between fork and exec, after it joined its cgroup and took its CPUs
    /// (which need lodgerd's rights): becomes the owner (groups, gid, then uid: all three of
    /// real, effective and saved), forbids new privileges, enters the working directory and
    /// opens the output file as the owner. Async-signal-safe system calls only, on values
    /// prepared before the fork.
    pub(super) fn apply(&self) -> io::Result<()> {
        let fail = || Err(io::Error::last_os_error());
        if let Some(d) = &self.drop_to {
            // SAFETY: `groups` is a live slice of gid_t; its length is passed with it.
            if unsafe { libc::setgroups(d.groups.len(), d.groups.as_ptr()) } != 0 {
                return fail();
            }
            // SAFETY: integer arguments only.
            if unsafe { libc::setresgid(d.gid, d.gid, d.gid) } != 0 {
                return fail();
            }
            // SAFETY: integer arguments only.
            if unsafe { libc::setresuid(d.uid, d.uid, d.uid) } != 0 {
                return fail();
            }
        }
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return fail();
        }
        // SAFETY: `cwd` is a NUL-terminated string that outlives the call.
        if unsafe { libc::chdir(self.cwd.as_ptr()) } != 0 {
            return fail();
        }
        if let Some(path) = &self.output {
            // Non-blocking: a FIFO nobody reads would block this open, and lodgerd's spawn,
            // which waits for the exec, with it; it fails with ENXIO instead (`spawn` says
            // why). Blocking again once open, as the instance expects its stdout to be.
            // SAFETY: `path` is a NUL-terminated string; flags and mode are integers.
            let fd = unsafe {
                libc::open(
                    path.as_ptr(),
                    libc::O_WRONLY
                        | libc::O_CREAT
                        | libc::O_APPEND
                        | libc::O_CLOEXEC
                        | libc::O_NONBLOCK
                        | libc::O_NOCTTY,
                    0o640 as libc::c_uint,
                )
            };
            if fd < 0 {
                return fail();
            }
            // SAFETY: fcntl on the descriptor just opened, integer arguments only.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            // SAFETY: as above.
            if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0
            {
                return fail();
            }
            // SAFETY: dup2 between open descriptors; close of the one we opened.
            unsafe {
                if libc::dup2(fd, 1) != 1 || libc::dup2(fd, 2) != 2 {
                    return fail();
                }
                libc::close(fd);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_is_clean_and_the_callers_entries_win() {
        let me = nix::unistd::getuid().as_raw();
        let identity = Identity {
            uid: me,
            launch: Box::new(Launch {
                cwd: Some("/tmp".into()),
                env: vec!["PATH=/opt/bin".into(), "MODEL=resnet".into()],
                output: None,
            }),
        };
        let creds = Credentials::resolve(&identity, me).expect("resolve");
        assert!(
            creds.drop_to.is_none(),
            "no uid change for lodgerd's own uid"
        );
        let get = |k: &str| {
            creds
                .env
                .iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(get("PATH"), ["/opt/bin"]);
        assert_eq!(get("MODEL"), ["resnet"]);
        assert_eq!(get("LANG"), [DEFAULT_LANG]);
        assert_eq!(creds.env.len(), 6, "{:?}", creds.env);
        assert_eq!(creds.cwd.to_str(), Ok("/tmp"));
        let other = Credentials::resolve(&Identity { uid: 0, ..identity }, me + 1).unwrap();
        assert_eq!(other.drop_to.map(|d| d.uid), Some(0));
    }

    #[test]
    fn a_working_directory_must_be_a_directory_the_owner_may_enter() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        let launch = |p: &Path| Launch {
            cwd: Some(p.display().to_string()),
            ..Launch::default()
        };
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(check_launch(me, &launch(dir.path())), Ok(()));
        assert!(check_launch(me, &launch(&file))
            .unwrap_err()
            .contains("is not a directory"));
        let gone = check_launch(me, &launch(&dir.path().join("none"))).unwrap_err();
        assert!(gone.contains("working directory"), "{gone}");
        let hidden = check_launch(me, &launch(Path::new("/root/lodger-no-such-dir"))).unwrap_err();
        assert!(hidden.contains("sandbox hides /home, /root"), "{hidden}");
        let meta = std::fs::metadata(dir.path()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mut p = meta.permissions();
        p.set_mode(0o700);
        std::fs::set_permissions(dir.path(), p).unwrap();
        let meta = std::fs::metadata(dir.path()).unwrap();
        // Someone who is neither its owner nor in its group may not enter a 0700 directory.
        let stranger = meta.uid().wrapping_add(12345).max(1);
        assert!(!may_enter(&meta, stranger, stranger, &[]));
        assert!(may_enter(&meta, meta.uid(), meta.gid(), &[]));
    }

    /// Inside a directory another user may not enter, lodgerd (root) tells that user nothing
    /// more: a file and a missing path there are refused alike, for the directory.
    #[test]
    fn the_working_directory_check_tells_nothing_past_a_directory_the_owner_may_not_enter() {
        let name =
            "the_working_directory_check_tells_nothing_past_a_directory_the_owner_may_not_enter";
        if !crate::privileged::need_root(name) {
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        // Not under /tmp, which the packaged unit's sandbox hides (checked by systemd then).
        let dir = tempfile::tempdir_in("/run").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        let launch = |p: &Path| Launch {
            cwd: Some(p.display().to_string()),
            ..Launch::default()
        };
        let nobody = 65534;
        let (a_file, missing) = (
            check_launch(nobody, &launch(&file)).unwrap_err(),
            check_launch(nobody, &launch(&dir.path().join("none"))).unwrap_err(),
        );
        let refused = format!("may not enter {}", dir.path().display());
        assert!(a_file.ends_with(&refused), "{a_file}");
        assert_eq!(
            a_file.replace(&file.display().to_string(), "CWD"),
            missing.replace(&dir.path().join("none").display().to_string(), "CWD"),
            "the same refusal"
        );
    }
}
