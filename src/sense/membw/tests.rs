//! Tests of memory-bandwidth sensing: the MBM reader and rates on the recorded resctrl trees,
//! and per-job monitoring groups on writable copies of them with a fake `/proc`.

use super::*;
use crate::job::JobId;
use crate::sys::resctrlfs::{
    CpuVendor, MbaCaps, ResctrlfsError as MembwError, DEFAULT_RESCTRL_ROOT, TASKS,
};
use crate::testutil::{
    copy_tree, minimal_resctrl as minimal, resctrl_fixture as fixture, simulate_kernel_rmdir, write,
};

fn counter(root: &Path, group: &str, domain: &str) -> PathBuf {
    root.join(group)
        .join(MON_DATA)
        .join(domain)
        .join(MBM_TOTAL_BYTES)
}

/// `s`, stamped exactly `secs` after `first`, so rates are exact.
fn later(first: &MbmSample, mut s: MbmSample, secs: u64) -> MbmSample {
    s.at = first.at + Duration::from_secs(secs);
    s
}

fn bytes(sample: &MbmSample, id: &GroupId, domain: u32) -> MbmReading {
    sample.groups[id].domains[&domain]
}

#[test]
fn intel_fixture_is_mbm_with_every_group() {
    let reader = MbmReader::open(fixture("intel-mba-mbm")).expect("open intel fixture");
    assert_eq!(reader.mon_info().num_rmids, Some(224));
    assert!(reader
        .mon_info()
        .features
        .contains(&"mbm_local_bytes".to_string()));
    let s = reader.sample().expect("sample intel fixture");
    let ids: Vec<String> = s.groups.keys().map(ToString::to_string).collect();
    assert_eq!(
        ids,
        [
            "/",
            "mon_groups/j1",
            "lodger-lodgers",
            "lodger-lodgers/mon_groups/j3"
        ]
    );
    assert_eq!(
        bytes(&s, &GroupId::root(), 0),
        MbmReading::Bytes(41_797_419_466_752)
    );
    assert_eq!(s.groups[&GroupId::root()].domains.len(), 2);
    let j3 = GroupId::monitor(Some("lodger-lodgers"), "j3");
    assert_eq!(s.groups[&j3].domains.len(), 2);
}

#[test]
fn amd_fixture_has_four_l3_domains() {
    let reader = MbmReader::open(fixture("amd")).expect("open amd fixture");
    let s = reader.sample().expect("sample amd fixture");
    let root = &s.groups[&GroupId::root()];
    assert_eq!(
        root.domains.keys().copied().collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert!(s.groups.contains_key(&GroupId::monitor(None, "j2")));
}

#[test]
fn none_fixture_is_unavailable_not_mounted() {
    let err = MbmReader::open(fixture("none")).expect_err("none fixture");
    assert!(err.is_unavailable());
    assert!(err.to_string().contains("not mounted"), "{err}");
    let err = MbaCaps::read(&fixture("none"), &CpuVendor::Intel).expect_err("none fixture");
    assert!(err.to_string().contains("not mounted"), "{err}");
}

#[test]
fn missing_root_is_unavailable_no_resctrl() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let err = MbmReader::open(tmp.path().join("resctrl")).expect_err("absent");
    assert!(err.is_unavailable());
    assert!(err.to_string().contains("CONFIG_X86_CPU_RESCTRL"), "{err}");
}

#[test]
fn no_l3_mon_or_no_mbm_is_unavailable() {
    let tmp = tempfile::tempdir().expect("tempdir");
    fs::create_dir_all(tmp.path().join("info/L3")).expect("info");
    let err = MbmReader::open(tmp.path()).expect_err("no L3_MON");
    assert!(err.is_unavailable());
    assert!(err.to_string().contains("no L3 monitoring"), "{err}");

    write(&tmp.path().join(MON_FEATURES), "llc_occupancy\n");
    let err = MbmReader::open(tmp.path()).expect_err("no mbm");
    assert!(err.is_unavailable());
    assert!(err.to_string().contains("lists llc_occupancy"), "{err}");

    write(&tmp.path().join(MON_FEATURES), "");
    let err = MbmReader::open(tmp.path()).expect_err("empty features");
    assert!(err.to_string().contains("lists nothing"), "{err}");
}

