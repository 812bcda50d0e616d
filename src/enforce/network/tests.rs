//! Tests of network shaping: the HTB tree, nftables steering, configuration and `net_cls`
//! groups, against recorded `tc`/`nft` output.

use std::fs;

use super::htb::close;
use super::*;
use crate::sys::cgroupfs::CGROUP_PROCS;

const NO_TABLE: &str = "Error: No such file or directory\nlist table inet lodger\n";
const DEFAULT_ROOT: &str = "qdisc noqueue 0: root refcnt 2 \n";
const OUR_ROOT: &str =
    "qdisc htb 4c44: root refcnt 3 r2q 10 default 0x10 direct_packets_stat 0 direct_qlen 1000\n";
// As iproute2 6.1 prints the tree lodger builds at 100 Mbit/s (recorded in a netns).
const OUR_CLASSES: &str = "\
class htb 4c44:10 parent 4c44:1 prio 0 rate 75Mbit ceil 100Mbit burst 1584b cburst 1600b 
class htb 4c44:1 root rate 100Mbit ceil 100Mbit burst 1600b cburst 1600b 
class htb 4c44:20 parent 4c44:1 prio 0 rate 25Mbit ceil 25Mbit burst 1600b cburst 1600b 
";
const CGROUP_FILTER: &str = "\
filter parent 4c44: protocol all pref 10 cgroup chain 0 
filter parent 4c44: protocol all pref 10 cgroup chain 0 handle 0x1 
";
const FW_FILTER: &str = "\
filter parent 4c44: protocol all pref 20 fw chain 0 
filter parent 4c44: protocol all pref 20 fw chain 0 handle 0x4c440020 classid 4c44:20 
";

fn config(interfaces: &[&str]) -> ShapingConfig {
    ShapingConfig {
        links: interfaces
            .iter()
            .map(|i| Link {
                interface: i.to_string(),
                line_rate_mbit: 100,
            })
            .collect(),
        ..ShapingConfig::default()
    }
}

/// An nft -j listing of lodger's table holding rules with these comments.
fn table_json(comments: &[String]) -> String {
    let mut items = vec![
            r#"{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}"#.to_string(),
            r#"{"table": {"family": "inet", "name": "lodger", "handle": 1}}"#.to_string(),
            r#"{"chain": {"family": "inet", "table": "lodger", "name": "output", "handle": 1, "type": "filter", "hook": "output", "prio": -150, "policy": "accept"}}"#.to_string(),
        ];
    for (i, c) in comments.iter().enumerate() {
        items.push(format!(
                r#"{{"rule": {{"family": "inet", "table": "lodger", "chain": "output", "handle": {}, "comment": "{c}", "expr": []}}}}"#,
                i + 2
            ));
    }
    format!("{{\"nftables\": [{}]}}\n", items.join(", "))
}

fn fresh() -> RecordingRunner {
    let mut r = RecordingRunner::new();
    r.reply(&["tc", "qdisc", "show"], DEFAULT_ROOT)
        .fail(&["nft", "-j", "list"], NO_TABLE);
    r
}

fn shaped(filters: &str) -> RecordingRunner {
    let mut r = RecordingRunner::new();
    r.reply(&["tc", "qdisc", "show"], OUR_ROOT)
        .reply(&["tc", "class", "show"], OUR_CLASSES)
        .reply(&["tc", "filter", "show"], filters)
        .fail(&["nft", "-j", "list"], NO_TABLE);
    r
}

