//! Test gates: a test that cannot run here says why, in one of three classes, and is counted.
//! Touches nothing but its own skip log (under the target directory) and stderr, except
//! [`need_v2_root_cpuset`], which enables the cpuset controller at the cgroup v2 root.
//!
//! - **privilege** ([`skip`], [`need_root`]): root or a kernel permission is missing. Fails under
//!   `LODGER_REQUIRE_PRIVILEGED=1` (as `.ci/run` sets).
//! - **hardware** ([`skip_hardware`]): the machine lacks a PMU, a GPU, resctrl/MBA. Fails under
//!   `LODGER_REQUIRE_HARDWARE=1`, for runs on machines that have it.
//! - **not applicable** ([`not_applicable`], [`need_cgroup_v1`], [`need_cgroup_v2`],
//!   [`need_rt_group_sched`]): the kernel's shape is not the one the test is about (cgroup v1 vs
//!   v2, RT group scheduling). Never fails, and never counts as a pass: the other shape has its own
//!   test.
//!
//! Rust's harness counts an early return as a pass, so every skip is also appended, one line
//! `CLASS<TAB>TEST<TAB>REASON`, to `target/lodger-skips/<test binary>.log` (or under
//! `$LODGER_SKIP_DIR`), where `scripts/test-summary` reads it. A missing fixture is a failure,
//! not a skip ([`fixture`]).

use std::io::Write;
use std::path::{Path, PathBuf};

/// The environment variable that turns a privilege skip into a failure.
pub const REQUIRE_ENV: &str = "LODGER_REQUIRE_PRIVILEGED";

/// The environment variable that turns a missing-hardware skip into a failure. Separate from
/// [`REQUIRE_ENV`]: CI can demand root and kernel features, but not a PMU or a GPU its machine
/// does not have.
pub const REQUIRE_HARDWARE_ENV: &str = "LODGER_REQUIRE_HARDWARE";

/// Overrides where skip logs go (default: `lodger-skips/` in the target directory).
pub const SKIP_DIR_ENV: &str = "LODGER_SKIP_DIR";

/// Where the tree's shared fixtures are (default: `../shared/fixtures` beside the checkout).
pub const FIXTURES_ENV: &str = "LODGER_FIXTURES";

/// Why a test did not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipClass {
    /// Root or a kernel permission is missing.
    Privilege,
    /// The machine lacks the hardware (PMU, GPU, resctrl/MBA).
    Hardware,
    /// The kernel's shape is not the one the test is about.
    NotApplicable,
}

impl SkipClass {
    /// The name used in logs and the summary.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipClass::Privilege => "privilege",
            SkipClass::Hardware => "hardware",
            SkipClass::NotApplicable => "not-applicable",
        }
    }

    /// The variable that turns this class of skip into a failure (none for not-applicable).
    pub fn require_env(self) -> Option<&'static str> {
        match self {
            SkipClass::Privilege => Some(REQUIRE_ENV),
            SkipClass::Hardware => Some(REQUIRE_HARDWARE_ENV),
            SkipClass::NotApplicable => None,
        }
    }
}

/// True when privilege skips must fail.
pub fn required() -> bool {
    env_is_one(REQUIRE_ENV)
}

/// True when hardware skips must fail.
pub fn hardware_required() -> bool {
    env_is_one(REQUIRE_HARDWARE_ENV)
}

fn env_is_one(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// Skips `test` for `reason` in `class`: prints `SKIP (class) test: reason` to stderr and records
/// it in the skip log; panics instead when the class's require variable is set to 1. Returns so
/// the test can `return`.
pub fn skip_as(class: SkipClass, test: &str, reason: &str) {
    if let Some(var) = class.require_env() {
        if env_is_one(var) {
            panic!(
                "{test}: cannot run ({}): {reason} ({var}=1 forbids skipping)",
                class.as_str()
            );
        }
    }
    eprintln!("SKIP ({}) {test}: {reason}", class.as_str());
    record(class, test, reason);
}

/// Privilege class: a precondition for a privileged test (root, a permission) is missing.
pub fn skip(test: &str, reason: &str) {
    skip_as(SkipClass::Privilege, test, reason);
}

/// Hardware class: the machine lacks hardware the test needs (a PMU, a GPU, resctrl/MBA).
pub fn skip_hardware(test: &str, reason: &str) {
    skip_as(SkipClass::Hardware, test, reason);
}

/// Not-applicable class: the kernel's shape is not the one the test is about. Never fails.
pub fn not_applicable(test: &str, reason: &str) {
    skip_as(SkipClass::NotApplicable, test, reason);
}

/// True when this process runs as root (euid 0).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Returns true when the test may go on: the process is root. Otherwise skips (or fails under
/// `LODGER_REQUIRE_PRIVILEGED=1`) and returns false.
pub fn need_root(test: &str) -> bool {
    if is_root() {
        return true;
    }
    skip(test, "needs root");
    false
}

/// Which cgroup version serves the cpuset controller on this host (as lodger detects it: v2 has
/// `cgroup.controllers` at `/sys/fs/cgroup`, v1 has `/sys/fs/cgroup/cpuset/cpuset.cpus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCgroup {
    V1,
    V2,
    /// Neither hierarchy is mounted.
    None,
}