#[test]
fn unavailable_error_and_unassigned_readings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    minimal(
        tmp.path(),
        &[
            ("mon_L3_00", "Unavailable\n"),
            ("mon_L3_01", "Error\n"),
            ("mon_L3_02", "Unassigned\n"),
            ("mon_L3_03", "12345\n"),
        ],
    );
    let s = MbmReader::open(tmp.path())
        .expect("open")
        .sample()
        .expect("sample");
    let root = GroupId::root();
    assert_eq!(bytes(&s, &root, 0), MbmReading::Unavailable);
    assert_eq!(bytes(&s, &root, 1), MbmReading::Error);
    assert_eq!(bytes(&s, &root, 2), MbmReading::Unavailable);
    assert_eq!(bytes(&s, &root, 3), MbmReading::Bytes(12345));
}

#[test]
fn garbage_counter_names_path_and_value() {
    let tmp = tempfile::tempdir().expect("tempdir");
    minimal(tmp.path(), &[("mon_L3_00", "lots\n")]);
    let err = MbmReader::open(tmp.path())
        .expect("open")
        .sample()
        .expect_err("garbage");
    let msg = err.to_string();
    assert!(msg.contains("mon_L3_00/mbm_total_bytes"), "{msg}");
    assert!(msg.contains("'lots'"), "{msg}");
}

#[test]
fn empty_counter_file_is_a_parse_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    minimal(tmp.path(), &[("mon_L3_00", "")]);
    let err = MbmReader::open(tmp.path())
        .expect("open")
        .sample()
        .expect_err("empty");
    assert!(matches!(err, MembwError::Parse { ref value, .. } if value.is_empty()));
}

#[test]
fn garbage_num_rmids_is_a_parse_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    minimal(tmp.path(), &[("mon_L3_00", "1\n")]);
    write(&tmp.path().join(NUM_RMIDS), "many\n");
    let err = MbmReader::open(tmp.path()).expect_err("garbage num_rmids");
    assert!(err.to_string().contains("num_rmids: 'many'"), "{err}");
}

#[test]
fn rates_per_group_domain_and_node_from_the_intel_fixture() {
    let tmp = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture("intel-mba-mbm"), tmp.path());
    let reader = MbmReader::open(tmp.path()).expect("open copy");
    let first = reader.sample().expect("first sample");
    let add = |group: &str, domain: &str, delta: u64| {
        let path = counter(tmp.path(), group, domain);
        let old: u64 = fs::read_to_string(&path)
            .expect("read counter")
            .trim()
            .parse()
            .expect("fixture counter is a number");
        write(&path, &format!("{}\n", old + delta));
    };
    // Two seconds: the root group moves 4 GB on domain 0 and 2 GB on domain 1, of which
    // j1 accounts for 1 GB on domain 0; the lodgers' control group moves 6 GB on domain 1,
    // all of it j3's.
    add("", "mon_L3_00", 4_000_000_000);
    add("", "mon_L3_01", 2_000_000_000);
    add("mon_groups/j1", "mon_L3_00", 1_000_000_000);
    add("lodger-lodgers", "mon_L3_01", 6_000_000_000);
    add("lodger-lodgers/mon_groups/j3", "mon_L3_01", 6_000_000_000);
    let second = later(&first, reader.sample().expect("second sample"), 2);
    let r = rates(&first, &second);
    let root = &r.groups[&GroupId::root()];
    assert_eq!(root.domains[&0], Some(2e9));
    assert_eq!(root.domains[&1], Some(1e9));
    assert_eq!(root.total.bytes_per_s, 3e9);
    assert!(root.total.is_complete());
    assert_eq!(
        r.groups[&GroupId::monitor(None, "j1")].total.bytes_per_s,
        0.5e9
    );
    assert_eq!(
        r.groups[&GroupId::monitor(Some("lodger-lodgers"), "j3")]
            .total
            .bytes_per_s,
        3e9
    );
    // The node counts CTRL_MON groups only: their counts include their mon groups.
    assert_eq!(r.domains[&0].bytes_per_s, 2e9);
    assert_eq!(r.domains[&1].bytes_per_s, 4e9);
    assert_eq!(r.node.bytes_per_s, 6e9);
    assert!(r.node.is_complete());
    assert_eq!(r.node_fraction(12e9), Some(0.5));
    assert_eq!(r.node_fraction(0.0), None);
}