#[test]
fn v1_cgroup_filter_on_a_fresh_interface() {
    let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::TcFilter).expect("new");
    let mut r = fresh();
    let applied = shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
    assert_eq!(
        applied,
        Applied {
            changed: true,
            steering: Steering::TcFilter
        }
    );
    assert_eq!(
            r.lines(),
            [
                "nft -j list table inet lodger",
                "tc qdisc show dev eth0",
                "tc qdisc replace dev eth0 root handle 4c44: htb default 10",
                "tc class replace dev eth0 parent 4c44: classid 4c44:1 htb rate 100000000bit ceil 100000000bit quantum 200000",
                "tc class replace dev eth0 parent 4c44:1 classid 4c44:10 htb rate 75000000bit ceil 100000000bit quantum 200000",
                "tc class replace dev eth0 parent 4c44:1 classid 4c44:20 htb rate 25000000bit ceil 25000000bit quantum 200000",
                "tc filter add dev eth0 parent 4c44: protocol all prio 10 handle 1: cgroup",
            ]
        );
    // The class id a CPU job's net_cls cgroup gets: 4c44:20.
    assert_eq!(shaping.net_cls_classid(), 0x4c44_0020);
    assert_eq!(shaping.net_cls_classid(), 1_279_524_896);
}

#[test]
fn an_interface_already_shaped_is_only_read() {
    let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::TcFilter).expect("new");
    let mut r = shaped(CGROUP_FILTER);
    let applied = shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
    assert!(!applied.changed);
    assert!(r.changes().is_empty(), "{:?}", r.changes());
    assert_eq!(
        r.lines(),
        [
            "nft -j list table inet lodger",
            "tc qdisc show dev eth0",
            "tc class show dev eth0",
            "tc filter show dev eth0 parent 4c44:",
        ]
    );
}

#[test]
fn drift_is_repaired_in_place() {
    let shaper = Shaper::new(
        Link {
            interface: "ib0".to_string(),
            line_rate_mbit: 100,
        },
        &ShapingConfig::default(),
    )
    .expect("shaper");
    let mut r = RecordingRunner::new();
    // Someone changed the CPU jobs' ceil, added a class and a filter of their own.
    let classes = OUR_CLASSES.replace("rate 25Mbit ceil 25Mbit", "rate 25Mbit ceil 50Mbit")
        + "class htb 4c44:30 parent 4c44:1 prio 0 rate 1Mbit ceil 1Mbit burst 1600b cburst 1600b\n";
    r.reply(&["tc", "qdisc", "show"], OUR_ROOT)
        .reply(&["tc", "class", "show"], &classes)
        .reply(
            &["tc", "filter", "show"],
            &format!("{CGROUP_FILTER}filter parent 4c44: protocol ip pref 49152 u32 chain 0 \n"),
        );
    assert!(shaper.apply(&mut r, TcFilter::Cgroup).expect("apply"));
    assert_eq!(
            r.changes(),
            [
                "tc class replace dev ib0 parent 4c44:1 classid 4c44:20 htb rate 25000000bit ceil 25000000bit quantum 200000",
                "tc class del dev ib0 classid 4c44:30",
                "tc filter del dev ib0 parent 4c44: prio 10",
                "tc filter del dev ib0 parent 4c44: prio 49152",
                "tc filter add dev ib0 parent 4c44: protocol all prio 10 handle 1: cgroup",
            ]
        );
}

