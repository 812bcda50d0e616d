//! The job spec's own checks: targets, names, GPUs, inference commands and launch settings.
use super::*;

fn spec(target: Target) -> JobSpec {
    JobSpec {
        gpus: vec![0],
        ..JobSpec::new(JobKind::Training, target, 2)
    }
}

/// A cgroup is written one way only: the trust rules and the duplicate check compare paths
/// as written, so `//system.slice/x` or `/a/b/` would slip past a rule or a duplicate.
/// Callers' paths are made canonical first; a spec that is not is refused.
#[test]
fn cgroup_paths_are_canonical() {
    let check = |p: &str| spec(Target::Cgroup(p.into())).validate();
    assert_eq!(check("/user.slice/job"), Ok(()));
    for bad in [
        "//system.slice/cron.service",
        "/user.slice/job/",
        "/a//b",
        "/",
        "",
        "relative/x",
        "/a/../b",
        "/a/./b",
    ] {
        assert_eq!(check(bad), Err(SpecError::BadCgroup(bad.into())), "{bad:?}");
    }
    assert!(check(&format!("/{}", "a".repeat(MAX_PATH_LEN))).is_err());
    assert_eq!(
        canonical_cgroup_path("//system.slice//cron.service/"),
        "/system.slice/cron.service"
    );
    assert_eq!(canonical_cgroup_path("/a/b"), "/a/b");
    assert_eq!(canonical_cgroup_path("///"), "/");
    assert_eq!(canonical_cgroup_path("relative/x"), "relative/x");
}

/// What a caller may store in an inference spec is bounded: the command's arguments, each
/// argument and environment entry, and the paths.
#[test]
fn an_instance_command_and_its_launch_are_bounded() {
    let offline = |command: Vec<String>, launch: Launch| JobSpec {
        inference: Some(InferenceSpec {
            command,
            slo_ms: None,
            rate_per_s: None,
            max_batch: DEFAULT_MAX_BATCH,
            max_instances: None,
            launch,
            memory_max: None,
        }),
        ..JobSpec::new(JobKind::Offline, Target::Instances, 0)
    };
    let ok = vec![
        "/bin/serve".to_string(),
        "--threads".into(),
        "{threads}".into(),
    ];
    assert_eq!(offline(ok.clone(), Launch::default()).validate(), Ok(()));
    let many = vec!["x".to_string(); MAX_COMMAND_ARGS + 1];
    let err = offline(many, Launch::default()).validate().unwrap_err();
    assert!(err.to_string().contains("arguments (at most"), "{err}");
    let long = vec!["/bin/serve".to_string(), "y".repeat(MAX_ARG_LEN + 1)];
    let err = offline(long, Launch::default()).validate().unwrap_err();
    assert!(err.to_string().contains("argument 1 is"), "{err}");
    let env = Launch {
        env: vec![format!("MODEL={}", "z".repeat(MAX_ARG_LEN))],
        ..Launch::default()
    };
    let err = offline(ok.clone(), env).validate().unwrap_err();
    assert!(err.to_string().contains("env: an entry of"), "{err}");
    let cwd = Launch {
        cwd: Some(format!("/{}", "d".repeat(MAX_PATH_LEN))),
        ..Launch::default()
    };
    assert!(matches!(
        offline(ok, cwd).validate(),
        Err(SpecError::BadLaunchPath { key: "cwd", .. })
    ));
}