#[test]
fn unavailable_reading_is_left_out_and_counted() {
    let tmp = tempfile::tempdir().expect("tempdir");
    minimal(
        tmp.path(),
        &[("mon_L3_00", "1000\n"), ("mon_L3_01", "1000\n")],
    );
    let reader = MbmReader::open(tmp.path()).expect("open");
    let first = reader.sample().expect("first");
    write(&counter(tmp.path(), "", "mon_L3_00"), "3000\n");
    write(&counter(tmp.path(), "", "mon_L3_01"), "Unavailable\n");
    let second = later(&first, reader.sample().expect("second"), 1);
    let r = rates(&first, &second);
    assert_eq!(r.groups[&GroupId::root()].domains[&1], None);
    assert_eq!(r.node.bytes_per_s, 2000.0);
    assert_eq!(r.node.missing, 1);
    assert!(!r.node.is_complete());
}

#[test]
fn counter_reset_drops_the_delta() {
    let tmp = tempfile::tempdir().expect("tempdir");
    minimal(
        tmp.path(),
        &[("mon_L3_00", "9000000\n"), ("mon_L3_01", "10\n")],
    );
    let reader = MbmReader::open(tmp.path()).expect("open");
    let first = reader.sample().expect("first");
    write(&counter(tmp.path(), "", "mon_L3_00"), "500\n");
    write(&counter(tmp.path(), "", "mon_L3_01"), "110\n");
    let second = later(&first, reader.sample().expect("second"), 1);
    let root = &rates(&first, &second).groups[&GroupId::root()];
    assert_eq!(root.domains[&0], None);
    assert_eq!(root.domains[&1], Some(100.0));
    assert_eq!(root.total.missing, 1);
}

#[test]
fn recreated_group_drops_every_delta() {
    let id = GroupId::monitor(None, "j1");
    let group = |inode, count| GroupSample {
        inode,
        domains: BTreeMap::from([(0, MbmReading::Bytes(count))]),
    };
    let t0 = Instant::now();
    let prev = MbmSample {
        at: t0,
        groups: BTreeMap::from([(id.clone(), group(10, 100))]),
    };
    let cur = MbmSample {
        at: t0 + Duration::from_secs(1),
        groups: BTreeMap::from([(id.clone(), group(11, 5_000))]),
    };
    assert_eq!(rates(&prev, &cur).groups[&id].domains[&0], None);
    let same = MbmSample {
        at: t0 + Duration::from_secs(1),
        groups: BTreeMap::from([(id.clone(), group(10, 5_000))]),
    };
    assert_eq!(rates(&prev, &same).groups[&id].domains[&0], Some(4_900.0));
    // Zero interval: nothing.
    let now = MbmSample { at: t0, ..same };
    assert_eq!(rates(&prev, &now).groups[&id].domains[&0], None);
}

#[test]
fn mon_group_create_move_and_remove_on_a_fixture_tree() {
    let tmp = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture("intel-mba-mbm"), tmp.path());
    let group = MonGroup::create(tmp.path(), None, "j9").expect("create");
    assert_eq!(group.path(), tmp.path().join("mon_groups/j9"));
    assert_eq!(group.id().to_string(), "mon_groups/j9");
    // Idempotent: a second create adopts the existing directory.
    let again = MonGroup::create(tmp.path(), None, "j9").expect("adopt");
    assert_eq!(again, group);
    let moved = group.move_threads(&[100, 101]).expect("move");
    assert_eq!(moved.moved, [100, 101]);
    // This process's threads, found through the real /proc.
    let me = std::process::id();
    let moved = group
        .move_processes(Path::new("/proc"), &[me, u32::MAX])
        .expect("move self");
    assert!(moved.moved.contains(&me), "{moved:?}");
    assert_eq!(moved.gone, [u32::MAX]);
    let tasks = fs::read_to_string(group.path().join(TASKS)).expect("tasks");
    assert!(tasks.starts_with("100\n101\n"), "{tasks}");
    // On resctrl, rmdir succeeds with the kernel's files inside; a plain directory needs
    // them gone first, as the kernel would do.
    fs::remove_file(group.path().join(TASKS)).expect("simulate kernel");
    assert!(group.remove().expect("remove"));
    assert!(!tmp.path().join("mon_groups/j9").exists());
    assert!(!remove_job_mon_group(tmp.path(), None, "j9").expect("already gone"));

    let nested =
        MonGroup::create(tmp.path(), Some("lodger-lodgers"), "j10").expect("nested create");
    assert_eq!(
        nested.path(),
        tmp.path().join("lodger-lodgers/mon_groups/j10")
    );
    assert!(remove_job_mon_group(tmp.path(), Some("lodger-lodgers"), "j10").expect("rm"));
}