#[test]
fn v2_nft_mark_and_fw_filter() {
    let mut shaping =
        NetworkShaping::new(&config(&["eth0", "ib0"]), Steering::TcFilter).expect("new");
    let jobs = CpuJobs::CgroupV2(vec![
        "lodger/j3".to_string(),
        "system.slice/batch.service".to_string(),
    ]);
    let mut r = fresh();
    assert!(shaping.apply(&mut r, &jobs).expect("apply").changed);
    let (_, rules) = shaping.classification(&jobs, Steering::TcFilter);
    assert_eq!(
        rules[0].statement(),
        "socket cgroupv2 level 2 \"lodger/j3\" meta mark set 0x4c440020"
    );
    let changes = r.changes();
    assert_eq!(
            changes[0],
            format!(
                "nft add table inet lodger ; delete table inet lodger ; add table inet lodger ; \
                 add chain inet lodger output {{ type filter hook output priority mangle ; policy accept ; }} ; \
                 add rule inet lodger output socket cgroupv2 level 2 \"lodger/j3\" meta mark set 0x4c440020 comment \"{}\" ; \
                 add rule inet lodger output socket cgroupv2 level 2 \"system.slice/batch.service\" meta mark set 0x4c440020 comment \"{}\"",
                rules[0].fingerprint(),
                rules[1].fingerprint()
            )
        );
    // One nft invocation: nft applies it as one transaction.
    assert_eq!(r.calls[1].first().map(String::as_str), Some("nft"));
    for dev in ["eth0", "ib0"] {
        let fw = format!(
                "tc filter add dev {dev} parent 4c44: protocol all prio 20 handle 0x4c440020 fw classid 4c44:20"
            );
        assert!(changes.contains(&fw), "{changes:?}");
    }
    assert_eq!(changes.len(), 1 + 2 * 5);

    // Applied again over what it made: nothing changes.
    let comments: Vec<String> = rules.iter().map(NftRule::fingerprint).collect();
    let mut r = shaped(FW_FILTER);
    r.reply(&["nft", "-j", "list"], &table_json(&comments));
    assert!(!shaping.apply(&mut r, &jobs).expect("again").changed);
    assert!(r.changes().is_empty(), "{:?}", r.changes());

    // A job's cgroup goes: the table is rebuilt without it.
    let fewer = CpuJobs::CgroupV2(vec!["lodger/j3".to_string()]);
    let mut r = shaped(FW_FILTER);
    r.reply(&["nft", "-j", "list"], &table_json(&comments));
    assert!(shaping.apply(&mut r, &fewer).expect("fewer").changed);
    assert_eq!(r.changes().len(), 1);
    assert!(!r.changes()[0].contains("batch.service"));

    // No CPU job left: no rules, no table; the fw filter stays for the next one.
    let mut r = shaped(FW_FILTER);
    r.reply(&["nft", "-j", "list"], &table_json(&comments));
    assert!(
        shaping
            .apply(&mut r, &CpuJobs::CgroupV2(Vec::new()))
            .expect("none")
            .changed
    );
    assert_eq!(r.changes(), ["nft delete table inet lodger"]);
}

#[test]
fn nft_priority_steering_needs_no_filter() {
    let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::Nft).expect("new");
    let mut r = fresh();
    shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
    let changes = r.changes();
    assert!(
            changes[0].ends_with(&format!(
                "add rule inet lodger output meta cgroup 1279524896 meta priority set 4c44:20 comment \"{}\"",
                NftRule {
                    matches: CpuJobMatch::NetClsClassid(1_279_524_896),
                    action: NftAction::Priority(shaping.cpu_jobs_class()),
                }
                .fingerprint()
            )),
            "{changes:?}"
        );
    assert!(
        !changes.iter().any(|c| c.contains("filter add")),
        "{changes:?}"
    );
    let v2 = CpuJobs::CgroupV2(vec!["lodger/j9".to_string()]);
    let (filter, rules) = shaping.classification(&v2, Steering::Nft);
    assert_eq!(filter, TcFilter::None);
    assert_eq!(
        rules[0].statement(),
        "socket cgroupv2 level 2 \"lodger/j9\" meta priority set 4c44:20"
    );
}

#[test]
fn auto_falls_back_to_nft_when_the_kernel_lacks_the_classifier() {
    let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::Auto).expect("new");
    let mut r = fresh();
    r.fail(
        &["tc", "filter", "add"],
        "Error: TC classifier not found.\nWe have an error talking to the kernel",
    );
    let applied = shaping.apply(&mut r, &CpuJobs::NetCls).expect("apply");
    assert_eq!(applied.steering, Steering::Nft);
    assert!(applied.changed);
    assert_eq!(shaping.steering(), Steering::Nft);
    let lines = r.lines();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("meta cgroup 1279524896 meta priority set 4c44:20")),
        "{lines:?}"
    );
    // Steering is remembered: the next apply does not try the filter again.
    let mut r = shaped("");
    let rules = shaping.classification(&CpuJobs::NetCls, Steering::Nft).1;
    r.reply(
        &["nft", "-j", "list"],
        &table_json(&[rules[0].fingerprint()]),
    );
    assert!(
        !shaping
            .apply(&mut r, &CpuJobs::NetCls)
            .expect("again")
            .changed
    );
    assert!(r.changes().is_empty(), "{:?}", r.changes());

    // Asked for filters explicitly, a missing classifier is an error that says so.
    let mut strict = NetworkShaping::new(&config(&["eth0"]), Steering::TcFilter).expect("new");
    let mut r = fresh();
    r.fail(&["tc", "filter", "add"], "Error: TC classifier not found.");
    let err = strict
        .apply(&mut r, &CpuJobs::NetCls)
        .expect_err("no cls_cgroup");
    assert!(
        matches!(err, TcError::ClassifierMissing { kind: "cgroup", .. }),
        "{err}"
    );
}

