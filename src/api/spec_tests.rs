//! `spec`'s tests: D-Bus dictionaries in, specs or the refusals naming the key out.

use super::*;

#[test]
fn sched_labels_follow_the_training_section() {
    let mut t = TrainingConfig::default();
    let l = SchedLabels::new(&t);
    assert_eq!(l.of(JobKind::Training), "SCHED_RR/10-11");
    assert_eq!(l.of(JobKind::Offline), "SCHED_OTHER");
    assert_eq!(l.of(JobKind::Online), "SCHED_OTHER");
    t.role_priorities = false;
    t.rt_priority = 20;
    assert_eq!(SchedLabels::new(&t).of(JobKind::Training), "SCHED_RR/20");
    t.policy = TrainingPolicy::Other;
    let l = SchedLabels::new(&t);
    assert_eq!(l.of(JobKind::Training), "SCHED_OTHER/nice -10");
    assert_eq!(l.of(JobKind::Offline), "SCHED_IDLE");
    assert_eq!(l.of(JobKind::Online), "SCHED_OTHER");
}

fn dict(entries: Vec<(&str, Value<'static>)>) -> HashMap<String, OwnedValue> {
    entries
        .into_iter()
        .map(|(k, v)| (k.to_string(), OwnedValue::try_from(v).unwrap()))
        .collect()
}

#[test]
fn job_metrics_carry_memory_bandwidth_per_domain_and_why_not() {
    let m = JobMetrics {
        membw_bytes_per_s: Some(3e9),
        membw_domains: [(0, 1e9), (1, 2e9)].into_iter().collect(),
        ..JobMetrics::default()
    };
    let d = job_metrics_to_dict(&m);
    assert_eq!(d["membw_bytes_per_s"], Value::from(3e9));
    assert_eq!(
        d["membw_domains"],
        Value::from(HashMap::from([(0u32, 1e9), (1u32, 2e9)]))
    );
    assert!(!d.contains_key("membw_unavailable"));
    let refused = JobMetrics {
        membw_unavailable: Some("no free RMID".into()),
        ..JobMetrics::default()
    };
    let d = job_metrics_to_dict(&refused);
    assert_eq!(d["membw_unavailable"], Value::from("no free RMID"));
    assert!(!d.contains_key("membw_domains") && !d.contains_key("membw_bytes_per_s"));
}

#[test]
fn launch_keys_are_read_for_inference_and_refused_for_training() {
    let spec = spec_from_dict(&dict(vec![
        ("kind", Value::from("offline")),
        ("command", Value::from(vec!["worker"])),
        ("cwd", Value::from("/home/alice")),
        ("env", Value::from(vec!["MODEL=bert"])),
        ("output", Value::from("/home/alice/out.log")),
    ]))
    .unwrap();
    let launch = spec.inference.expect("inference").launch;
    assert_eq!(launch.cwd.as_deref(), Some("/home/alice"));
    assert_eq!(launch.env, vec!["MODEL=bert".to_string()]);
    assert_eq!(launch.output.as_deref(), Some("/home/alice/out.log"));
    let err = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("pids", Value::from(vec![10u32])),
        ("cores", Value::from(1u32)),
        ("cwd", Value::from("/tmp")),
    ]))
    .unwrap_err();
    assert!(err.contains("key 'cwd' is for online and offline"), "{err}");
}

#[test]
fn full_spec() {
    let spec = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("pids", Value::from(vec![10u32, 11])),
        ("gpus", Value::from(vec![0u32, 1])),
        ("cores", Value::from(4u32)),
        ("name", Value::from("bert")),
        ("category", Value::from("nlp")),
        ("pipeline", Value::from(true)),
    ]))
    .unwrap();
    assert_eq!(spec.target, Target::Pids(vec![10, 11]));
    assert_eq!(spec.gpus, vec![0, 1]);
    assert_eq!(spec.cores, 4);
    assert_eq!(spec.category, Category::Nlp);
    assert!(spec.pipeline && !spec.multi_node);
}

#[test]
fn integers_of_other_widths_are_accepted_when_they_fit() {
    let spec = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("cgroup", Value::from("/slurm/job_1")),
        ("cores", Value::from(2i64)),
    ]))
    .unwrap();
    assert_eq!(spec.cores, 2);
    let err = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("cgroup", Value::from("/x")),
        ("cores", Value::from(-1i32)),
    ]))
    .unwrap_err();
    assert!(err.contains("cores"), "{err}");
}

/// A caller's cgroup is recorded as the kernel names it: `//system.slice/x/` is
/// `/system.slice/x`, so the trust rules and the duplicate check see that cgroup.
#[test]
fn a_cgroup_is_recorded_canonical() {
    let spec = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("cgroup", Value::from("//system.slice//cron.service/")),
        ("cores", Value::from(2u32)),
    ]))
    .unwrap();
    assert_eq!(
        spec.target,
        Target::Cgroup("/system.slice/cron.service".into())
    );
    assert!(spec.validate().is_ok());
}