#[test]
fn mon_group_refuses_bad_names_and_unmounted_roots() {
    let tmp = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture("intel-mba-mbm"), tmp.path());
    for bad in [
        "",
        ".",
        "..",
        "a/b",
        "mon_groups",
        "info",
        "j 1",
        &"x".repeat(256),
    ] {
        let err = MonGroup::create(tmp.path(), None, bad).expect_err(bad);
        assert!(
            matches!(err, MembwError::BadGroupName { .. }),
            "{bad}: {err}"
        );
    }
    let err = MonGroup::create(tmp.path(), Some("../etc"), "j1").expect_err("bad control");
    assert!(matches!(err, MembwError::BadGroupName { .. }), "{err}");
    let err = MonGroup::create(&fixture("none"), None, "j1").expect_err("not mounted");
    assert!(err.is_unavailable(), "{err}");
    // A control group that does not exist: mkdir fails, with the path.
    let err = MonGroup::create(tmp.path(), Some("nosuch"), "j1").expect_err("no parent");
    assert!(err.to_string().contains("nosuch/mon_groups/j1"), "{err}");
}

#[test]
fn resctrl_absent_is_reported_unavailable() {
    const NAME: &str = "resctrl_absent_is_reported_unavailable";
    if Path::new(DEFAULT_RESCTRL_ROOT).join("info").exists() {
        crate::privileged::not_applicable(NAME, "this host has resctrl mounted");
        return;
    }
    // Without resctrl, open says why (what lodgerd logs once at start); it never guesses.
    let e = match MbmReader::open(DEFAULT_RESCTRL_ROOT) {
        Err(e) => e,
        Ok(_) => panic!("MBM opened where resctrl is not mounted"),
    };
    eprintln!("memory bandwidth sensing off: {e}");
    assert!(
        e.is_unavailable() || matches!(e, MembwError::Io { .. }),
        "{e}"
    );
}

#[test]
fn real_resctrl_is_sampled() {
    const NAME: &str = "real_resctrl_is_sampled";
    if !Path::new(DEFAULT_RESCTRL_ROOT).join("info").exists() {
        crate::privileged::skip_hardware(NAME, "resctrl is not mounted (no RDT/MBM here)");
        return;
    }
    let reader = MbmReader::open(DEFAULT_RESCTRL_ROOT).expect("open the real resctrl");
    reader.sample().expect("sample the real resctrl");
}

// -----------------------------------------------------------------------------------------
// Per-job monitoring groups.

fn job(n: u64) -> JobId {
    JobId::from_seq(n)
}

/// A fake `/proc` with `<pid>/task/<tid>` for each process and its threads.
fn fake_proc(root: &Path, processes: &[(u32, &[u32])]) {
    for (pid, tids) in processes {
        for tid in *tids {
            fs::create_dir_all(
                root.join(pid.to_string())
                    .join("task")
                    .join(tid.to_string()),
            )
            .expect("fake task dir");
        }
    }
}

/// What the kernel does on mkdir of a monitoring group: it fills `mon_data` with a counter
/// per L3 domain.
fn simulate_kernel_mkdir(group: &Path, counters: &[(&str, &str)]) {
    for (domain, value) in counters {
        write(
            &group.join(MON_DATA).join(domain).join(MBM_TOTAL_BYTES),
            value,
        );
    }
}

fn tasks_of(dir: &Path) -> String {
    fs::read_to_string(dir.join(TASKS)).unwrap_or_default()
}