#[test]
fn foreign_root_is_refused_unless_allowed() {
    let shaper = Shaper::new(
        Link {
            interface: "eth0".to_string(),
            line_rate_mbit: 1000,
        },
        &ShapingConfig::default(),
    )
    .expect("shaper");
    let mut r = RecordingRunner::new();
    r.reply(
        &["tc", "qdisc", "show"],
        "qdisc tbf 8001: root refcnt 2 rate 500Mbit burst 64Kb lat 50ms \n",
    );
    let err = shaper.apply(&mut r, TcFilter::Cgroup).expect_err("foreign");
    assert!(err.to_string().contains("tbf 8001:"), "{err}");
    assert!(r.changes().is_empty());
    // Removal leaves it alone too.
    assert!(!shaper.remove(&mut r).expect("remove"));
    assert!(r.changes().is_empty());

    let allowed = ShapingConfig {
        replace_foreign_root: true,
        ..ShapingConfig::default()
    };
    let shaper = Shaper::new(
        Link {
            interface: "eth0".to_string(),
            line_rate_mbit: 1000,
        },
        &allowed,
    )
    .expect("shaper");
    assert!(shaper.apply(&mut r, TcFilter::None).expect("replace"));
    assert_eq!(
        r.changes()[0],
        "tc qdisc replace dev eth0 root handle 4c44: htb default 10"
    );
    assert!(r.changes()[1].contains("rate 1000000000bit"));
    assert_eq!(r.changes().len(), 4);
}

#[test]
fn remove_and_reconcile() {
    let mut shaping = NetworkShaping::new(&config(&["eth0"]), Steering::Nft).expect("new");
    let mut r = shaped("");
    r.reply(
        &["nft", "-j", "list"],
        &table_json(&["lodger:0".to_string()]),
    );
    let applied = shaping
        .reconcile(&mut r, false, &CpuJobs::NetCls)
        .expect("off");
    assert!(applied.changed);
    assert_eq!(
        r.changes(),
        ["tc qdisc del dev eth0 root", "nft delete table inet lodger"]
    );
    // Nothing of lodger's: nothing to do.
    let mut r = fresh();
    assert!(!shaping.remove(&mut r).expect("nothing"));
    assert!(r.changes().is_empty());
    // Errors are reported after trying everything.
    let mut r = RecordingRunner::new();
    r.reply(&["tc", "qdisc", "show"], OUR_ROOT)
        .fail(
            &["tc", "qdisc", "del"],
            "RTNETLINK answers: Operation not permitted",
        )
        .reply(&["nft", "-j", "list"], &table_json(&[]));
    let err = shaping.remove(&mut r).expect_err("eperm");
    assert!(err.to_string().contains("Operation not permitted"), "{err}");
    assert!(r
        .lines()
        .contains(&"nft delete table inet lodger".to_string()));
    // On: the same as apply.
    let mut r = fresh();
    assert!(
        shaping
            .reconcile(&mut r, true, &CpuJobs::NetCls)
            .expect("on")
            .changed
    );
}