/// Where the cgroup filesystems are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The host's cpuset cgroup version.
pub fn host_cgroup() -> HostCgroup {
    let root = Path::new(CGROUP_ROOT);
    if root.join("cgroup.controllers").is_file() {
        HostCgroup::V2
    } else if root.join("cpuset/cpuset.cpus").is_file() {
        HostCgroup::V1
    } else {
        HostCgroup::None
    }
}

/// The root of the hierarchy holding cpuset cgroups: `/sys/fs/cgroup/cpuset` on v1,
/// `/sys/fs/cgroup` on v2.
pub fn cpuset_root() -> PathBuf {
    match host_cgroup() {
        HostCgroup::V1 => Path::new(CGROUP_ROOT).join("cpuset"),
        HostCgroup::V2 | HostCgroup::None => PathBuf::from(CGROUP_ROOT),
    }
}

/// True on a cgroup v1 (or hybrid) host; otherwise records `test` as not applicable.
pub fn need_cgroup_v1(test: &str) -> bool {
    match host_cgroup() {
        HostCgroup::V1 => true,
        HostCgroup::V2 => {
            not_applicable(test, "a cgroup v1 test; this host's cpuset is on cgroup v2");
            false
        }
        HostCgroup::None => {
            not_applicable(
                test,
                "a cgroup v1 test; this host mounts no cpuset hierarchy",
            );
            false
        }
    }
}

/// True on a cgroup v2 host; otherwise records `test` as not applicable.
pub fn need_cgroup_v2(test: &str) -> bool {
    match host_cgroup() {
        HostCgroup::V2 => true,
        HostCgroup::V1 => {
            not_applicable(test, "a cgroup v2 test; this host's cpuset is on cgroup v1");
            false
        }
        HostCgroup::None => {
            not_applicable(
                test,
                "a cgroup v2 test; this host mounts no cgroup v2 hierarchy",
            );
            false
        }
    }
}

/// For a test that makes cpuset cgroups directly under the cgroup v2 root: makes sure the root
/// hands the cpuset controller to its children (`+cpuset` in its `cgroup.subtree_control`), as
/// systemd does as soon as any unit sets `AllowedCPUs=` or is delegated cpuset. A stock systemd
/// host (Debian 12) enables only cpu, io, memory and pids there, and lodger never writes the
/// root's controllers itself (lodgerd gets cpuset through its unit's `Delegate=yes`). Prints a
/// line when it enabled it. True when cpuset is available there (always on v1, where each
/// hierarchy has its own controllers); otherwise skips `test` in the privilege class.
pub fn need_v2_root_cpuset(test: &str) -> bool {
    if host_cgroup() != HostCgroup::V2 {
        return true;
    }
    let control = Path::new(CGROUP_ROOT).join("cgroup.subtree_control");
    let enabled = |text: &str| text.split_whitespace().any(|c| c == "cpuset");
    if enabled(&std::fs::read_to_string(&control).unwrap_or_default()) {
        return true;
    }
    if let Err(e) = std::fs::write(&control, "+cpuset") {
        skip(
            test,
            &format!("cannot enable cpuset in {}: {e}", control.display()),
        );
        return false;
    }
    eprintln!(
        "{test}: enabled the cpuset controller in {} (as systemd does for a unit with \
         AllowedCPUs=)",
        control.display()
    );
    true
}

/// True when the kernel has RT group scheduling (`CONFIG_RT_GROUP_SCHED`): the v1 cpu controller
/// shows `cpu.rt_runtime_us`, or the kernel's config says so.
pub fn has_rt_group_sched() -> bool {
    if Path::new(CGROUP_ROOT)
        .join("cpu/cpu.rt_runtime_us")
        .exists()
    {
        return true;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    std::fs::read_to_string(format!("/boot/config-{}", release.trim()))
        .is_ok_and(|c| c.lines().any(|l| l.trim() == "CONFIG_RT_GROUP_SCHED=y"))
}

/// True when the kernel has RT group scheduling with the v1 cpu controller mounted (where
/// lodger meets per-group RT budgets); otherwise records `test` as not applicable.
pub fn need_rt_group_sched(test: &str) -> bool {
    if Path::new(CGROUP_ROOT)
        .join("cpu/cpu.rt_runtime_us")
        .exists()
    {
        return true;
    }
    let why = if has_rt_group_sched() {
        "the kernel has RT group scheduling but no v1 cpu controller shows cpu.rt_runtime_us"
    } else {
        "the kernel has no RT group scheduling (CONFIG_RT_GROUP_SCHED)"
    };
    not_applicable(test, why);
    false
}

/// The online CPUs' count, from `/sys/devices/system/cpu/online`.
pub fn online_cpu_count() -> usize {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    text.trim()
        .split(',')
        .filter(|r| !r.is_empty())
        .map(|r| match r.split_once('-') {
            Some((a, b)) => match (a.parse::<usize>(), b.parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 0,
            },
            None => 1,
        })
        .sum()
}

/// True when the host has at least `n` online CPUs; otherwise records `test` as not applicable.
pub fn need_cpus(test: &str, n: usize) -> bool {
    let have = online_cpu_count();
    if have >= n {
        return true;
    }
    not_applicable(
        test,
        &format!("needs {n} online CPUs, this host has {have}"),
    );
    false
}

/// The host's shape in one line, as the summary prints it: cgroup mode, CPU count, RT group
/// scheduling, and whether a PMU, an NVIDIA GPU and resctrl are present.
pub fn host_shape() -> String {
    let cgroup = match host_cgroup() {
        HostCgroup::V2 => "cgroup v2",
        HostCgroup::V1
            if Path::new(CGROUP_ROOT)
                .join("unified/cgroup.controllers")
                .exists() =>
        {
            "cgroup v1 hybrid"
        }
        HostCgroup::V1 => "cgroup v1",
        HostCgroup::None => "no cgroup",
    };
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    format!(
        "{cgroup}, {} CPUs, RT group scheduling {}, PMU {}, GPU {}, resctrl {}",
        online_cpu_count(),
        yes_no(has_rt_group_sched()),
        yes_no(Path::new("/sys/bus/event_source/devices/cpu").exists()),
        yes_no(Path::new("/dev/nvidiactl").exists()),
        yes_no(Path::new("/sys/fs/resctrl/info").exists()),
    )
}

/// The shared fixtures directory: `$LODGER_FIXTURES`, else `../shared/fixtures` beside the
/// checkout.
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os(FIXTURES_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures"),
    }
}