fn sync(groups: &mut JobMonGroups, jobs: &[(JobId, Vec<u32>)]) -> Vec<JobGroupNote> {
    groups.sync(jobs.iter().map(|(id, pids)| (id, pids.as_slice())))
}

#[test]
fn job_groups_are_made_and_follow_new_threads() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
    copy_tree(&fixture("intel-mba-mbm"), &root);
    fake_proc(&proc_root, &[(100, &[100, 101]), (200, &[200])]);
    let mut groups = JobMonGroups::new(&root, &proc_root);
    // Job 3 lists a process that has exited: skipped, not an error.
    let jobs = vec![(job(1), vec![100]), (job(2), vec![200, 999])];
    assert_eq!(sync(&mut groups, &jobs), []);
    let j1 = root.join("mon_groups/lodger-j1");
    assert_eq!(tasks_of(&j1), "100\n101\n");
    assert_eq!(tasks_of(&root.join("mon_groups/lodger-j2")), "200\n");
    assert_eq!(
        groups.groups(&job(1)),
        [GroupId::monitor(None, "lodger-j1")]
    );
    // Other monitoring groups are not touched.
    assert_eq!(
        tasks_of(&root.join("mon_groups/j1")),
        "48211\n48230\n48231\n48232\n48233\n"
    );

    // A second pass writes nothing: every thread is listed already.
    assert_eq!(sync(&mut groups, &jobs), []);
    assert_eq!(tasks_of(&j1), "100\n101\n");

    // A thread started before the group existed (or by a process the job gained) is added.
    fake_proc(&proc_root, &[(100, &[102])]);
    sync(&mut groups, &jobs);
    assert_eq!(tasks_of(&j1), "100\n101\n102\n");

    // The job's process exits: its group is left empty and removed.
    fs::remove_dir_all(proc_root.join("100")).expect("exit");
    simulate_kernel_rmdir(&j1);
    assert_eq!(sync(&mut groups, &jobs), []);
    assert!(!j1.exists());
    assert!(groups.groups(&job(1)).is_empty());
}

#[test]
fn job_bandwidth_per_domain_with_unavailable_and_reset_readings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
    copy_tree(&fixture("amd"), &root);
    fake_proc(&proc_root, &[(100, &[100]), (200, &[200])]);
    let mut groups = JobMonGroups::new(&root, &proc_root);
    let jobs = vec![(job(1), vec![100]), (job(2), vec![200])];
    sync(&mut groups, &jobs);
    let (j1, j2) = (
        root.join("mon_groups/lodger-j1"),
        root.join("mon_groups/lodger-j2"),
    );
    let domains = ["mon_L3_00", "mon_L3_01", "mon_L3_02", "mon_L3_03"];
    simulate_kernel_mkdir(&j1, &domains.map(|d| (d, "1000\n")));
    // A fresh RMID: the AMD kernel says Unavailable until the hardware has a count.
    simulate_kernel_mkdir(&j2, &domains.map(|d| (d, "Unavailable\n")));
    let reader = MbmReader::open(&root).expect("open");
    let first = reader.sample().expect("first");
    // No rates from a single sample.
    let bw = groups.bandwidth(None);
    assert_eq!(bw[&job(1)].bytes_per_s(), None);

    // Two seconds: j1 moves 4 GB on domain 0 and 2 GB on domain 3; domain 1 reads Error and
    // domain 2's counter went backwards (the domain went offline and back).
    write(
        &counter(&root, "mon_groups/lodger-j1", "mon_L3_00"),
        "4000001000\n",
    );
    write(
        &counter(&root, "mon_groups/lodger-j1", "mon_L3_01"),
        "Error\n",
    );
    write(&counter(&root, "mon_groups/lodger-j1", "mon_L3_02"), "10\n");
    write(
        &counter(&root, "mon_groups/lodger-j1", "mon_L3_03"),
        "2000001000\n",
    );
    write(
        &counter(&root, "mon_groups/lodger-j2", "mon_L3_00"),
        "5000\n",
    );
    assert_eq!(sync(&mut groups, &jobs), []);
    let second = later(&first, reader.sample().expect("second"), 2);
    let r = rates(&first, &second);
    let bw = groups.bandwidth(Some(&r));
    let b1 = &bw[&job(1)];
    assert_eq!(b1.domains, BTreeMap::from([(0, 2e9), (3, 1e9)]));
    assert_eq!(b1.total.bytes_per_s, 3e9);
    assert_eq!(b1.total.missing, 2);
    assert_eq!(b1.bytes_per_s(), Some(3e9));
    // j2 has no count anywhere yet: unmeasured, not zero.
    assert_eq!(bw[&job(2)].bytes_per_s(), None);
    assert!(bw[&job(2)].domains.is_empty());

    // The next interval is clean for j1 and j2 starts counting.
    write(
        &counter(&root, "mon_groups/lodger-j1", "mon_L3_01"),
        "3000\n",
    );
    write(
        &counter(&root, "mon_groups/lodger-j2", "mon_L3_00"),
        "1005000\n",
    );
    let third = later(&second, reader.sample().expect("third"), 1);
    let bw = groups.bandwidth(Some(&rates(&second, &third)));
    assert_eq!(bw[&job(1)].bytes_per_s(), Some(0.0));
    assert_eq!(bw[&job(1)].total.missing, 1, "domain 1 was Error before");
    assert_eq!(bw[&job(2)].domains, BTreeMap::from([(0, 1e6)]));
}