#[test]
fn unparsable_output_is_an_error_with_the_line() {
    let shaper = Shaper::new(
        Link {
            interface: "eth0".to_string(),
            line_rate_mbit: 100,
        },
        &ShapingConfig::default(),
    )
    .expect("shaper");
    let mut r = RecordingRunner::new();
    r.reply(&["tc", "qdisc", "show"], OUR_ROOT).reply(
        &["tc", "class", "show"],
        "class htb 4c44:10 parent 4c44:1 prio 0 rate fast ceil 100Mbit\n",
    );
    let err = shaper.apply(&mut r, TcFilter::None).expect_err("garbage");
    assert!(err.to_string().contains("rate fast"), "{err}");
    let nft = NftSteering::new("lodger");
    let mut r = RecordingRunner::new();
    r.reply(&["nft"], "not json");
    let err = nft.observe(&mut r).expect_err("garbage");
    assert!(err.to_string().contains("not JSON"), "{err}");
    let mut r = RecordingRunner::new();
    r.fail(&["nft"], "Error: Operation not permitted");
    assert!(matches!(
        nft.observe(&mut r).expect_err("eperm"),
        TcError::Failed { .. }
    ));
}

#[test]
fn config_validation() {
    assert!(config(&["eth0"]).validate().is_ok());
    assert!(ShapingConfig::default().validate().is_err(), "no links");
    let bad = |f: &dyn Fn(&mut ShapingConfig)| {
        let mut c = config(&["eth0"]);
        f(&mut c);
        c.validate().expect_err("invalid")
    };
    assert!(bad(&|c| c.cpu_jobs_percent = 30)
        .to_string()
        .contains("more than the line rate"));
    assert!(bad(&|c| c.cpu_jobs_ceil_percent = 10)
        .to_string()
        .contains("cpu_jobs_ceil_percent"));
    assert!(bad(&|c| c.handle = 0).to_string().contains("handle"));
    assert!(bad(&|c| c.links[0].line_rate_mbit = 0)
        .to_string()
        .contains("positive"));
    assert!(bad(&|c| c.links[0].interface = "a b".into())
        .to_string()
        .contains("'a b'"));
    assert!(bad(&|c| c.links[0].interface = "x".repeat(16))
        .to_string()
        .contains("interface"));
    assert!(bad(&|c| c.links.push(c.links[0].clone()))
        .to_string()
        .contains("twice"));
    assert!(bad(&|c| c.nft_table = "x;y".into())
        .to_string()
        .contains("nft_table"));
    let c: ShapingConfig = toml::from_str(
        "links = [{ interface = \"ib0\", line_rate_mbit = 100000 }]\ncpu_jobs_ceil_percent = 50\n",
    )
    .expect("toml");
    assert_eq!(c.training_percent, 75);
    assert_eq!(c.cpu_jobs_ceil_percent, 50);
    assert!(toml::from_str::<ShapingConfig>("share = 3\n").is_err());
    // Bad cgroup2 paths never reach nft.
    let nft = NftSteering::new("lodger");
    for path in ["", "/abs", "a/../b", "a b", "x\"y", "a;b"] {
        let rule = NftRule {
            matches: CpuJobMatch::CgroupV2(path.to_string()),
            action: NftAction::Mark(1),
        };
        let mut r = RecordingRunner::new();
        assert!(nft.apply(&mut r, &[rule]).is_err(), "{path}");
        assert!(r.calls.is_empty());
    }
}