/// A path under the shared fixtures. A missing fixture fails the test (it is part of the tree
/// the suite runs against, not a property of the host).
pub fn fixture(rel: &str) -> PathBuf {
    let path = fixtures_dir().join(rel);
    assert!(
        path.exists(),
        "fixture {} is missing: set {FIXTURES_ENV} to the shared fixtures directory (default \
         ../shared/fixtures beside the checkout)",
        path.display()
    );
    path
}

/// The skip log of this test binary: `<dir>/<binary file name>.log`.
pub fn skip_log() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let name = exe.file_name()?.to_string_lossy().into_owned();
    let dir = match std::env::var_os(SKIP_DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        // target/<profile>/deps/<binary>: the log goes to target/lodger-skips.
        _ => {
            let deps = exe.parent()?;
            let target = if deps.file_name().is_some_and(|n| n == "deps") {
                deps.parent()?.parent()?
            } else {
                deps
            };
            target.join("lodger-skips")
        }
    };
    Some(dir.join(format!("{name}.log")))
}

fn record(class: SkipClass, test: &str, reason: &str) {
    let Some(log) = skip_log() else {
        return;
    };
    if let Some(dir) = log.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let line = log_line(class, test, reason);
    // One write of one short line with O_APPEND: lines from parallel tests do not interleave.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
    {
        let _ = f.write_all(line.as_bytes());
    }
}

/// One skip log line: `CLASS<TAB>TEST<TAB>REASON` and a newline, tabs and newlines in the test
/// name and reason turned into spaces.
fn log_line(class: SkipClass, test: &str, reason: &str) -> String {
    format!(
        "{}\t{}\t{}\n",
        class.as_str(),
        test.replace(['\t', '\n'], " "),
        reason.replace(['\t', '\n'], " ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_name_their_require_variable() {
        assert_eq!(SkipClass::Privilege.require_env(), Some(REQUIRE_ENV));
        assert_eq!(
            SkipClass::Hardware.require_env(),
            Some(REQUIRE_HARDWARE_ENV)
        );
        assert_eq!(SkipClass::NotApplicable.require_env(), None);
        assert_eq!(SkipClass::NotApplicable.as_str(), "not-applicable");
    }

    #[test]
    fn a_log_line_has_three_tab_separated_fields() {
        let line = log_line(SkipClass::Hardware, "a\ttest", "no PMU\nhere");
        assert_eq!(line, "hardware\ta test\tno PMU here\n");
    }

    #[test]
    fn the_skip_log_is_named_after_the_test_binary() {
        // Under cargo: target/<profile>/deps/lodger-HASH, so target/lodger-skips/lodger-HASH.log
        // (unless LODGER_SKIP_DIR says otherwise).
        let log = skip_log().expect("a skip log path");
        let exe = std::env::current_exe().expect("exe");
        let name = exe
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        assert_eq!(
            log.file_name(),
            Some(std::ffi::OsStr::new(&format!("{name}.log")))
        );
        if std::env::var_os(SKIP_DIR_ENV).is_none() {
            assert_eq!(
                log.parent().and_then(|p| p.file_name()),
                Some(std::ffi::OsStr::new("lodger-skips"))
            );
        }
    }

    #[test]
    fn the_host_shape_names_cpus_and_cgroup_mode() {
        assert!(online_cpu_count() >= 1);
        let shape = host_shape();
        assert!(
            shape.contains(&format!("{} CPUs", online_cpu_count())),
            "{shape}"
        );
        assert!(shape.contains("cgroup"), "{shape}");
    }
}