#[test]
fn job_group_follows_its_threads_into_lodgers_control_group_and_back() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
    copy_tree(&fixture("intel-mba-mbm"), &root);
    fake_proc(&proc_root, &[(300, &[300, 301])]);
    let mut groups = JobMonGroups::new(&root, &proc_root);
    let jobs = vec![(job(3), vec![300])];
    sync(&mut groups, &jobs);
    let in_default = root.join("mon_groups/lodger-j3");
    assert_eq!(tasks_of(&in_default), "300\n301\n");

    // Contention control moves the job into lodger's control group for MBA: the kernel
    // lists the threads there, and takes them out of their monitoring group.
    let control = root.join("lodger-lodgers");
    fs::write(control.join(TASKS), "300\n301\n").expect("move to control group");
    simulate_kernel_rmdir(&in_default);
    assert_eq!(sync(&mut groups, &jobs), []);
    let in_control = control.join("mon_groups/lodger-j3");
    assert_eq!(tasks_of(&in_control), "300\n301\n");
    assert!(!in_default.exists(), "the emptied group is removed");
    assert_eq!(
        groups.groups(&job(3)),
        [GroupId::monitor(Some("lodger-lodgers"), "lodger-j3")]
    );
    // The other job's group under the control group is not touched.
    assert_eq!(tasks_of(&control.join("mon_groups/j3")), "51002\n51003\n");

    // A thread started meanwhile in the default group: the job has a group under each, and
    // its bandwidth is their sum.
    fake_proc(&proc_root, &[(300, &[302])]);
    sync(&mut groups, &jobs);
    assert_eq!(tasks_of(&in_default), "302\n");
    simulate_kernel_mkdir(&in_default, &[("mon_L3_00", "0\n"), ("mon_L3_01", "0\n")]);
    simulate_kernel_mkdir(&in_control, &[("mon_L3_00", "0\n"), ("mon_L3_01", "0\n")]);
    let reader = MbmReader::open(&root).expect("open");
    let first = reader.sample().expect("first");
    write(
        &in_default.join("mon_data/mon_L3_00/mbm_total_bytes"),
        "100\n",
    );
    write(
        &in_control.join("mon_data/mon_L3_00/mbm_total_bytes"),
        "200\n",
    );
    write(
        &in_control.join("mon_data/mon_L3_01/mbm_total_bytes"),
        "50\n",
    );
    let second = later(&first, reader.sample().expect("second"), 1);
    let bw = &groups.bandwidth(Some(&rates(&first, &second)))[&job(3)];
    assert_eq!(bw.domains, BTreeMap::from([(0, 300.0), (1, 50.0)]));
    assert!(bw.total.is_complete());

    // Throttling ends and the control group is removed with its monitoring groups: the
    // threads are back in the default group.
    simulate_kernel_rmdir(&control);
    fs::remove_dir(&control).expect("rmdir control group");
    assert_eq!(sync(&mut groups, &jobs), []);
    assert_eq!(tasks_of(&in_default), "302\n300\n301\n");
    assert_eq!(
        groups.groups(&job(3)),
        [GroupId::monitor(None, "lodger-j3")]
    );
}

