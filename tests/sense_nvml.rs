//! GPU sensing through NVML without a GPU: tests/fixtures/nvml/fake_nvml.c, a small shared
//! object with the NVML calls lodger makes, built here with `cc` and loaded through
//! nvml-wrapper's library path (`NvmlSource::open_library`). So the NVML path (device figures,
//! per-process memory and SM attribution) runs for real in CI, and, as root, lodgerd on it: a
//! job's GPU share and right-sizing from NVML's per-process utilization. The library itself
//! needs no privileges.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

use lodger::sense::gpu::{GpuSource, GpuSourceKind, NvmlSource};

/// Builds the fake library into `dir`; None (a privilege-class skip: a missing tool, which
/// `.ci/run` installs) without a C compiler.
fn build_fake_nvml(test: &str, dir: &Path) -> Option<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvml/fake_nvml.c");
    assert!(source.is_file(), "fixture {} is missing", source.display());
    let out = dir.join("libnvidia-ml.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(&source)
        .output();
    match built {
        Ok(o) if o.status.success() => Some(out),
        Ok(o) => panic!(
            "{cc} could not build the fake NVML: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            lodger::privileged::skip(test, &format!("no C compiler ({cc}): {e}"));
            None
        }
    }
}

#[test]
fn nvml_devices_and_per_process_attribution_from_a_fake_library() {
    let test = "nvml_devices_and_per_process_attribution_from_a_fake_library";
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = build_fake_nvml(test, dir.path()) else {
        return;
    };
    // The fake reports these pids on GPU 0; read at each call, so set before opening. This
    // test binary runs its tests as threads of one process: only this test sets it.
    let me = std::process::id();
    std::env::set_var("FAKE_NVML_PIDS", format!("{me},1"));
    let mut nvml = NvmlSource::open_library(&lib).expect("open the fake NVML");
    assert_eq!(nvml.kind(), GpuSourceKind::Nvml);
    let s = nvml.sample().expect("sample");
    assert_eq!(s.source, GpuSourceKind::Nvml);
    assert_eq!(s.devices.len(), 2, "{s:#?}");
    let d0 = &s.devices[0];
    assert_eq!(d0.index, 0);
    assert_eq!(d0.name.as_deref(), Some("Fake GPU 0"));
    assert_eq!(d0.uuid.as_deref(), Some("GPU-fake-0"));
    assert_eq!(d0.util_gpu, Some(0.75));
    assert_eq!(d0.util_memory, Some(0.30));
    assert_eq!(d0.sm_clock_mhz, Some(1410));
    assert_eq!(d0.memory_used_bytes, Some(4 << 30));
    assert_eq!(d0.memory_total_bytes, Some(80 << 30));
    assert_eq!(d0.power_mw, Some(250_000));
    assert_eq!(d0.pcie_tx_kb_per_s, Some(1000));
    assert_eq!(d0.pcie_rx_kb_per_s, Some(2000));
    let d1 = &s.devices[1];
    assert_eq!(d1.util_gpu, Some(0.0));
    assert_eq!(d1.name.as_deref(), Some("Fake GPU 1"));

    // Per-process attribution: both pids on GPU 0 with their memory and SM share, none on 1.
    let mut procs: Vec<_> = s.processes.iter().collect();
    procs.sort_by_key(|p| p.pid);
    assert_eq!(procs.len(), 2, "{s:#?}");
    for p in &procs {
        assert_eq!(p.gpu, 0);
        assert_eq!(p.used_memory_bytes, Some(1 << 30));
        assert_eq!(p.sm_util, Some(0.6));
        assert_eq!(p.mem_util, Some(0.2));
    }
    assert!(procs.iter().any(|p| p.pid == me));

    // Without PCIe counters the rest is the same (a fresh source: one caches its last sample
    // for a moment).
    drop(nvml);
    let mut nvml = NvmlSource::open_library(&lib)
        .expect("open the fake NVML")
        .with_pcie(false);
    let s = nvml.sample().expect("sample");
    assert_eq!(s.devices[0].pcie_tx_kb_per_s, None);
    assert_eq!(s.devices[0].util_gpu, Some(0.75));
}

#[test]
fn a_library_without_nvml_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let not_nvml = dir.path().join("libnvidia-ml.so.1");
    std::fs::write(&not_nvml, "not a shared object").expect("write");
    let e = NvmlSource::open_library(&not_nvml).expect_err("refused");
    assert!(e.to_string().starts_with("NVML unavailable"), "{e}");
    assert!(
        e.to_string().contains(&not_nvml.display().to_string()),
        "{e}"
    );
}