#[test]
fn rates_class_ids_and_quanta() {
    for (s, bits) in [
        ("75Mbit", 75_000_000),
        ("1600bit", 1_600),
        ("2Gbit", 2_000_000_000),
        ("133333Kbit", 133_333_000),
        ("10Kibit", 10_240),
        ("1.5Mbit", 1_500_000),
    ] {
        assert_eq!(parse_rate(s), Some(bits), "{s}");
    }
    for s in ["", "fast", "10", "10Xbit", "Mbit"] {
        assert_eq!(parse_rate(s), None, "{s}");
    }
    assert!(close(133_333_000, 133_333_333));
    assert!(!close(50_000_000, 25_000_000));
    let c = ClassId::parse("4c44:20").expect("parse");
    assert_eq!(c.as_u32(), 0x4c44_0020);
    assert_eq!(c.to_string(), "4c44:20");
    assert_eq!(
        ClassId::parse("4c44:"),
        Some(ClassId {
            major: 0x4c44,
            minor: 0
        })
    );
    assert_eq!(ClassId::parse("x"), None);
    // A slow link: the quantum follows the rate (rate / 8 / r2q 10); shares of a huge line
    // rate are computed without overflow.
    let shaper = Shaper::new(
        Link {
            interface: "eth1".to_string(),
            line_rate_mbit: 1,
        },
        &ShapingConfig::default(),
    )
    .expect("shaper");
    let argv = shaper.build_argv(TcFilter::None);
    assert_eq!(
            argv[3].join(" "),
            "tc class replace dev eth1 parent 4c44:1 classid 4c44:20 htb rate 250000bit ceil 250000bit quantum 3125"
        );
    let big = Shaper::new(
        Link {
            interface: "ib0".to_string(),
            line_rate_mbit: u64::MAX / 1_000,
        },
        &ShapingConfig::default(),
    )
    .expect("shaper");
    assert_eq!(big.build_argv(TcFilter::None).len(), 4);
}

#[test]
fn net_cls_group_on_a_plain_tree() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path();
    fs::write(root.join(CGROUP_PROCS), "1\n").expect("root procs");
    // What the kernel puts in a new cgroup.
    let group_dir = root.join("lodger/j4");
    fs::create_dir_all(&group_dir).expect("mkdir");
    fs::write(group_dir.join(NET_CLS_CLASSID), "0\n").expect("classid");
    fs::write(group_dir.join(CGROUP_PROCS), "").expect("procs");
    let (group, changed) = NetClsGroup::create(root, "lodger/j4", 0x4c44_0020).expect("create");
    assert!(changed);
    assert_eq!(group.classid().expect("classid"), 1_279_524_896);
    let (_, changed) = NetClsGroup::create(root, "lodger/j4", 0x4c44_0020).expect("again");
    assert!(!changed, "same class id: nothing written");
    for bad in ["", "/x", "a/../b", "a//b"] {
        assert!(NetClsGroup::create(root, bad, 1).is_err(), "{bad}");
    }
    let err = NetClsGroup::create(&root.join("nowhere"), "x", 1).expect_err("no hierarchy");
    assert!(
        err.to_string().contains("not a mounted cgroup hierarchy"),
        "{err}"
    );
    // rmdir of a plain directory with files fails, with the path: on cgroupfs it works.
    let err = group.clone().remove().expect_err("plain dir");
    assert!(err.to_string().contains("lodger/j4"), "{err}");
    fs::remove_file(group_dir.join(NET_CLS_CLASSID)).expect("simulate kernel");
    fs::remove_file(group_dir.join(CGROUP_PROCS)).expect("simulate kernel");
    // procs cannot be read any more: removal reports it.
    assert!(group.clone().remove().is_err());
    fs::remove_dir(&group_dir).expect("rmdir");
    assert!(!group.remove().expect("gone"));
}

/// Cgroup paths go into nft's quoted strings: systemd's `\xNN` escapes (the instance slices of
/// a lodgerd whose cgroup parent has a `-`) pass, any other backslash, a quote, a `;`, an
/// absolute or climbing path does not.
#[test]
fn nft_takes_systemd_escaped_cgroup_paths_and_nothing_that_breaks_its_quoting() {
    use super::check_cgroup_path;
    for ok in [
        "lodger/lodgers",
        "lodger.slice/lodger-instances.slice/lodger-j1-0-70-0.service",
        "lodger\\x2dtest\\x2d70\\x2d1.slice/lodger\\x2dtest\\x2d70\\x2d1-instances.slice",
    ] {
        assert!(check_cgroup_path(ok).is_ok(), "{ok}");
    }
    for bad in [
        "", "/lodger", "a/../b", "a//b", "a\\b", "a\\x2", "a\\xzz", "a\\", "a\"b", "a;b", "a b",
    ] {
        assert!(check_cgroup_path(bad).is_err(), "{bad}");
    }
}