#[test]
fn job_groups_go_when_the_job_leaves_and_when_everything_stops() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
    copy_tree(&fixture("intel-mba-mbm"), &root);
    fake_proc(&proc_root, &[(100, &[100]), (200, &[200])]);
    let mut groups = JobMonGroups::new(&root, &proc_root);
    sync(&mut groups, &[(job(1), vec![100]), (job(2), vec![200])]);
    let (j1, j2) = (
        root.join("mon_groups/lodger-j1"),
        root.join("mon_groups/lodger-j2"),
    );
    simulate_kernel_rmdir(&j1);
    assert_eq!(sync(&mut groups, &[(job(2), vec![200])]), []);
    assert!(!j1.exists() && j2.exists());
    assert_eq!(groups.bandwidth(None).keys().collect::<Vec<_>>(), [&job(2)]);

    // A removal that fails is said, with the path.
    let notes = groups.remove_all();
    assert!(
        matches!(&notes[..], [JobGroupNote::Failed { job: failed, error }]
            if *failed == job(2) && error.contains("mon_groups/lodger-j2")),
        "{notes:?}"
    );
    // The job is forgotten either way; the kernel would have removed the group.
    assert!(groups.bandwidth(None).is_empty());
    simulate_kernel_rmdir(&j2);
    fs::remove_dir(&j2).expect("rmdir");

    sync(&mut groups, &[(job(1), vec![100])]);
    simulate_kernel_rmdir(&j1);
    assert_eq!(groups.forget(&job(1)), []);
    assert!(!j1.exists());
}

#[test]
fn stale_sweep_removes_only_lodgers_groups() {
    let tmp = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture("intel-mba-mbm"), tmp.path());
    for dir in [
        "mon_groups/lodger-j9",
        "lodger-lodgers/mon_groups/lodger-j4",
    ] {
        fs::create_dir_all(tmp.path().join(dir)).expect("stale group");
    }
    let swept = sweep_job_groups(tmp.path()).expect("sweep");
    assert!(swept.failed.is_empty(), "{:?}", swept.failed);
    let removed: Vec<String> = swept.removed.iter().map(ToString::to_string).collect();
    assert_eq!(
        removed,
        [
            "mon_groups/lodger-j9",
            "lodger-lodgers/mon_groups/lodger-j4"
        ]
    );
    assert!(tmp.path().join("mon_groups/j1").is_dir());
    assert!(tmp.path().join("lodger-lodgers/mon_groups/j3").is_dir());
    // Nothing left: nothing to do.
    assert!(sweep_job_groups(tmp.path())
        .expect("again")
        .removed
        .is_empty());
    // A stale group the kernel will not remove is reported, not fatal.
    write(&tmp.path().join("mon_groups/lodger-j5/tasks"), "1\n");
    let swept = sweep_job_groups(tmp.path()).expect("sweep");
    assert_eq!(swept.failed.len(), 1);
    assert!(
        swept.failed[0].to_string().contains("lodger-j5"),
        "{:?}",
        swept.failed
    );
    // No resctrl: unavailable, as for reading.
    assert!(sweep_job_groups(&fixture("none"))
        .expect_err("none")
        .is_unavailable());
}

