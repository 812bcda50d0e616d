//! Slurm's prolog and epilog as lodger reads them (docs/slurm.md): the job slurmd describes in
//! the prolog's environment, and what lodger makes of it: a training job (it has GPUs), a batch
//! job (it has none), or nothing (an operator's `[[slurm.rule]]` says leave it). Pure: the
//! environment is an argument; the D-Bus calls are lodgerctl's (`lodgerctl slurm`).

use crate::config::{SlurmConfig, SlurmKind};
use crate::cpuset::CpuSet;
use crate::job::{valid_node_name, JobKind};

/// A Slurm job as its prolog's environment describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmEnv {
    /// `SLURM_JOB_ID`.
    pub job_id: u32,
    /// `SLURM_JOB_UID`.
    pub uid: u32,
    /// `SLURM_JOB_GPUS` (else `CUDA_VISIBLE_DEVICES`): this node's GPU indices; `None` when the
    /// job has GPUs Slurm names by UUID (MIG) only.
    pub gpus: Option<Vec<u32>>,
    /// Whether the job has any GPU on this node.
    pub has_gpus: bool,
    /// `SLURM_JOB_CPUS_PER_NODE` when every node of the job has the same count.
    pub cpus_per_node: Option<u32>,
    /// `SLURM_JOB_NUM_NODES`.
    pub nodes: u32,
    pub partition: Option<String>,
    pub account: Option<String>,
    /// `SLURMD_NODENAME`.
    pub node: Option<String>,
    /// `SLURM_JOB_SLUID` (Slurm 25.11 and later): the job's sortable unique id, recorded for
    /// correlation only (cgroups are named by the numeric id in every version).
    pub sluid: Option<String>,
    /// `lodger=exclusive` among the words of `SLURM_JOB_COMMENT` (`sbatch --comment`): the
    /// job's cores are lent to no lodger.
    pub exclusive: bool,
}

/// What lodger does with a job slurmd announces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Register it as this kind.
    Register(JobKind),
    /// Leave it alone, and why.
    Leave(String),
}

