//! config::cgroup: `[cgroup]`: which hierarchy lodger drives, where it is mounted, the parent
//! group lodger creates its own under, and how jobs registered by pid are pinned. Touches no
//! file.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{absolute, named_enum, one_of};
use super::{ConfigError, Cx};

/// Longest cgroup directory name (NAME_MAX).
const CGROUP_NAME_MAX: usize = 255;

/// `[cgroup]`: where and how lodger makes its cgroups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CgroupConfig {
    pub driver: CgroupDriver,
    pub root: PathBuf,
    /// A single path component under `root` (in each v1 hierarchy, or in the v2 tree).
    pub parent: String,
    pub pid_jobs: PidJobs,
}

named_enum! {
    /// `cgroup.driver`: which cgroup hierarchy lodger drives.
    CgroupDriver {
        /// Detect at start.
        Auto => "auto",
        V1 => "v1",
        V2 => "v2",
    }
}

named_enum! {
    /// `cgroup.pid_jobs`: how a job registered by pid is pinned to its CPUs.
    PidJobs {
        /// `Cgroup` on v1, `Affinity` on v2; see [`PidJobs::effective`].
        Auto => "auto",
        /// Move its processes into a cgroup lodger creates.
        Cgroup => "cgroup",
        /// Leave them where they are and set every thread's CPU affinity.
        Affinity => "affinity",
    }
}

impl PidJobs {
    /// Resolves `Auto` for the hierarchy in use. On v2 a process belongs to its systemd unit's
    /// cgroup, and moving it out would break the unit's accounting and stop logic, so lodger
    /// pins by affinity there; on v1 the cpuset hierarchy is lodger's to arrange.
    pub fn effective(self, cgroup_v2: bool) -> PidJobs {
        match self {
            PidJobs::Auto if cgroup_v2 => PidJobs::Affinity,
            PidJobs::Auto => PidJobs::Cgroup,
            other => other,
        }
    }
}

impl Default for CgroupConfig {
    fn default() -> Self {
        Self {
            driver: CgroupDriver::Auto,
            root: PathBuf::from("/sys/fs/cgroup"),
            parent: "lodger".to_string(),
            pid_jobs: PidJobs::Auto,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawCgroup {
    driver: Option<Spanned<String>>,
    root: Option<Spanned<String>>,
    parent: Option<Spanned<String>>,
    pid_jobs: Option<Spanned<String>>,
}

impl Cx<'_> {
    pub(super) fn cgroup(&mut self, raw: Option<RawCgroup>) -> Result<CgroupConfig, ConfigError> {
        let d = CgroupConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        Ok(CgroupConfig {
            driver: self.field("cgroup.driver", raw.driver, d.driver, |s| {
                one_of(&s, CgroupDriver::from_name, CgroupDriver::NAMES)
            })?,
            root: self.field("cgroup.root", raw.root, d.root, absolute)?,
            parent: self.field("cgroup.parent", raw.parent, d.parent, cgroup_name)?,
            pid_jobs: self.field("cgroup.pid_jobs", raw.pid_jobs, d.pid_jobs, |s| {
                one_of(&s, PidJobs::from_name, PidJobs::NAMES)
            })?,
        })
    }
}

/// One directory name under the cgroup root: no `/`, not `.` or `..`, and none of the
/// characters that would need quoting in cgroupfs or systemd unit names.
pub(super) fn cgroup_name(value: String) -> Result<String, String> {
    let valid = !value.is_empty()
        && value.len() <= CGROUP_NAME_MAX
        && value != "."
        && value != ".."
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '@' | ':'));
    if valid {
        Ok(value)
    } else {
        Err(format!(
            "must be a single cgroup name of letters, digits, '_', '-', '.', '@' or ':' \
             (got \"{value}\")"
        ))
    }
}