#[test]
fn launch_paths_must_be_absolute_and_env_may_not_override_lodgers_variables() {
    let ok = |l: Launch| l.validate().map_err(|e| e.to_string());
    assert_eq!(
        ok(Launch {
            cwd: Some("/home/alice/run".into()),
            env: vec!["MODEL=bert".into(), "CUDA_VISIBLE_DEVICES=".into()],
            output: Some("/home/alice/run/out.log".into()),
        }),
        Ok(())
    );
    for (launch, says) in [
        (
            Launch {
                cwd: Some("run".into()),
                ..Launch::default()
            },
            "cwd 'run' must be an absolute path",
        ),
        (
            Launch {
                output: Some("out.log".into()),
                ..Launch::default()
            },
            "output 'out.log' must be an absolute path",
        ),
        (
            Launch {
                env: vec!["NOVALUE".into()],
                ..Launch::default()
            },
            "'NOVALUE' is not NAME=value",
        ),
        (
            Launch {
                env: vec!["1X=y".into()],
                ..Launch::default()
            },
            "'1X=y' is not NAME=value",
        ),
        (
            Launch {
                env: vec!["LODGER_JOB=j9".into()],
                ..Launch::default()
            },
            "LODGER_JOB is set by lodger itself",
        ),
        (
            Launch {
                env: vec!["OMP_NUM_THREADS=64".into()],
                ..Launch::default()
            },
            "OMP_NUM_THREADS is set by lodger itself",
        ),
    ] {
        let e = ok(launch).unwrap_err();
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn inference_spec_validation() {
    let online = |slo: Option<f64>| JobSpec {
        kind: JobKind::Online,
        target: Target::Instances,
        gpus: vec![],
        cores: 0,
        inference: Some(InferenceSpec {
            command: vec!["worker".into(), "--threads".into(), "{threads}".into()],
            slo_ms: slo,
            rate_per_s: Some(100.0),
            max_batch: 32,
            max_instances: None,
            launch: Launch::default(),
            memory_max: None,
        }),
        ..spec(Target::Instances)
    };
    assert_eq!(online(Some(50.0)).validate(), Ok(()));
    assert_eq!(online(None).validate(), Err(SpecError::BadSlo(0.0)));
    assert_eq!(online(Some(-1.0)).validate(), Err(SpecError::BadSlo(-1.0)));
    let mut s = online(Some(50.0));
    s.kind = JobKind::Offline;
    s.inference.as_mut().unwrap().slo_ms = None;
    assert_eq!(s.validate(), Ok(()), "offline needs no SLO");
    s.inference.as_mut().unwrap().command.clear();
    assert_eq!(s.validate(), Err(SpecError::NoCommand));
    let mut s = online(Some(50.0));
    s.target = Target::Pids(vec![1]);
    assert!(matches!(
        s.validate(),
        Err(SpecError::TargetForInference { .. })
    ));
    let mut s = online(Some(50.0));
    s.inference.as_mut().unwrap().max_batch = 0;
    assert_eq!(s.validate(), Err(SpecError::BadBatch(0)));
    let mut t = spec(Target::Instances);
    assert_eq!(t.validate(), Err(SpecError::CommandForTraining));
    t.target = Target::Pids(vec![1]);
    t.inference = online(Some(1.0)).inference;
    assert_eq!(t.validate(), Err(SpecError::CommandForTraining));
}

#[test]
fn spec_validation() {
    assert_eq!(spec(Target::Pids(vec![1, 2])).validate(), Ok(()));
    assert_eq!(
        spec(Target::Cgroup("/slurm/job_1".into())).validate(),
        Ok(())
    );
    assert_eq!(
        spec(Target::Pids(vec![])).validate(),
        Err(SpecError::NoTarget)
    );
    assert_eq!(
        spec(Target::Pids(vec![0])).validate(),
        Err(SpecError::BadPid(0))
    );
    for bad in ["relative", "/", "//", "/a/../b", "/a/./b"] {
        assert!(
            matches!(
                spec(Target::Cgroup(bad.into())).validate(),
                Err(SpecError::BadCgroup(_))
            ),
            "{bad}"
        );
    }
    let mut s = spec(Target::Pids(vec![1]));
    s.cores = 0;
    assert_eq!(s.validate(), Err(SpecError::ZeroCores(0)));
    s.cores = 1;
    s.name = Some("has space".into());
    assert!(matches!(s.validate(), Err(SpecError::BadName(_))));
    s.name = Some("resnet-50_v1.2".into());
    assert_eq!(s.validate(), Ok(()));
    s.gpus = vec![1, 1];
    assert_eq!(s.validate(), Err(SpecError::DuplicateGpu(1)));
}