#[test]
fn out_of_rmids_makes_one_job_unavailable_with_one_note_and_a_quiet_retry() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().expect("tempdir");
    let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
    copy_tree(&fixture("intel-mba-mbm"), &root);
    fake_proc(&proc_root, &[(100, &[100]), (200, &[200])]);
    // The kernel's RMID allocator, which a plain directory lacks: one RMID is free.
    let free = Arc::new(AtomicU32::new(1));
    let attempts = Arc::new(AtomicU32::new(0));
    let (f, a) = (free.clone(), attempts.clone());
    let mut groups = JobMonGroups::new(&root, &proc_root).with_create(Box::new(
        move |root: &Path, control: Option<&str>, name: &str| {
            a.fetch_add(1, Ordering::SeqCst);
            if f.load(Ordering::SeqCst) == 0 {
                let path = root.join(GroupId::monitor(control, name).relative_path());
                return Err(create_error(
                    root,
                    path,
                    io::Error::from_raw_os_error(libc::ENOSPC),
                ));
            }
            f.fetch_sub(1, Ordering::SeqCst);
            MonGroup::create(root, control, name)
        },
    ));
    let jobs = vec![(job(1), vec![100]), (job(2), vec![200])];
    let notes = sync(&mut groups, &jobs);
    let [JobGroupNote::Unavailable {
        job: refused,
        reason,
    }] = &notes[..]
    else {
        panic!("one note: {notes:?}");
    };
    assert_eq!(*refused, job(2));
    assert!(reason.contains("no free RMID: 224"), "{reason}");
    assert!(reason.contains("mon_groups/lodger-j2"), "{reason}");
    assert!(!root.join("mon_groups/lodger-j2").exists());
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    let bw = groups.bandwidth(None);
    assert_eq!(bw[&job(2)].unavailable.as_deref(), Some(reason.as_str()));
    assert_eq!(bw[&job(2)].bytes_per_s(), None);
    assert_eq!(bw[&job(1)].unavailable, None);

    // No error loop: the next passes say nothing and do not try again at once.
    for _ in 1..CREATE_RETRY_PASSES {
        assert_eq!(sync(&mut groups, &jobs), []);
    }
    assert_eq!(attempts.load(Ordering::SeqCst), 2);
    // Still none free at the retry: tried once, quietly.
    assert_eq!(sync(&mut groups, &jobs), []);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);

    // Job 1 leaves and its RMID is free again: job 2 gets a group at the next retry.
    simulate_kernel_rmdir(&root.join("mon_groups/lodger-j1"));
    let jobs = vec![(job(2), vec![200])];
    sync(&mut groups, &jobs);
    free.fetch_add(1, Ordering::SeqCst);
    let mut notes = Vec::new();
    for _ in 0..CREATE_RETRY_PASSES {
        notes.extend(sync(&mut groups, &jobs));
    }
    assert_eq!(notes, [JobGroupNote::Measured { job: job(2) }]);
    assert_eq!(tasks_of(&root.join("mon_groups/lodger-j2")), "200\n");
    assert_eq!(groups.bandwidth(None)[&job(2)].unavailable, None);
}

#[test]
fn a_failure_that_repeats_is_said_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (root, proc_root) = (tmp.path().join("resctrl"), tmp.path().join("proc"));
    copy_tree(&fixture("intel-mba-mbm"), &root);
    fake_proc(&proc_root, &[(100, &[100])]);
    let mut groups = JobMonGroups::new(&root, &proc_root);
    let jobs = vec![(job(1), vec![100])];
    write(&root.join("lodger-lodgers/tasks"), "garbage\n");
    let notes = sync(&mut groups, &jobs);
    assert!(
        matches!(&notes[..], [JobGroupNote::Failed { error, .. }]
            if error.contains("lodger-lodgers/tasks") && error.contains("'garbage'")),
        "{notes:?}"
    );
    assert_eq!(sync(&mut groups, &jobs), []);
    // Nothing was written while the control groups could not be read.
    assert!(!root.join("mon_groups/lodger-j1").exists());
    write(&root.join("lodger-lodgers/tasks"), "");
    assert_eq!(sync(&mut groups, &jobs), []);
    assert_eq!(tasks_of(&root.join("mon_groups/lodger-j1")), "100\n");
}

#[test]
fn keep_threads_writes_only_missing_threads_and_sees_a_vanished_group() {
    let tmp = tempfile::tempdir().expect("tempdir");
    copy_tree(&fixture("intel-mba-mbm"), tmp.path());
    let group = MonGroup::create(tmp.path(), None, "lodger-j1").expect("create");
    let done = group.keep_threads(&[5, 6]).expect("keep").expect("present");
    assert_eq!(done.moved, [5, 6]);
    let done = group
        .keep_threads(&[5, 6, 7])
        .expect("keep")
        .expect("present");
    assert_eq!(done.moved, [7]);
    assert_eq!(tasks_of(group.path()), "5\n6\n7\n");
    simulate_kernel_rmdir(group.path());
    fs::remove_dir(group.path()).expect("rmdir");
    assert_eq!(group.keep_threads(&[5]).expect("gone"), None);
}