#[test]
fn batch_jobs_need_no_core_count_and_slurm_jobs_name_their_node() {
    let spec = spec_from_dict(&dict(vec![
        ("kind", Value::from("batch")),
        ("pids", Value::from(vec![7u32])),
    ]))
    .unwrap();
    assert_eq!((spec.kind, spec.cores), (JobKind::Batch, 0));
    assert!(spec.validate().is_ok());
    let spec = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("slurm_job", Value::from(42u32)),
        ("slurm_node", Value::from("gpu07")),
        ("gpus", Value::from(vec![1u32])),
    ]))
    .unwrap_err();
    assert!(spec.contains("cores"), "{spec}");
    let spec = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("slurm_job", Value::from(42u32)),
        ("slurm_node", Value::from("gpu07")),
        ("cores", Value::from(0u32)),
    ]))
    .unwrap();
    assert_eq!(
        spec.target,
        Target::Slurm(SlurmJob {
            job_id: 42,
            uid: 0,
            node: Some("gpu07".into())
        })
    );
    assert!(spec.validate().is_ok(), "0 cores: its whole Slurm cpuset");
    let mut bad = spec.clone();
    bad.target = Target::Slurm(SlurmJob {
        job_id: 42,
        uid: 0,
        node: Some("../x".into()),
    });
    assert!(bad.validate().is_err());
}

#[test]
fn refusals_name_the_key() {
    let cases: Vec<(Vec<(&str, Value<'static>)>, &str)> = vec![
        (vec![("kind", Value::from("training"))], "pids"),
        (
            vec![
                ("kind", Value::from("training")),
                ("pids", Value::from(vec![1u32])),
            ],
            "cores",
        ),
        (
            vec![
                ("kind", Value::from("cpu")),
                ("pids", Value::from(vec![1u32])),
                ("cores", Value::from(1u32)),
            ],
            "kind",
        ),
        (
            vec![
                ("kind", Value::from("batch")),
                ("pids", Value::from(vec![1u32])),
                ("slurm_job", Value::from(4u32)),
            ],
            "not several",
        ),
        (
            vec![
                ("kind", Value::from("batch")),
                ("slurm_job", Value::from("4")),
            ],
            "slurm_job",
        ),
        (
            vec![
                ("kind", Value::from("batch")),
                ("pids", Value::from(vec![1u32])),
                ("command", Value::from(vec!["x"])),
            ],
            "not batch jobs",
        ),
        (
            vec![
                ("kind", Value::from("training")),
                ("pids", Value::from(vec![1u32])),
                ("cores", Value::from("two")),
            ],
            "cores",
        ),
        (
            vec![
                ("kind", Value::from("training")),
                ("pids", Value::from(vec![1u32])),
                ("cores", Value::from(1u32)),
                ("colour", Value::from("red")),
            ],
            "colour",
        ),
        (
            vec![
                ("kind", Value::from("training")),
                ("pids", Value::from(vec![1u32])),
                ("cgroup", Value::from("/a")),
                ("cores", Value::from(1u32)),
            ],
            "not several",
        ),
        (
            vec![
                ("kind", Value::from("training")),
                ("pids", Value::from("12")),
                ("cores", Value::from(1u32)),
            ],
            "pids",
        ),
    ];
    for (entries, needle) in cases {
        let err = spec_from_dict(&dict(entries)).unwrap_err();
        assert!(err.contains(needle), "'{err}' should mention '{needle}'");
    }
}

/// Issue 19: a batch job may ask for its own memory limit (bytes or a size); a training job may
/// not.
#[test]
fn batch_jobs_take_a_memory_limit_and_training_jobs_refuse_one() {
    for (given, bytes) in [
        (Value::from("2G"), 2u64 << 30),
        (Value::from(8u64 << 20), 8 << 20),
    ] {
        let spec = spec_from_dict(&dict(vec![
            ("kind", Value::from("batch")),
            ("pids", Value::from(vec![7u32])),
            ("memory_max", given),
        ]))
        .unwrap();
        assert_eq!(spec.memory_max, Some(bytes));
        assert!(spec.inference.is_none());
    }
    let err = spec_from_dict(&dict(vec![
        ("kind", Value::from("training")),
        ("pids", Value::from(vec![7u32])),
        ("cores", Value::from(1u32)),
        ("memory_max", Value::from("2G")),
    ]))
    .unwrap_err();
    assert!(
        err.contains("key 'memory_max' is for inference and batch jobs, not training"),
        "{err}"
    );
}
