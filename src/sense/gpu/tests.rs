//! Tests of GPU sensing: merging NVML's per-process figures, and the emulated source's records.

use super::*;

fn proc_with(pids: &[u32]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for pid in pids {
        fs::create_dir(dir.path().join(pid.to_string())).expect("fake /proc/<pid>");
    }
    dir
}

fn process(pid: u32, gpu: u32, sm_util: Option<f64>) -> GpuProcess {
    GpuProcess {
        pid,
        gpu,
        sm_util,
        mem_util: None,
        used_memory_bytes: None,
        iters_per_s: None,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

fn device(index: u32, util: f64) -> GpuDevice {
    GpuDevice {
        util_gpu: Some(util),
        ..GpuDevice::bare(index)
    }
}

fn snapshot(devices: Vec<GpuDevice>, processes: Vec<GpuProcess>) -> GpuSnapshot {
    GpuSnapshot {
        source: GpuSourceKind::Nvml,
        taken_unix_ms: 0,
        devices,
        processes,
        failed: Vec::new(),
    }
}

#[test]
fn nvml_absent_library_is_a_clear_error_not_a_panic() {
    let err =
        NvmlSource::open_library("/nonexistent/libnvidia-ml.so.1").expect_err("no such library");
    let msg = err.to_string();
    assert!(matches!(err, GpuError::NvmlUnavailable { .. }), "{msg}");
    assert!(
        msg.starts_with("NVML unavailable (/nonexistent/libnvidia-ml.so.1)"),
        "{msg}"
    );
    assert!(msg.contains("NVIDIA driver is not installed"), "{msg}");
    assert_eq!(
        GpuStatus::unavailable(&err).to_string(),
        format!("unavailable: {msg}")
    );
}

/// NVML that is missing or too old fails the same way next time; a driver not loaded yet, or
/// device files lodgerd may not make, may pass (the sampler opens NVML again).
#[test]
fn nvml_failures_that_may_pass_are_told_from_lasting_ones() {
    for (e, may_pass) in [
        (NvmlError::DriverNotLoaded, true),
        (NvmlError::NoPermission, true),
        (NvmlError::Unknown, true),
        (NvmlError::FailedToLoadSymbol("nvmlInit_v2".into()), false),
    ] {
        let shown = format!("{e:?}");
        assert_eq!(
            nvml_unavailable(NVML_LIBRARY, e).may_pass(),
            may_pass,
            "{shown}"
        );
    }
    let missing = NvmlSource::open_library("/nonexistent/libnvidia-ml.so.1").err();
    assert!(
        missing.as_ref().is_some_and(|e| !e.may_pass()),
        "{missing:?}"
    );
}

#[test]
fn nvml_default_open_fails_cleanly_without_a_driver() {
    const NAME: &str = "nvml_default_open_fails_cleanly_without_a_driver";
    if Path::new("/dev/nvidiactl").exists() {
        crate::privileged::not_applicable(NAME, "this host has an NVIDIA driver (/dev/nvidiactl)");
        return;
    }
    // Without the driver open fails with the reason lodgerd logs once at start.
    let e = match NvmlSource::open() {
        Err(e) => e,
        Ok(_) => panic!("NVML opened on a host without /dev/nvidiactl"),
    };
    eprintln!("GPU sensing off: {e}");
    assert!(matches!(e, GpuError::NvmlUnavailable { .. }), "{e}");
    assert!(e.to_string().contains(NVML_LIBRARY), "{e}");
    match open_source(
        GpuSourceKind::Nvml,
        Path::new("/nonexistent"),
        Path::new("/proc"),
    ) {
        Err(e) => assert!(e.to_string().starts_with("NVML unavailable"), "{e}"),
        Ok(_) => panic!("an NVML source opened on a host without /dev/nvidiactl"),
    }
}

#[test]
fn nvml_default_open_samples_with_a_driver() {
    const NAME: &str = "nvml_default_open_samples_with_a_driver";
    if !Path::new("/dev/nvidiactl").exists() {
        crate::privileged::skip_hardware(NAME, "no NVIDIA driver (/dev/nvidiactl is absent)");
        return;
    }
    // With the driver, a sample comes back marked nvml.
    let mut nvml = NvmlSource::open().expect("open NVML on a host with a driver");
    let s = nvml.sample().expect("sample real GPUs");
    assert_eq!(s.source, GpuSourceKind::Nvml);
    assert_eq!(nvml.kind(), GpuSourceKind::Nvml);
    let source = open_source(
        GpuSourceKind::Nvml,
        Path::new("/nonexistent"),
        Path::new("/proc"),
    )
    .expect("an NVML source opens where the driver is");
    assert_eq!(source.kind(), GpuSourceKind::Nvml);
}

#[test]
fn source_kinds_parse_and_say_what_they_are() {
    assert_eq!(GpuSourceKind::parse("nvml").ok(), Some(GpuSourceKind::Nvml));
    assert_eq!(
        GpuSourceKind::parse("emulated").ok(),
        Some(GpuSourceKind::Emulated)
    );
    assert!(GpuSourceKind::parse("NVML").is_err());
    let nvml = GpuStatus::On {
        source: GpuSourceKind::Nvml,
        devices: 8,
        failed: Vec::new(),
    };
    assert_eq!(nvml.to_string(), "nvml: 8 GPU(s)");
    let emulated = GpuStatus::On {
        source: GpuSourceKind::Emulated,
        devices: 1,
        failed: Vec::new(),
    };
    assert!(emulated.to_string().starts_with("emulated"), "{emulated}");
    assert!(emulated.to_string().contains("no real GPU"), "{emulated}");
    let json = serde_json::to_string(&emulated).expect("json");
    assert!(json.contains("\"source\":\"emulated\""), "{json}");
}

#[test]
fn merge_averages_samples_and_marks_idle_processes() {
    let running = [(10, Some(1 << 30)), (11, None)];
    let util = [(10, 80, 20), (10, 60, 40), (12, 30, 0)].map(|(pid, sm, mem)| UtilSample {
        pid,
        sm_percent: sm,
        mem_percent: mem,
    });
    let procs = merge_processes(3, &running, Some(&util));
    let find = |pid| procs.iter().find(|p| p.pid == pid).expect("pid present");
    assert_eq!(find(10).sm_util, Some(0.7));
    assert_eq!(find(10).mem_util, Some(0.3));
    assert_eq!(find(10).used_memory_bytes, Some(1 << 30));
    // Running but no sample: NVML reports only busy processes.
    assert_eq!(find(11).sm_util, Some(0.0));
    // A sample for a process not in the compute list (a graphics client) still counts.
    assert_eq!(find(12).sm_util, Some(0.3));
    assert!(procs.iter().all(|p| p.gpu == 3));
    // No per-process utilization on this GPU: shares unknown, not zero.
    let procs = merge_processes(0, &running, None);
    assert!(procs.iter().all(|p| p.sm_util.is_none()));
}

#[test]
fn attribution_sums_a_jobs_processes_per_gpu() {
    let s = snapshot(
        vec![device(0, 0.9), device(1, 0.5)],
        vec![
            process(100, 0, Some(0.6)),
            process(101, 0, Some(0.3)),
            process(200, 0, Some(0.1)),
            process(102, 1, Some(0.4)),
        ],
    );
    let job = job_utilization(&s, &BTreeSet::from([100, 101, 102]));
    assert_eq!(job.source, GpuSourceKind::Nvml);
    assert_eq!(job.per_gpu.keys().copied().collect::<Vec<_>>(), [0, 1]);
    assert!(close(job.per_gpu[&0], 0.9), "{job:?}");
    assert!(close(job.per_gpu[&1], 0.4), "{job:?}");
    assert!(job.mean.is_some_and(|m| close(m, 0.65)), "{job:?}");
    assert!(job.unattributed.is_empty());
    let other = job_utilization(&s, &BTreeSet::from([200]));
    assert_eq!(other.per_gpu, BTreeMap::from([(0, 0.1)]));
    let none = job_utilization(&s, &BTreeSet::from([999]));
    assert!(none.per_gpu.is_empty());
    assert_eq!(none.mean, None);
}

#[test]
fn attribution_without_per_process_util_uses_the_device_only_for_a_sole_owner() {
    let s = snapshot(
        vec![device(0, 0.8), device(1, 0.7)],
        vec![
            process(100, 0, None),
            process(100, 1, None),
            process(300, 1, None),
        ],
    );
    let job = job_utilization(&s, &BTreeSet::from([100]));
    assert_eq!(job.per_gpu, BTreeMap::from([(0, 0.8)]));
    assert_eq!(job.unattributed, [1]);
}

#[test]
fn attribution_clamps_to_one_and_sums_iteration_rates() {
    let mut a = process(1, 0, Some(0.7));
    a.iters_per_s = Some(10.0);
    let mut b = process(2, 0, Some(0.6));
    b.iters_per_s = Some(5.0);
    let s = snapshot(vec![device(0, 1.0)], vec![a, b]);
    let job = job_utilization(&s, &BTreeSet::from([1, 2]));
    assert_eq!(job.per_gpu[&0], 1.0);
    assert_eq!(job.iters_per_s, Some(15.0));
}

fn publish(dir: &Path, pid: u32, gpu: u32, busy: f64, age: Duration) {
    let mut record = EmulatedGpuRecord::now(pid, gpu, busy, 20.0);
    record.updated_unix_ms -= u64::try_from(age.as_millis()).expect("small age");
    write_emulated_record(dir, &record).expect("publish");
}

#[test]
fn emulated_reads_fresh_records_and_ignores_the_rest() {
    let dir = tempfile::tempdir().expect("tempdir");
    let procs = proc_with(&[100, 101, 102, 103]);
    publish(dir.path(), 100, 0, 0.8, Duration::ZERO);
    publish(dir.path(), 101, 1, 0.25, Duration::from_secs(1));
    publish(dir.path(), 102, 0, 0.9, Duration::from_secs(60)); // stale
    publish(dir.path(), 104, 0, 0.9, Duration::ZERO); // pid gone
    fs::write(dir.path().join("103.json"), "{\"pid\":103,").expect("truncated");
    fs::write(dir.path().join("abc.json"), "{}").expect("bad name");
    fs::write(dir.path().join(".105.json.tmp"), "half").expect("temporary");
    fs::write(dir.path().join("notes.txt"), "not a record").expect("other file");
    let mut source = EmulatedSource::new(dir.path(), procs.path());
    let s = source.sample().expect("sample");
    assert_eq!(s.source, GpuSourceKind::Emulated);
    assert_eq!(source.kind(), GpuSourceKind::Emulated);
    let pids: Vec<u32> = s.processes.iter().map(|p| p.pid).collect();
    assert_eq!(pids, [100, 101]);
    assert_eq!(s.devices.len(), 2);
    assert_eq!(s.devices[0].util_gpu, Some(0.8));
    assert_eq!(s.devices[0].name.as_deref(), Some(EMULATED_DEVICE_NAME));
    assert_eq!(s.devices[1].util_gpu, Some(0.25));
    assert_eq!(s.processes[0].iters_per_s, Some(20.0));
    assert!(s.status().to_string().contains("emulated"));

    let why = |name: &str| {
        source
            .ignored()
            .iter()
            .find(|i| i.path.ends_with(name))
            .map(|i| i.why.clone())
    };
    let stale = why("102.json");
    assert!(
        matches!(stale, Some(Ignored::Stale { age }) if age >= Duration::from_secs(59)),
        "{stale:?}"
    );
    assert_eq!(why("104.json"), Some(Ignored::ProcessGone { pid: 104 }));
    assert!(matches!(why("103.json"), Some(Ignored::Malformed { .. })));
    let bad_name = why("abc.json");
    assert!(
        matches!(&bad_name, Some(Ignored::Malformed { reason: r }) if r.ends_with("not a pid")),
        "{bad_name:?}"
    );
    assert_eq!(source.ignored().len(), 4, "{:?}", source.ignored());
}

/// A FIFO or a symlink named like a record (the directory may be writable by emulators' users)
/// is passed over as malformed: the FIFO used to block the sample in `open` for good.
#[test]
fn emulated_passes_over_fifos_and_symlinks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let procs = proc_with(&[100, 101, 102]);
    publish(dir.path(), 100, 0, 0.5, Duration::ZERO);
    let fifo = std::ffi::CString::new(
        dir.path()
            .join("101.json")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .expect("path");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");
    let elsewhere = dir.path().join("elsewhere");
    fs::create_dir(&elsewhere).expect("dir");
    publish(&elsewhere, 102, 0, 0.5, Duration::ZERO);
    std::os::unix::fs::symlink(elsewhere.join("102.json"), dir.path().join("102.json"))
        .expect("symlink");
    let mut source = EmulatedSource::new(dir.path(), procs.path());
    let s = source.sample().expect("sample");
    let pids: Vec<u32> = s.processes.iter().map(|p| p.pid).collect();
    assert_eq!(pids, [100]);
    let malformed: Vec<&Path> = source
        .ignored()
        .iter()
        .filter(|i| matches!(i.why, Ignored::Malformed { .. }))
        .map(|i| i.path.as_path())
        .collect();
    assert_eq!(malformed.len(), 2, "{:?}", source.ignored());
}

#[test]
fn emulated_rejects_out_of_range_and_mismatched_records() {
    let dir = tempfile::tempdir().expect("tempdir");
    let procs = proc_with(&[7, 8, 9]);
    let now = unix_ms();
    let write = |name: &str, body: String| {
        fs::write(dir.path().join(name), body).expect("write record");
    };
    write(
        "7.json",
        format!(r#"{{"pid":7,"gpu":0,"busy":1.5,"iters_per_s":1,"updated_unix_ms":{now}}}"#),
    );
    write(
        "8.json",
        format!(r#"{{"pid":9,"gpu":0,"busy":0.5,"iters_per_s":1,"updated_unix_ms":{now}}}"#),
    );
    write("9.json", String::new());
    let mut source = EmulatedSource::new(dir.path(), procs.path());
    let s = source.sample().expect("sample");
    assert!(s.processes.is_empty());
    assert!(s.devices.is_empty());
    assert_eq!(source.ignored().len(), 3);
    assert!(source
        .ignored()
        .iter()
        .all(|i| matches!(i.why, Ignored::Malformed { .. })));
}

#[test]
fn emulated_missing_dir_is_empty_and_unreadable_dir_is_an_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut source = EmulatedSource::new(tmp.path().join("absent"), "/proc");
    let s = source.sample().expect("no directory yet");
    assert!(s.devices.is_empty());
    // A file where the directory should be.
    let file = tmp.path().join("file");
    fs::write(&file, "").expect("file");
    let err = EmulatedSource::new(&file, "/proc")
        .sample()
        .expect_err("not a directory");
    assert!(
        err.to_string().contains(&file.display().to_string()),
        "{err}"
    );
}

#[test]
fn emulated_record_round_trip_and_removal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pub_dir = dir.path().join("nested/emulated");
    let record = EmulatedGpuRecord::now(4242, 3, 0.5, 12.5);
    write_emulated_record(&pub_dir, &record).expect("write creates the directory");
    let text = fs::read_to_string(emulated_record_path(&pub_dir, 4242)).expect("read");
    let back: EmulatedGpuRecord = serde_json::from_str(&text).expect("parse");
    assert_eq!(back, record);
    assert!(text.contains("\"busy\":0.5"), "{text}");
    remove_emulated_record(&pub_dir, 4242).expect("remove");
    remove_emulated_record(&pub_dir, 4242).expect("remove again is fine");
    assert!(fs::read_dir(&pub_dir).expect("dir").next().is_none());
}

#[test]
fn emulated_two_processes_on_one_gpu_sum_and_attribute() {
    let dir = tempfile::tempdir().expect("tempdir");
    let procs = proc_with(&[1, 2]);
    publish(dir.path(), 1, 0, 0.7, Duration::ZERO);
    publish(dir.path(), 2, 0, 0.6, Duration::ZERO);
    let s = EmulatedSource::new(dir.path(), procs.path())
        .sample()
        .expect("sample");
    assert_eq!(s.devices[0].util_gpu, Some(1.0));
    let job = job_utilization(&s, &BTreeSet::from([2]));
    assert_eq!(job.source, GpuSourceKind::Emulated);
    assert_eq!(job.per_gpu, BTreeMap::from([(0, 0.6)]));
    assert_eq!(job.iters_per_s, Some(20.0));
}

/// One GPU that does not answer (fallen off the bus) is left out of the snapshot, with why; the
/// others' figures and their processes' attribution stay. Only when no GPU answers is the
/// snapshot an error.
#[test]
fn a_lost_gpu_is_left_out_and_the_others_are_kept() {
    let lost = |index| GpuError::Nvml {
        gpu: Some(index),
        call: "utilization_rates",
        source: NvmlError::GpuLost,
    };
    let read: Vec<_> = (0..8)
        .map(|i| {
            if i == 3 {
                (i, Err(lost(i)))
            } else {
                (
                    i,
                    Ok((device(i, 0.5), vec![process(100 + i, i, Some(0.5))])),
                )
            }
        })
        .collect();
    let snap = assemble(GpuSourceKind::Nvml, 1, read).expect("seven GPUs answered");
    let indices: Vec<u32> = snap.devices.iter().map(|d| d.index).collect();
    assert_eq!(indices, [0, 1, 2, 4, 5, 6, 7]);
    assert_eq!(snap.failed.len(), 1);
    assert_eq!(snap.failed[0].0, 3);
    let on_7 = job_utilization(&snap, &BTreeSet::from([107]));
    assert_eq!(on_7.per_gpu.get(&7), Some(&0.5), "{on_7:?}");
    let status = snap.status().to_string();
    assert!(
        status.starts_with("nvml: 7 GPU(s); GPU 3 left out: NVML utilization_rates"),
        "{status}"
    );

    let none = assemble(GpuSourceKind::Nvml, 1, vec![(0, Err(lost(0)))]);
    assert!(
        matches!(none, Err(GpuError::Nvml { gpu: Some(0), .. })),
        "{none:?}"
    );
}
