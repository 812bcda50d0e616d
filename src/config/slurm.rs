//! config::slurm: `[slurm]`: where Slurm puts a job's cgroup, how long lodger waits for it, and
//! the operator's rules mapping partitions or accounts to job kinds (read by lodger's prolog,
//! docs/slurm.md). Touches no file.

use serde::{Deserialize, Serialize};
use toml::Spanned;

use super::value::{in_range, named_enum, one_of};
use super::{ConfigError, Cx};

named_enum! {
    /// What a `[[slurm.rule]]` makes of the jobs it matches.
    SlurmKind {
        /// Decided by the job's GPUs: training with GPUs, batch without.
        Auto => "auto",
        Training => "training",
        Batch => "batch",
        /// Not registered: lodger leaves the job alone.
        Leave => "leave",
    }
}

/// One `[[slurm.rule]]`: jobs of this partition and/or account become `kind`. The first rule
/// that matches decides; a rule names at least one of the two.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlurmRule {
    pub partition: Option<String>,
    pub account: Option<String>,
    pub kind: SlurmKind,
}

/// `[slurm]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlurmConfig {
    /// Where a job's cgroup is, tried in order: `{job}` is `SLURM_JOB_ID`, `{uid}` the owner's
    /// uid, `{node}` the Slurm node name. Paths from the hierarchy root (v1: the cpuset
    /// hierarchy's).
    pub cgroup_paths: Vec<String>,
    /// A registered Slurm job whose cgroup has not appeared after this long is forgotten.
    pub appear_timeout_seconds: u64,
    pub rules: Vec<SlurmRule>,
}

impl Default for SlurmConfig {
    fn default() -> Self {
        Self {
            cgroup_paths: crate::enforce::DEFAULT_SLURM_CGROUPS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            appear_timeout_seconds: 600,
            rules: Vec::new(),
        }
    }
}

impl SlurmConfig {
    /// The kind the first matching rule gives a job of `partition` and `account`.
    pub fn kind_for(&self, partition: Option<&str>, account: Option<&str>) -> SlurmKind {
        self.rules
            .iter()
            .find(|r| {
                let p = r
                    .partition
                    .as_deref()
                    .map_or(true, |p| Some(p) == partition);
                let a = r.account.as_deref().map_or(true, |a| Some(a) == account);
                p && a
            })
            .map_or(SlurmKind::Auto, |r| r.kind)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(super) struct RawSlurm {
    cgroup_paths: Option<Spanned<Vec<String>>>,
    appear_timeout_seconds: Option<Spanned<i64>>,
    rule: Option<Vec<RawRule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct RawRule {
    partition: Option<Spanned<String>>,
    account: Option<Spanned<String>>,
    kind: Option<Spanned<String>>,
}

/// A `cgroup_paths` entry: absolute, no `.` or `..`, only the `{job}`, `{uid}` and `{node}`
/// placeholders, and `{job}` in it (a path without it would name every job's cgroup at once).
fn cgroup_template(value: String) -> Result<String, String> {
    let rest = value
        .replace("{job}", "")
        .replace("{uid}", "")
        .replace("{node}", "");
    let valid = value.starts_with('/')
        && value.contains("{job}")
        && !rest.contains('{')
        && !rest.contains('}')
        && !value.split('/').any(|c| c == "." || c == "..")
        && !value.contains('\0');
    if valid {
        Ok(value)
    } else {
        Err(format!(
            "\"{value}\" is not an absolute cgroup path with {{job}} (and optionally {{uid}}, {{node}}), \
             e.g. \"/system.slice/slurmstepd.scope/job_{{job}}\""
        ))
    }
}

impl Cx<'_> {
    pub(super) fn slurm(&mut self, raw: Option<RawSlurm>) -> Result<SlurmConfig, ConfigError> {
        let d = SlurmConfig::default();
        let Some(raw) = raw else { return Ok(d) };
        let mut rules = Vec::new();
        for (i, r) in raw.rule.unwrap_or_default().into_iter().enumerate() {
            let key = |k: &str| format!("slurm.rule[{i}].{k}");
            let name = |s: String| -> Result<Option<String>, String> {
                if s.is_empty() || s.len() > 256 || s.contains(char::is_whitespace) {
                    Err(format!("\"{s}\" is not a Slurm partition or account name"))
                } else {
                    Ok(Some(s))
                }
            };
            let partition = self.field(&key("partition"), r.partition, None, name)?;
            let account = self.field(&key("account"), r.account, None, name)?;
            let kind = self.field(&key("kind"), r.kind, None, |s| {
                one_of(&s, SlurmKind::from_name, SlurmKind::NAMES).map(Some)
            })?;
            let Some(kind) = kind else {
                return Err(self.error_here(
                    &key("kind"),
                    "a rule needs a kind (auto, training, batch or leave)".into(),
                ));
            };
            if partition.is_none() && account.is_none() {
                return Err(self.error_here(
                    &key("kind"),
                    "a rule needs a partition or an account to match".into(),
                ));
            }
            rules.push(SlurmRule {
                partition,
                account,
                kind,
            });
        }
        Ok(SlurmConfig {
            cgroup_paths: self.field(
                "slurm.cgroup_paths",
                raw.cgroup_paths,
                d.cgroup_paths,
                |paths| paths.into_iter().map(cgroup_template).collect(),
            )?,
            appear_timeout_seconds: self.field(
                "slurm.appear_timeout_seconds",
                raw.appear_timeout_seconds,
                d.appear_timeout_seconds,
                |v| in_range(v, &(10..=86_400)),
            )?,
            rules,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::config::tests::{parse, refused};
    use crate::config::SlurmKind;

    #[test]
    fn rules_and_paths_are_read_and_bad_ones_named() {
        let c = parse(
            "[slurm]\ncgroup_paths = [\"/slurm_{node}/uid_{uid}/job_{job}\"]\n\
             [[slurm.rule]]\naccount = \"etl\"\nkind = \"batch\"\n",
        )
        .unwrap();
        assert_eq!(c.slurm.cgroup_paths, ["/slurm_{node}/uid_{uid}/job_{job}"]);
        assert_eq!(c.slurm.kind_for(Some("x"), Some("etl")), SlurmKind::Batch);
        assert_eq!(c.slurm.kind_for(Some("x"), None), SlurmKind::Auto);
        for (text, says) in [
            (
                "[slurm]\ncgroup_paths = [\"/slurm/uid_{uid}\"]\n",
                "slurm.cgroup_paths",
            ),
            (
                "[slurm]\ncgroup_paths = [\"/slurm/{user}/job_{job}\"]\n",
                "slurm.cgroup_paths",
            ),
            (
                "[slurm]\ncgroup_paths = [\"/slurm/../job_{job}\"]\n",
                "slurm.cgroup_paths",
            ),
            (
                "[[slurm.rule]]\nkind = \"batch\"\n",
                "a partition or an account",
            ),
            ("[[slurm.rule]]\npartition = \"p\"\n", "a rule needs a kind"),
            (
                "[[slurm.rule]]\npartition = \"p\"\nkind = \"gpu\"\n",
                "slurm.rule[0].kind",
            ),
            (
                "[slurm]\nappear_timeout_seconds = 1\n",
                "slurm.appear_timeout_seconds",
            ),
            ("[batch]\npolicy = \"idle\"\n", "batch.policy"),
        ] {
            let err = refused(text);
            assert!(err.contains(says), "{text}: {err}");
        }
    }
}