impl SlurmEnv {
    /// Reads the prolog's (or epilog's) environment through `var`. Errors say which variable
    /// was missing or malformed.
    pub fn read(var: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let number = |name: &str| -> Result<u32, String> {
            let v = var(name).ok_or_else(|| format!("{name} is not set (not run by slurmd?)"))?;
            v.trim()
                .parse()
                .map_err(|_| format!("{name}={v} is not a number"))
        };
        let job_id = number("SLURM_JOB_ID")?;
        if job_id == 0 {
            return Err("SLURM_JOB_ID=0 is not a job".into());
        }
        let uid = number("SLURM_JOB_UID")?;
        let listed = var("SLURM_JOB_GPUS")
            .filter(|v| !v.trim().is_empty())
            .or_else(|| var("CUDA_VISIBLE_DEVICES").filter(|v| !v.trim().is_empty()));
        let (has_gpus, gpus) = match listed {
            None => (false, Some(Vec::new())),
            // Indices "0,1" (or ranges, as Slurm's lists may be); UUIDs name no index.
            Some(v) => (
                true,
                CpuSet::parse(v.trim()).ok().map(|s| s.iter().collect()),
            ),
        };
        let nodes = match var("SLURM_JOB_NUM_NODES") {
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| format!("SLURM_JOB_NUM_NODES={v} is not a number"))?,
            None => 1,
        };
        let word = |name: &str| {
            var(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        Ok(SlurmEnv {
            job_id,
            uid,
            gpus,
            has_gpus,
            cpus_per_node: var("SLURM_JOB_CPUS_PER_NODE").and_then(|v| cpus_per_node(&v)),
            nodes,
            partition: word("SLURM_JOB_PARTITION"),
            account: word("SLURM_JOB_ACCOUNT"),
            node: word("SLURMD_NODENAME").filter(|n| valid_node_name(n)),
            sluid: word("SLURM_JOB_SLUID").filter(|s| valid_sluid(s)),
            exclusive: var("SLURM_JOB_COMMENT").is_some_and(|c| {
                c.split(|ch: char| ch.is_whitespace() || ch == ',')
                    .any(|w| w == "lodger=exclusive")
            }),
        })
    }

    /// The operator's rule for the job's partition and account, else its GPUs: training with
    /// GPUs on this node, batch without.
    pub fn decide(&self, config: &SlurmConfig) -> Decision {
        let by_gpus = if self.has_gpus {
            JobKind::Training
        } else {
            JobKind::Batch
        };
        match config.kind_for(self.partition.as_deref(), self.account.as_deref()) {
            SlurmKind::Auto => Decision::Register(by_gpus),
            SlurmKind::Training => Decision::Register(JobKind::Training),
            SlurmKind::Batch => Decision::Register(JobKind::Batch),
            SlurmKind::Leave => Decision::Leave(format!(
                "a [[slurm.rule]] leaves partition {} / account {} alone",
                self.partition.as_deref().unwrap_or("-"),
                self.account.as_deref().unwrap_or("-")
            )),
        }
    }
}

/// `SLURM_JOB_CPUS_PER_NODE` (`8`, `8(x2)`, `8(x2),4`) when all nodes have the same count:
/// which entry is this node's is not said, so a mixed list gives none.
pub fn cpus_per_node(v: &str) -> Option<u32> {
    let mut counts = v.trim().split(',').map(|entry| {
        let n = entry.split('(').next().unwrap_or("");
        n.trim().parse::<u32>().ok()
    });
    let first = counts.next()??;
    counts
        .all(|c| c == Some(first))
        .then_some(first)
        .filter(|&n| n > 0)
}

/// `s` + 13 Crockford base32 characters (Slurm's `sluid.c`).
fn valid_sluid(s: &str) -> bool {
    s.len() == 14 && s.starts_with(['s', 'S']) && s[1..].chars().all(|c| c.is_ascii_alphanumeric())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::SlurmRule;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    /// What slurmd 22.05 sets for `sbatch --gres=gpu:2 -N1` (Debian 12's prep_script.so).
    const GPU_JOB: &[(&str, &str)] = &[
        ("SLURM_JOB_ID", "42"),
        ("SLURM_JOB_UID", "1000"),
        ("SLURM_JOB_USER", "alice"),
        ("SLURM_JOB_GPUS", "1,3"),
        ("CUDA_VISIBLE_DEVICES", "1,3"),
        ("SLURM_JOB_CPUS_PER_NODE", "16"),
        ("SLURM_JOB_NUM_NODES", "1"),
        ("SLURM_JOB_PARTITION", "gpu"),
        ("SLURM_JOB_ACCOUNT", "vision"),
        ("SLURMD_NODENAME", "gpu07"),
        ("SLURM_SCRIPT_CONTEXT", "prolog_slurmd"),
    ];

    #[test]
    fn a_job_with_gpus_is_training_with_its_host_gpu_indices() {
        let e = SlurmEnv::read(env(GPU_JOB)).unwrap();
        assert_eq!(e.job_id, 42);
        assert_eq!(e.uid, 1000);
        assert_eq!(e.gpus, Some(vec![1, 3]));
        assert_eq!(e.cpus_per_node, Some(16));
        assert_eq!(e.nodes, 1);
        assert_eq!(e.node.as_deref(), Some("gpu07"));
        assert_eq!(
            e.decide(&SlurmConfig::default()),
            Decision::Register(JobKind::Training)
        );
    }

    #[test]
    fn a_job_without_gpus_is_batch_and_several_nodes_are_counted() {
        let e = SlurmEnv::read(env(&[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_JOB_UID", "1001"),
            ("SLURM_JOB_NUM_NODES", "4"),
            ("SLURM_JOB_CPUS_PER_NODE", "8(x3),4"),
        ]))
        .unwrap();
        assert!(!e.has_gpus);
        assert_eq!(e.nodes, 4);
        assert_eq!(e.cpus_per_node, None);
        assert_eq!(
            e.decide(&SlurmConfig::default()),
            Decision::Register(JobKind::Batch)
        );
    }

    #[test]
    fn cuda_visible_devices_stands_in_and_uuids_give_no_index() {
        let e = SlurmEnv::read(env(&[
            ("SLURM_JOB_ID", "8"),
            ("SLURM_JOB_UID", "0"),
            ("CUDA_VISIBLE_DEVICES", "0-1"),
        ]))
        .unwrap();
        assert_eq!(e.gpus, Some(vec![0, 1]));
        let e = SlurmEnv::read(env(&[
            ("SLURM_JOB_ID", "8"),
            ("SLURM_JOB_UID", "0"),
            (
                "CUDA_VISIBLE_DEVICES",
                "MIG-5c1a3e2b-0f1d-4c1e-9a8b-123456789abc",
            ),
        ]))
        .unwrap();
        assert!(e.has_gpus);
        assert_eq!(e.gpus, None);
    }

    #[test]
    fn missing_or_malformed_ids_are_named() {
        let err = SlurmEnv::read(env(&[("SLURM_JOB_UID", "0")])).unwrap_err();
        assert!(err.contains("SLURM_JOB_ID is not set"), "{err}");
        let err =
            SlurmEnv::read(env(&[("SLURM_JOB_ID", "x1"), ("SLURM_JOB_UID", "0")])).unwrap_err();
        assert!(err.contains("SLURM_JOB_ID=x1"), "{err}");
        let err =
            SlurmEnv::read(env(&[("SLURM_JOB_ID", "0"), ("SLURM_JOB_UID", "0")])).unwrap_err();
        assert!(err.contains("not a job"), "{err}");
        let err = SlurmEnv::read(env(&[("SLURM_JOB_ID", "3")])).unwrap_err();
        assert!(err.contains("SLURM_JOB_UID"), "{err}");
    }

    #[test]
    fn a_sluid_is_recorded_and_a_hostile_node_name_is_dropped() {
        let e = SlurmEnv::read(env(&[
            ("SLURM_JOB_ID", "9"),
            ("SLURM_JOB_UID", "0"),
            ("SLURM_JOB_SLUID", "s0ABCDEFGH1234"),
            ("SLURMD_NODENAME", "../../etc"),
        ]))
        .unwrap();
        assert_eq!(e.sluid.as_deref(), Some("s0ABCDEFGH1234"));
        assert_eq!(e.node, None);
        assert_eq!(e.job_id, 9, "cgroups are found by the numeric id");
        let e = SlurmEnv::read(env(&[
            ("SLURM_JOB_ID", "9"),
            ("SLURM_JOB_UID", "0"),
            ("SLURM_JOB_SLUID", "s0/../../x"),
        ]))
        .unwrap();
        assert_eq!(e.sluid, None);
    }

    #[test]
    fn the_first_matching_rule_decides() {
        let config = SlurmConfig {
            rules: vec![
                SlurmRule {
                    partition: Some("interactive".into()),
                    account: None,
                    kind: SlurmKind::Leave,
                },
                SlurmRule {
                    partition: None,
                    account: Some("vision".into()),
                    kind: SlurmKind::Batch,
                },
                SlurmRule {
                    partition: Some("gpu".into()),
                    account: None,
                    kind: SlurmKind::Training,
                },
            ],
            ..SlurmConfig::default()
        };
        // GPU_JOB is partition gpu, account vision: the account rule comes first.
        let e = SlurmEnv::read(env(GPU_JOB)).unwrap();
        assert_eq!(e.decide(&config), Decision::Register(JobKind::Batch));
        let mut e2 = e.clone();
        e2.partition = Some("interactive".into());
        assert!(matches!(e2.decide(&config), Decision::Leave(_)));
        let mut e3 = e;
        e3.account = None;
        e3.has_gpus = false;
        assert_eq!(e3.decide(&config), Decision::Register(JobKind::Training));
    }

    #[test]
    fn a_comment_can_make_the_job_exclusive() {
        let with = |comment: &str| {
            SlurmEnv::read(env(&[
                ("SLURM_JOB_ID", "5"),
                ("SLURM_JOB_UID", "0"),
                ("SLURM_JOB_COMMENT", comment),
            ]))
            .unwrap()
            .exclusive
        };
        assert!(with("lodger=exclusive"));
        assert!(with("benchmark run, lodger=exclusive"));
        assert!(!with("lodger=exclusively"));
        assert!(!SlurmEnv::read(env(GPU_JOB)).unwrap().exclusive);
    }

    #[test]
    fn cpus_per_node_reads_slurms_compressed_form() {
        assert_eq!(cpus_per_node("8"), Some(8));
        assert_eq!(cpus_per_node("8(x2)"), Some(8));
        assert_eq!(cpus_per_node("8(x2),8"), Some(8));
        assert_eq!(cpus_per_node("8(x2),4"), None);
        assert_eq!(cpus_per_node(""), None);
        assert_eq!(cpus_per_node("0"), None);
    }
}