/// lodgerd itself on NVML (`sense.gpu = "nvml"`), loading the fake through `LD_LIBRARY_PATH`:
/// the node's GPUs and a training job's GPU share come from NVML's per-process figures.
#[test]
fn lodgerd_attributes_nvml_process_utilization_to_the_job() {
    let test = "lodgerd_attributes_nvml_process_utilization_to_the_job";
    if !need_root(test) {
        return;
    }
    // Its SCHED_RR training workload would share the CPUs the grow test measures on.
    let _measuring = measuring();
    let dir = tempfile::tempdir().expect("tempdir");
    let lib_dir = dir.path().join("nvml");
    std::fs::create_dir(&lib_dir).expect("mkdir");
    let Some(_lib) = build_fake_nvml(test, &lib_dir) else {
        return;
    };
    let bus = PrivateBus::start();
    let w = Workload::train(1);
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            extra: "[sense]\ninterval_ms = 200\ngpu = \"nvml\"\n".into(),
            env: vec![
                ("LD_LIBRARY_PATH".into(), lib_dir.display().to_string()),
                ("FAKE_NVML_PIDS".into(), w.pid().to_string()),
            ],
            ..DaemonOptions::default()
        },
    );
    let id = d.register_pid(w.pid(), 1);
    let deadline = std::time::Instant::now() + WAIT;
    let last = loop {
        let last = d.ctl_json(&["top", "--once"]);
        if last["jobs"][0]["metrics"]["gpu_percent"].is_number() {
            break last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "top never showed the job's GPU use; last: {last}\n{}",
            d.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let job = &last["jobs"][0];
    assert_eq!(job["id"], id.as_str());
    assert_eq!(job["metrics"]["gpu_source"], "nvml", "{last}");
    let gpu = job["metrics"]["gpu_percent"].as_f64().expect("gpu");
    assert!((gpu - 60.0).abs() < 0.5, "the fake's 60 % SM: {last}");
    assert_eq!(last["node"]["gpus"][0]["source"], "nvml", "{last}");
    assert_eq!(
        last["node"]["gpus"].as_array().map(|g| g.len()),
        Some(2),
        "{last}"
    );
}

/// Right-sizing on NVML's figures (SODA §V-B): lodgerd on the fake NVML, which reports the
/// training emulator's published busy fraction as the job's SM utilization
/// (`FAKE_NVML_EMULATED_DIR`), grows a CPU-starved job from one core to two. So the path from
/// NVML's per-process samples through attribution to the right-sizer and the job's cpuset runs
/// for real; the emulator's progress, and so what NVML reports, depends on the cores it gets.
#[test]
fn lodgerd_grows_a_starved_job_from_nvml_utilization() {
    let test = "nvml_rightsize_grows";
    if !need_root(test) {
        return;
    }
    let Some((reserved, two)) = two_job_cpus(test) else {
        return;
    };
    let _measuring = measuring();
    let dir = tempfile::tempdir().expect("tempdir");
    let lib_dir = dir.path().join("nvml");
    std::fs::create_dir(&lib_dir).expect("mkdir");
    let Some(_lib) = build_fake_nvml(test, &lib_dir) else {
        return;
    };
    let gpu_dir = dir.path().join("gpu");
    let bus = PrivateBus::start();
    let d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            reserved,
            extra: "[sense]\ninterval_ms = 1000\ngpu = \"nvml\"\n\n\
                    [rightsize]\nwarmup_seconds = 2\nwindow_seconds = 6\ntolerance_cores = 0\n"
                .into(),
            env: vec![
                ("LD_LIBRARY_PATH".into(), lib_dir.display().to_string()),
                (
                    "FAKE_NVML_EMULATED_DIR".into(),
                    gpu_dir.display().to_string(),
                ),
            ],
            ..DaemonOptions::default()
        },
    );
    // Heavy CPU side (as in tests/rightsize.rs): two loaders of STARVING_BATCH_CPU_MS per batch;
    // one core starves the emulated GPU, two keep it busier.
    let w = Workload::train_with(
        2,
        &[
            "--batch-cpu-ms",
            STARVING_BATCH_CPU_MS,
            "--publish-dir",
            gpu_dir.to_str().expect("utf-8"),
        ],
    );
    let id = d.register_pid(w.pid(), 1);
    assert_eq!(d.job(&id)["cpus"].as_str().map(|c| cpus(c).len()), Some(1));
    // lodgerd reads the job's GPU share from NVML, not from the emulator's files.
    let mut top = serde_json::Value::Null;
    wait_until(WAIT, "top to show the job's GPU share from NVML", || {
        top = d.ctl_json(&["top", "--once"]);
        top["jobs"][0]["metrics"]["gpu_percent"].is_number()
    });
    assert_eq!(top["jobs"][0]["metrics"]["gpu_source"], "nvml", "{top}");
    assert_eq!(top["node"]["gpus"][0]["source"], "nvml", "{top}");
    let mut job = serde_json::Value::Null;
    wait_until(
        std::time::Duration::from_secs(120),
        "right-sizing to settle",
        || {
            job = d.job(&id);
            job["rightsize"]
                .as_str()
                .is_some_and(|s| s.starts_with("settled"))
        },
    );
    let want = cpus(&format!("{},{}", two[0], two[1])).to_list();
    if job["cpus"] != want.as_str() {
        // As in tests/rightsize.rs: growing pays only where the second core is real CPU time.
        drop(w);
        if let Err(why) = second_core_speeds_up(2, &["--batch-cpu-ms", STARVING_BATCH_CPU_MS], two)
        {
            lodger::privileged::skip_hardware(test, &why);
            return;
        }
        panic!("not grown to {want}: {job}\n{}", d.log());
    }
    // Enforcement follows the resize at the next ticks: wait for it, bounded.
    wait_until(WAIT, "every thread SCHED_RR on its new cpuset", || {
        all_rr_on(w.pid(), 10, &want)
    });
}
