//! config's tests: the shipped file, every key, every refusal and its message.

use std::path::Path;
use std::time::Duration;

use toml::de::{DeTable, DeValue};

use super::daemon::group_name;
use super::*;
use crate::cpuset::CpuSet;

const ORIGIN: &str = "/etc/lodger/lodger.toml";
const SHIPPED: &str = include_str!("../../config/lodger.toml");

pub(super) fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new(ORIGIN))
}

/// The one-line message for a text that must be refused.
pub(super) fn refused(text: &str) -> String {
    match parse(text) {
        Ok(config) => panic!("accepted {text:?} as {config:?}"),
        Err(e) => e.to_string(),
    }
}

fn cpus(list: &str) -> CpuSet {
    CpuSet::parse(list).expect("test cpulist")
}

#[test]
fn default_equals_the_shipped_file() {
    let shipped = parse(SHIPPED).expect("config/lodger.toml must parse");
    assert_eq!(shipped, Config::default());
}

#[test]
fn empty_file_is_the_default() {
    assert_eq!(parse("").expect("empty"), Config::default());
    assert_eq!(parse("# nothing\n\n").expect("comments"), Config::default());
}

#[test]
fn every_default() {
    let c = Config::default();
    assert_eq!(c.node.reserved_cpus, ReservedCpus::Auto);
    assert_eq!(c.node.sysfs_root, Path::new("/sys"));
    assert_eq!(c.node.proc_root, Path::new("/proc"));
    assert!(c.node.gpu.is_empty());
    assert_eq!(c.training.rt_priority, 10);
    assert!(!c.training.allow_unthrottled_rt);
    assert_eq!(c.training.grant_rt_budget_us, 0);
    assert_eq!(c.training.grant_rt_budget_us(), None);
    assert_eq!(c.agent.interval_ms, 1000);
    assert_eq!(c.agent.interval(), Duration::from_secs(1));
    assert_eq!(c.interval(), Duration::from_secs(1));
    assert_eq!(c.agent.state_dir, Path::new("/var/lib/lodger"));
    assert_eq!(c.agent.command_timeout(), Duration::from_secs(5));
    assert_eq!(c.api.group, "lodger");
    assert_eq!(c.api.bus, BusKind::System);
    assert_eq!(c.cgroup.driver, CgroupDriver::Auto);
    assert_eq!(c.cgroup.root, Path::new("/sys/fs/cgroup"));
    assert_eq!(c.cgroup.parent, "lodger");
    assert_eq!(c.cgroup.pid_jobs, PidJobs::Auto);
    assert_eq!(c.log.level, LogLevel::Info);
    assert_eq!(c.sense.interval(), Duration::from_secs(1));
    assert_eq!(c.sense.gpu, GpuSourceChoice::Auto);
    assert_eq!(
        c.sense.emulated_gpu_dir,
        Path::new("/run/lodger/emulated-gpu")
    );
    assert!(c.sense.perf);
    assert_eq!(c.sense.perf_max_fds, 65536);
    assert_eq!(c.sense.resctrl_root, Path::new("/sys/fs/resctrl"));
    assert_eq!(c.sense.membw_peak_bytes_per_s, 0);
    assert_eq!(c.sense.deadline(), Duration::from_secs(5));
    assert_eq!(c.metrics.listen, "");
    assert_eq!(c.metrics.address(), None);
    assert_eq!(c.origin(), None);
}

/// The shipped file documents every key the schema has: for each table, the keys the
/// parser says it expects are exactly the keys the file sets.
#[test]
fn shipped_file_lists_every_key() {
    let tree = DeTable::parse(SHIPPED).expect("shipped file parses");
    let keys_of = |table: &DeTable<'_>| -> Vec<String> {
        let mut keys: Vec<String> = table.keys().map(|k| k.get_ref().to_string()).collect();
        keys.sort();
        keys
    };
    let expected_by_schema = |text: &str| -> Vec<String> {
        match parse(text) {
            Err(ConfigError::UnknownKey { mut expected, .. }) => {
                expected.sort();
                expected
            }
            other => panic!("{text:?}: expected an unknown-key error, got {other:?}"),
        }
    };
    assert_eq!(keys_of(tree.get_ref()), expected_by_schema("zzz = 1\n"));
    for (section, value) in tree.get_ref().iter() {
        let DeValue::Table(table) = value.get_ref() else {
            panic!("{} is not a table", section.get_ref());
        };
        let mut want = expected_by_schema(&format!("[{}]\nzzz = 1\n", section.get_ref()));
        if section.get_ref() == "node" {
            // [[node.gpu]] has no default entries; the file shows it commented out.
            want.retain(|k| k != "gpu");
            assert!(SHIPPED.contains("# [[node.gpu]]\n# index = 0\n# numa_node = "));
            assert_eq!(
                expected_by_schema("[[node.gpu]]\nzzz = 1\n"),
                ["index", "numa_node"]
            );
        }
        if section.get_ref() == "network" {
            // [[network.link]] likewise.
            want.retain(|k| k != "link");
            assert!(
                SHIPPED.contains("# [[network.link]]\n# interface = \"eth0\"\n# line_rate_mbit = ")
            );
            assert_eq!(
                expected_by_schema("[[network.link]]\nzzz = 1\n"),
                ["interface", "line_rate_mbit"]
            );
        }
        if section.get_ref() == "slurm" {
            // [[slurm.rule]] likewise.
            want.retain(|k| k != "rule");
            assert!(SHIPPED.contains(
                "#   [[slurm.rule]]\n#   partition = \"interactive\"\n#   kind = \"leave\""
            ));
            assert_eq!(
                expected_by_schema("[[slurm.rule]]\nzzz = 1\n"),
                ["account", "kind", "partition"]
            );
        }
        // Obsolete keys are accepted, not shipped.
        want.retain(|k| {
            !super::OBSOLETE_KEYS
                .iter()
                .any(|(key, _)| *key == format!("{}.{k}", section.get_ref()))
        });
        assert_eq!(keys_of(table), want, "[{}]", section.get_ref());
    }
}

#[test]
fn the_commented_network_example_parses_and_bad_links_are_refused() {
    let text = SHIPPED.replace(
        "# [[network.link]]\n# interface = \"eth0\"\n# line_rate_mbit = 25000",
        "[[network.link]]\ninterface = \"eth0\"\nline_rate_mbit = 25000",
    );
    let c = parse(&text).expect("uncommented example");
    let shaping = c.network.shaping().expect("shaping on");
    assert_eq!(shaping.links.len(), 1);
    assert_eq!(shaping.links[0].interface, "eth0");
    assert_eq!(shaping.links[0].line_rate_mbit, 25_000);
    assert!(shaping.validate().is_ok());
    assert_eq!(Config::default().network.shaping(), None);

    let err = |text: &str| parse(text).expect_err(text).to_string();
    assert!(err("[network]\n[[network.link]]\ninterface = \"eth0\"\n")
        .contains("network.link[0]: each [[network.link]] needs interface and line_rate_mbit"),);
    assert!(
        err("[[network.link]]\ninterface = \"a/b\"\nline_rate_mbit = 1\n")
            .contains(":2: network.link[0].interface: 'a/b' is not an interface name")
    );
    assert!(err(
        "[[network.link]]\ninterface = \"e\"\nline_rate_mbit = 1\n[[network.link]]\ninterface = \"e\"\nline_rate_mbit = 2\n"
    )
    .contains(":5: network.link[1].interface: e is listed twice"));
    assert!(
        err("[[network.link]]\ninterface = \"e\"\nline_rate_mbit = 0\n")
            .contains(":3: network.link[0].line_rate_mbit: must be between 1 and")
    );
    assert!(
        err("[network]\ntraining_percent = 80\ncpu_jobs_percent = 30\n").contains(
            ":3: network.cpu_jobs_percent: training 80% + CPU jobs 30% is more than the line rate"
        )
    );
    let e = err("[network]\ntraining_percent = 60\ncpu_jobs_percent = 30\n");
    assert!(
        e.ends_with("lodger.toml: network.cpu_jobs_ceil_percent: 25 is below cpu_jobs_percent (30): CPU jobs could not use their own share"),
        "{e}"
    );
    assert!(err("[network]\nsteering = \"ebpf\"\n")
        .contains("network.steering: must be one of auto, tc-filter, nft"));
    // The two-network option.
    let c = parse("[network]\ncpu_jobs_interface = \"eth1\"\ncpu_jobs_gateway = \"10.1.0.1\"\n")
        .expect("two networks");
    let slow = c.network.slow_network().expect("slow network");
    assert_eq!(slow.interface, "eth1");
    assert_eq!(slow.gateway, Some(std::net::Ipv4Addr::new(10, 1, 0, 1)));
    assert_eq!(c.network.shaping(), None);
    assert!(
        err("[network]\ncpu_jobs_interface = \"eth1\"\ncpu_jobs_gateway = \"10.1.0\"\n")
            .contains(":3: network.cpu_jobs_gateway: '10.1.0' is not an IPv4 address")
    );
    assert!(err("[network]\ncpu_jobs_gateway = \"10.1.0.1\"\n")
        .contains("network.cpu_jobs_gateway: is set without network.cpu_jobs_interface"));
    assert!(err("[network]\ncpu_jobs_interface = \"eth1\"\n[[network.link]]\ninterface = \"eth0\"\nline_rate_mbit = 1\n")
        .contains(":2: network.cpu_jobs_interface: moves CPU jobs to another network instead of shaping"));
}

#[test]
fn the_commented_gpu_example_parses() {
    let text = SHIPPED.replace(
        "# [[node.gpu]]\n# index = 0\n# numa_node = 1",
        "[[node.gpu]]\nindex = 0\nnuma_node = 1",
    );
    let c = parse(&text).expect("uncommented example");
    assert_eq!(
        c.node.gpu,
        [GpuOverride {
            index: 0,
            numa_node: 1
        }]
    );
    assert_eq!(c.node.gpu_numa_node(0), Some(1));
    assert_eq!(c.node.gpu_numa_node(1), None);
}

#[test]
fn every_key_can_be_set() {
    let c = parse(
        r#"
[node]
reserved_cpus = "0,32"
sysfs_root = "/tmp/sys"
proc_root = "/tmp/proc"
[[node.gpu]]
index = 1
numa_node = 0
[[node.gpu]]
index = 0
numa_node = 1
[training]
rt_priority = 99
allow_unthrottled_rt = true
grant_rt_budget_us = 950000
[agent]
interval_ms = 10
state_dir = "/srv/lodger"
command_timeout_ms = 2500
[api]
group = "gpu-admins"
bus = "session"
cgroup_roots = ["/system.slice/slurmstepd.scope", "/system.slice/containerd.service/"]
max_jobs_per_owner = 4
max_instances_per_owner = 16
[cgroup]
driver = "v1"
root = "/cg"
parent = "lodger.slice"
pid_jobs = "affinity"
[log]
level = "trace"
"#,
    )
    .expect("all keys set");
    assert_eq!(c.node.reserved_cpus, ReservedCpus::List(cpus("0,32")));
    assert_eq!(c.node.sysfs_root, Path::new("/tmp/sys"));
    assert_eq!(c.node.proc_root, Path::new("/tmp/proc"));
    assert_eq!(
        c.node.gpu,
        [
            GpuOverride {
                index: 1,
                numa_node: 0
            },
            GpuOverride {
                index: 0,
                numa_node: 1
            }
        ]
    );
    assert_eq!(c.training.rt_priority, 99);
    assert!(c.training.allow_unthrottled_rt);
    assert_eq!(c.training.grant_rt_budget_us(), Some(950_000));
    assert_eq!(c.agent.interval(), Duration::from_millis(10));
    assert_eq!(c.agent.state_dir, Path::new("/srv/lodger"));
    assert_eq!(c.agent.command_timeout(), Duration::from_millis(2500));
    assert_eq!(c.api.group, "gpu-admins");
    assert_eq!(c.api.bus, BusKind::Session);
    assert_eq!(
        c.api.cgroup_roots,
        [
            "/system.slice/slurmstepd.scope",
            "/system.slice/containerd.service"
        ]
    );
    assert_eq!(c.api.max_jobs_per_owner, 4);
    assert_eq!(c.api.max_instances_per_owner, 16);
    assert_eq!(c.cgroup.driver, CgroupDriver::V1);
    assert_eq!(c.cgroup.root, Path::new("/cg"));
    assert_eq!(c.cgroup.parent, "lodger.slice");
    assert_eq!(c.cgroup.pid_jobs, PidJobs::Affinity);
    assert_eq!(c.log.level, LogLevel::Trace);
    assert_eq!(c.origin(), Some(Path::new(ORIGIN)));
    assert_eq!(c.location_of("agent.state_dir").line, Some(18));
    assert_eq!(c.location_of("log.level").line, Some(32));
    // A key left out has a file but no line.
    let d = parse("").expect("empty");
    assert_eq!(d.location_of("log.level").to_string(), ORIGIN);
}

#[test]
fn empty_reserved_cpus_is_none() {
    let c = parse("[node]\nreserved_cpus = \"\"\n").expect("empty list");
    assert_eq!(c.node.reserved_cpus, ReservedCpus::List(CpuSet::new()));
    let got = c
        .resolve_reserved(&cpus("0-3"), &cpus("0,2"), &CpuSet::new())
        .expect("none reserved");
    assert!(got.is_empty());
}

#[test]
fn lendable_cpus_are_all_or_an_online_cpulist_less_the_reserved() {
    let d = Config::default();
    assert_eq!(
        d.resolve_lendable(&cpus("0-7"), &cpus("0,4")).unwrap(),
        cpus("1-3,5-7")
    );
    let c = parse("[node]\nlendable_cpus = \"0-5\"\n").expect("list");
    assert_eq!(
        c.resolve_lendable(&cpus("0-7"), &cpus("0,4")).unwrap(),
        cpus("1-3,5")
    );
    let err = c
        .resolve_lendable(&cpus("0-3"), &cpus("0"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("node.lendable_cpus") && err.contains("4-5"),
        "{err}"
    );
    let err = refused("[node]\nlendable_cpus = \"some\"\n");
    assert!(
        err.contains("node.lendable_cpus") && err.contains("\"all\""),
        "{err}"
    );
}

/// (text, the whole expected message). Each names file, line and key.
#[test]
fn bad_input_names_file_line_and_key() {
    let cases: &[(&str, &str)] = &[
        (
            "[sense]\ninterval_ms = 50\n",
            "/etc/lodger/lodger.toml:2: sense.interval_ms: must be between 200 and 60000 (got 50)",
        ),
        (
            "[sense]\ngpu = \"cuda\"\n",
            "/etc/lodger/lodger.toml:2: sense.gpu: must be one of auto, nvml, emulated, off (got \"cuda\")",
        ),
        (
            "[rightsize]\nmin_change_percent = 60\n",
            "/etc/lodger/lodger.toml:2: rightsize.min_change_percent: must be percentage points of GPU utilization from 0 to 50 (got 60)",
        ),
        (
            "[contention]\nmemory_pressure_percent = 120\n",
            "/etc/lodger/lodger.toml:2: contention.memory_pressure_percent: must be a percent (0: off) from 0 to 100 (got 120)",
        ),
        (
            "[rightsize]\nmin_change_percent = -0.5\n",
            "/etc/lodger/lodger.toml:2: rightsize.min_change_percent: must be percentage points of GPU utilization from 0 to 50 (got -0.5)",
        ),
        (
            "[metrics]\nlisten = \"localhost\"\n",
            "/etc/lodger/lodger.toml:2: metrics.listen: must be empty (off) or an address and port such as \"127.0.0.1:9464\" (got \"localhost\")",
        ),
        // Unknown keys, top level and nested.
        (
            "foo = 1\n",
            "/etc/lodger/lodger.toml:1: unknown key 'foo' at the top level; expected one of \
             node, training, agent, api, cgroup, log, sense, metrics, inference, rightsize, contention, network, batch, slurm, kubernetes",
        ),
        (
            "[agent]\ninterval_ms = 100\n\n[agnet]\n",
            "/etc/lodger/lodger.toml:4: unknown key 'agnet' at the top level; expected one \
             of node, training, agent, api, cgroup, log, sense, metrics, inference, rightsize, contention, network, batch, slurm, kubernetes",
        ),
        (
            "[agent]\nstate_dir = \"/x\"\nintervall = 5\n",
            "/etc/lodger/lodger.toml:3: unknown key 'intervall' in [agent]; expected one of \
             interval_ms, state_dir, command_timeout_ms",
        ),
        (
            "[[node.gpu]]\nindex = 0\nnuma_node = 0\n\n[[node.gpu]]\nindex = 1\nnuma = 0\n",
            "/etc/lodger/lodger.toml:7: unknown key 'numa' in [[node.gpu]]; expected one of \
             index, numa_node",
        ),
        (
            "[cgroup.extra]\nx = 1\n",
            "/etc/lodger/lodger.toml:1: unknown key 'extra' in [cgroup]; expected one of \
             driver, root, parent, pid_jobs",
        ),
        // Wrong types.
        (
            "[training]\nrt_priority = \"high\"\n",
            "/etc/lodger/lodger.toml:2: training.rt_priority: expected an integer, got \
             string \"high\"",
        ),
        (
            "[training]\nallow_unthrottled_rt = 1\n",
            "/etc/lodger/lodger.toml:2: training.allow_unthrottled_rt: expected a boolean, \
             got integer `1`",
        ),
        (
            "[agent]\ninterval_ms = 2.5\n",
            "/etc/lodger/lodger.toml:2: agent.interval_ms: expected an integer, got \
             floating point `2.5`",
        ),
        (
            "[cgroup]\ndriver = 2\n",
            "/etc/lodger/lodger.toml:2: cgroup.driver: expected a string, got integer `2`",
        ),
        (
            "[agent]\nstate_dir = [\"/x\"]\n",
            "/etc/lodger/lodger.toml:2: agent.state_dir: expected a string, got an array",
        ),
        (
            "\nagent = 5\n",
            "/etc/lodger/lodger.toml:2: agent: expected a table, got integer `5`",
        ),
        (
            "[node]\ngpu = 0\n",
            "/etc/lodger/lodger.toml:2: node.gpu: expected an array, got integer `0`",
        ),
        (
            "[node]\ngpu = [{ index = 0, numa_node = 0 }, 7]\n",
            "/etc/lodger/lodger.toml:2: node.gpu[1]: expected a table, got integer `7`",
        ),
        (
            "[agent]\ninterval_ms = 99999999999999999999\n",
            "/etc/lodger/lodger.toml:2: agent.interval_ms: integer 99999999999999999999 is \
             out of range",
        ),
        // Ranges.
        (
            "[training]\n\nrt_priority = 0\n",
            "/etc/lodger/lodger.toml:3: training.rt_priority: must be between 1 and 99 (got 0)",
        ),
        (
            "[training]\nrt_priority = 100\n",
            "/etc/lodger/lodger.toml:2: training.rt_priority: must be between 1 and 99 (got \
             100)",
        ),
        (
            "[training]\nrt_priority = -1\n",
            "/etc/lodger/lodger.toml:2: training.rt_priority: must be between 1 and 99 (got \
             -1)",
        ),
        (
            "[agent]\ninterval_ms = 0\n",
            "/etc/lodger/lodger.toml:2: agent.interval_ms: must be between 10 and 60000 (got \
             0)",
        ),
        (
            "[agent]\ninterval_ms = 60001\n",
            "/etc/lodger/lodger.toml:2: agent.interval_ms: must be between 10 and 60000 (got \
             60001)",
        ),
        (
            "[agent]\ncommand_timeout_ms = 600000\n",
            "/etc/lodger/lodger.toml:2: agent.command_timeout_ms: must be between 100 and 10000 \
             (got 600000); a command runs inside the agent's tick, and a longer stall gets \
             lodgerd killed by systemd's watchdog",
        ),
        (
            "[training]\ngrant_rt_budget_us = 1000000\n",
            "/etc/lodger/lodger.toml:2: training.grant_rt_budget_us: must be between 0 and \
             999999 (got 1000000); 0 = never grant, otherwise below the 1000000 us period",
        ),
        (
            "[inference]\ntraining_core_batch_ms = -1\n",
            "/etc/lodger/lodger.toml:2: inference.training_core_batch_ms: must be between 0 and \
             600000 (got -1); milliseconds one offline batch on a training core may take, 0 = off",
        ),
        (
            "[inference]\ntraining_core_batch_ms = 600001\n",
            "/etc/lodger/lodger.toml:2: inference.training_core_batch_ms: must be between 0 and \
             600000 (got 600001); milliseconds one offline batch on a training core may take, 0 \
             = off",
        ),
        // Paths and names.
        (
            "[agent]\nstate_dir = \"var/lib/lodger\"\n",
            "/etc/lodger/lodger.toml:2: agent.state_dir: must be an absolute path (got \
             \"var/lib/lodger\")",
        ),
        (
            "[node]\nsysfs_root = \"\"\n",
            "/etc/lodger/lodger.toml:2: node.sysfs_root: must be an absolute path (got \"\")",
        ),
        (
            "[cgroup]\nroot = \"sys/fs/cgroup\"\n",
            "/etc/lodger/lodger.toml:2: cgroup.root: must be an absolute path (got \
             \"sys/fs/cgroup\")",
        ),
        (
            "[cgroup]\nparent = \"a/b\"\n",
            "/etc/lodger/lodger.toml:2: cgroup.parent: must be a single cgroup name of \
             letters, digits, '_', '-', '.', '@' or ':' (got \"a/b\")",
        ),
        (
            "[api]\ngroup = \"1admins\"\n",
            "/etc/lodger/lodger.toml:2: api.group: \"1admins\" is not a valid group name (up \
             to 32 letters, digits, '_' or '-', starting with a letter or '_')",
        ),
        // A cpulist that does not parse.
        (
            "[node]\nreserved_cpus = \"0-x\"\n",
            "/etc/lodger/lodger.toml:2: node.reserved_cpus: must be \"auto\", \"\" (none) or \
             a cpulist such as \"0,32\": '0-x' in cpu list '0-x' is not a number or a range \
             such as 2-5",
        ),
        (
            "[node]\nreserved_cpus = \"3-1\"\n",
            "/etc/lodger/lodger.toml:2: node.reserved_cpus: must be \"auto\", \"\" (none) or \
             a cpulist such as \"0,32\": range '3-1' in cpu list '3-1' runs backwards",
        ),
        // Enum strings.
        (
            "[cgroup]\ndriver = \"v3\"\n",
            "/etc/lodger/lodger.toml:2: cgroup.driver: must be one of auto, v1, v2 (got \"v3\")",
        ),
        (
            "[cgroup]\npid_jobs = \"Cgroup\"\n",
            "/etc/lodger/lodger.toml:2: cgroup.pid_jobs: must be one of auto, cgroup, \
             affinity (got \"Cgroup\")",
        ),
        (
            "[api]\ncgroup_roots = [\"/user.slice\"]\n",
            "/etc/lodger/lodger.toml:2: api.cgroup_roots: \"/user.slice\" is not a cgroup below \
             /system.slice (e.g. \"/system.slice/slurmstepd.scope\")",
        ),
        (
            "[api]\ncgroup_roots = [\"/system.slice/../init.scope\"]\n",
            "/etc/lodger/lodger.toml:2: api.cgroup_roots: \"/system.slice/../init.scope\" is \
             not a cgroup below /system.slice (e.g. \"/system.slice/slurmstepd.scope\")",
        ),
        (
            "[api]\nmax_jobs_per_owner = 0\n",
            "/etc/lodger/lodger.toml:2: api.max_jobs_per_owner: must be between 1 and 100000 \
             (got 0)",
        ),
        (
            "[api]\nbus = \"user\"\n",
            "/etc/lodger/lodger.toml:2: api.bus: must be one of system, session (got \"user\")",
        ),
        (
            "[log]\nlevel = \"verbose\"\n",
            "/etc/lodger/lodger.toml:2: log.level: must be one of error, warn, info, debug, \
             trace (got \"verbose\")",
        ),
        // [[node.gpu]] entries.
        (
            "[[node.gpu]]\nindex = 0\nnuma_node = 0\n[[node.gpu]]\nindex = 0\nnuma_node = 1\n",
            "/etc/lodger/lodger.toml:5: node.gpu[1].index: GPU 0 is already given at line 2",
        ),
        (
            "[[node.gpu]]\nindex = 0\nnuma_node = -1\n",
            "/etc/lodger/lodger.toml:3: node.gpu[0].numa_node: must be between 0 and 1023 \
             (got -1)",
        ),
        // Duplicates and syntax.
        (
            "[training]\nrt_priority = 10\nrt_priority = 20\n",
            "/etc/lodger/lodger.toml:3: training.rt_priority: duplicate key",
        ),
        (
            "[agent]\ninterval_ms = 100\n\n[agent]\n",
            "/etc/lodger/lodger.toml:4: agent: duplicate key",
        ),
        (
            "[agent\ninterval_ms = 100\n",
            "/etc/lodger/lodger.toml:1: invalid TOML: unclosed table, expected `]`",
        ),
        (
            "[agent]\ninterval_ms = \n",
            "/etc/lodger/lodger.toml:2: invalid TOML: string values must be quoted, expected \
             literal string",
        ),
    ];
    for (text, want) in cases {
        assert_eq!(&refused(text), want, "input {text:?}");
    }
}

#[test]
fn the_brief_examples_read_exactly() {
    let text = SHIPPED.replace("rt_priority = 10", "rt_priority = 0");
    let line = SHIPPED
        .lines()
        .position(|l| l == "rt_priority = 10")
        .expect("shipped rt_priority line")
        + 1;
    let e = parse(&text).expect_err("rt_priority 0");
    assert_eq!(
        e.to_string(),
        format!("/etc/lodger/lodger.toml:{line}: training.rt_priority: must be between 1 and 99 (got 0)")
    );
    assert_eq!(e.line(), Some(line));
    assert_eq!(e.key().as_deref(), Some("training.rt_priority"));

    let e = parse("\n\n[agent]\nintervall = 5\n").expect_err("typo");
    assert_eq!(e.line(), Some(4));
    assert_eq!(e.key().as_deref(), Some("agent.intervall"));
}

#[test]
fn missing_gpu_keys_are_named() {
    let e = parse("[[node.gpu]]\nindex = 0\n").expect_err("no numa_node");
    let msg = e.to_string();
    assert!(
        msg.starts_with("/etc/lodger/lodger.toml:1: node.gpu[0]: missing key"),
        "{msg}"
    );
    assert!(msg.contains("numa_node"), "{msg}");
}

#[test]
fn missing_file_names_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("absent.toml");
    let e = Config::load(&path).expect_err("missing file");
    assert!(matches!(e, ConfigError::Read { .. }));
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("{}: cannot read config file: ", path.display())),
        "{msg}"
    );
}

#[test]
fn load_reads_and_names_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("lodger.toml");
    std::fs::write(&path, "[agent]\ninterval_ms = 250\n").expect("write");
    let c = Config::load(&path).expect("load");
    assert_eq!(c.agent.interval(), Duration::from_millis(250));
    assert_eq!(c.origin(), Some(path.as_path()));

    std::fs::write(&path, "[log]\n\nlevel = 3\n").expect("write");
    let e = Config::load(&path).expect_err("bad level");
    assert_eq!(
        e.to_string(),
        format!(
            "{}:3: log.level: expected a string, got integer `3`",
            path.display()
        )
    );
}

#[test]
fn reserved_list_must_exist_and_leave_cpus() {
    let c = parse("\n[node]\nreserved_cpus = \"0,64-65\"\n").expect("parses");
    let e = c
        .resolve_reserved(&cpus("0-63"), &cpus("0,32"), &CpuSet::new())
        .expect_err("64-65 absent");
    assert_eq!(
        e.to_string(),
        "/etc/lodger/lodger.toml:3: node.reserved_cpus: CPUs 64-65 are not online on this \
         node (online: 0-63)"
    );

    let c = parse("[node]\nreserved_cpus = \"0-1\"\n").expect("parses");
    let e = c
        .resolve_reserved(&cpus("0-1"), &cpus("0"), &CpuSet::new())
        .expect_err("all reserved");
    assert_eq!(
        e.to_string(),
        "/etc/lodger/lodger.toml:2: node.reserved_cpus: reserves every online CPU (0-1); \
         leave at least one for jobs"
    );

    let got = c
        .resolve_reserved(&cpus("0-3"), &cpus("0"), &CpuSet::new())
        .expect("fits");
    assert_eq!(got, cpus("0-1"));
}

#[test]
fn reserved_auto_adapts_to_the_node() {
    let c = Config::default();
    // CPU 0 and its SMT sibling.
    assert_eq!(
        c.resolve_reserved(&cpus("0-63"), &cpus("0,32"), &CpuSet::new())
            .expect("auto"),
        cpus("0,32")
    );
    // Siblings given without CPU 0 itself.
    assert_eq!(
        c.resolve_reserved(&cpus("0-63"), &cpus("32"), &CpuSet::new())
            .expect("auto"),
        cpus("0,32")
    );
    // No SMT.
    assert_eq!(
        c.resolve_reserved(&cpus("0-1"), &cpus("0"), &CpuSet::new())
            .expect("auto"),
        cpus("0")
    );
    // One core with two threads: keep just CPU 0.
    assert_eq!(
        c.resolve_reserved(&cpus("0-1"), &cpus("0-1"), &CpuSet::new())
            .expect("auto"),
        cpus("0")
    );
    // A single CPU: nothing.
    assert!(c
        .resolve_reserved(&cpus("0"), &cpus("0"), &CpuSet::new())
        .expect("auto")
        .is_empty());
}

#[test]
fn isolated_cpus_are_left_to_the_caller_and_must_leave_cpus_for_jobs() {
    let c = Config::default();
    // auto counts only the CPUs the kernel balances: CPU 0 on a 2-CPU node with CPU 1
    // isolated is the last CPU for jobs, so it is not reserved.
    assert!(c
        .resolve_reserved(&cpus("0-1"), &cpus("0"), &cpus("1"))
        .expect("auto")
        .is_empty());
    assert_eq!(
        c.resolve_reserved(&cpus("0-7"), &cpus("0,4"), &cpus("6-7"))
            .expect("auto"),
        cpus("0,4")
    );
    let e = c
        .resolve_reserved(&cpus("0-3"), &cpus("0"), &cpus("0-3"))
        .expect_err("every CPU isolated");
    assert!(
        e.to_string().contains("every online CPU (0-3) is isolated"),
        "{e}"
    );

    let c = parse("[node]\nreserved_cpus = \"0-1\"\n").expect("parses");
    let e = c
        .resolve_reserved(&cpus("0-3"), &cpus("0"), &cpus("2-3"))
        .expect_err("the rest is isolated");
    assert_eq!(
        e.to_string(),
        "/etc/lodger/lodger.toml:2: node.reserved_cpus: reserves every online CPU (0-3) but \
         the isolated ones (2-3, isolcpus=), where lodger places no job; leave at least one for \
         jobs"
    );
    assert_eq!(
        c.resolve_reserved(&cpus("0-4"), &cpus("0"), &cpus("2-3"))
            .expect("CPU 4 left"),
        cpus("0-1")
    );
}

#[test]
fn errors_on_defaults_say_so() {
    let mut c = Config::default();
    c.node.reserved_cpus = ReservedCpus::List(cpus("5"));
    let e = c
        .resolve_reserved(&cpus("0-3"), &cpus("0"), &CpuSet::new())
        .expect_err("absent");
    assert_eq!(
        e.to_string(),
        "built-in defaults: node.reserved_cpus: CPU 5 is not online on this node (online: 0-3)"
    );
}

#[test]
fn gpu_overrides_must_name_existing_nodes() {
    let c =
        parse("[[node.gpu]]\nindex = 0\nnuma_node = 0\n\n[[node.gpu]]\nindex = 1\nnuma_node = 3\n")
            .expect("parses");
    c.check_gpu_overrides(&cpus("0-3")).expect("all exist");
    let e = c
        .check_gpu_overrides(&cpus("0-1"))
        .expect_err("node 3 absent");
    assert_eq!(
        e.to_string(),
        "/etc/lodger/lodger.toml:7: node.gpu[1].numa_node: NUMA node 3 does not exist on \
         this node (nodes: 0-1)"
    );
    Config::default()
        .check_gpu_overrides(&cpus("0"))
        .expect("no overrides");
}

#[test]
fn error_at_points_at_the_key() {
    let c = parse("[api]\n\ngroup = \"trainers\"\n").expect("parses");
    assert_eq!(
        c.error_at("api.group", "no such group").to_string(),
        "/etc/lodger/lodger.toml:3: api.group: no such group"
    );
}

/// A group the node does not have: refused at its line, unless it is the default one (not set
/// up yet: a warning) or the database cannot answer (a warning).
#[test]
fn api_group_is_checked_against_the_group_database() {
    let typo = parse("[api]\n\ngroup = \"lodgr\"\n").expect("parses");
    assert_eq!(
        typo.check_group(|_| Ok(false))
            .expect_err("refused")
            .to_string(),
        "/etc/lodger/lodger.toml:3: api.group: no such group \"lodgr\" on this node (getent \
         group lodgr)"
    );
    assert_eq!(typo.check_group(|_| Ok(true)).expect("found"), None);
    let warned = typo
        .check_group(|_| Err("LDAP is down".into()))
        .expect("a warning")
        .expect("said");
    assert!(warned.contains("LDAP is down"), "{warned}");
    let default = parse("[api]\ngroup = \"lodger\"\n").expect("parses");
    let warned = default
        .check_group(|name| {
            assert_eq!(name, "lodger");
            Ok(false)
        })
        .expect("a warning")
        .expect("said");
    assert!(warned.contains("groupadd --system lodger"), "{warned}");
}

/// sense.history was never read: a file that sets it (every packaged lodger.toml did) still
/// loads, with a warning naming the line; a value refused before is refused still.
#[test]
fn the_obsolete_sense_history_loads_with_a_warning() {
    let old = parse("[sense]\ninterval_ms = 500\nhistory = 300\n").expect("still loads");
    assert_eq!(old.sense.interval_ms, 500);
    assert_eq!(
        old.warnings(),
        [
            "/etc/lodger/lodger.toml:3: sense.history: ignored: no sensing history is kept (the \
          key never had an effect); remove it"
        ]
    );
    assert!(parse("[sense]\ninterval_ms = 500\n")
        .expect("parses")
        .warnings()
        .is_empty());
    assert!(refused("[sense]\nhistory = 0\n").contains("sense.history: must be between 1"));
}

#[test]
fn pid_jobs_auto_follows_the_hierarchy() {
    assert_eq!(PidJobs::Auto.effective(false), PidJobs::Cgroup);
    assert_eq!(PidJobs::Auto.effective(true), PidJobs::Affinity);
    assert_eq!(PidJobs::Cgroup.effective(true), PidJobs::Cgroup);
    assert_eq!(PidJobs::Affinity.effective(false), PidJobs::Affinity);
}

#[test]
fn group_names() {
    for ok in ["lodger", "_svc", "gpu-admins", "Trainers", "machine$", "a"] {
        assert!(group_name(ok.to_string()).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "$",
        "-x",
        "9x",
        "a b",
        "a:b",
        "ünicode",
        &"x".repeat(33),
    ] {
        assert!(group_name(bad.to_string()).is_err(), "{bad}");
    }
}

#[test]
fn serializes_in_toml_spelling() {
    let json = serde_json::to_value(Config::default()).expect("serialize");
    assert_eq!(json["node"]["reserved_cpus"], "auto");
    assert_eq!(json["cgroup"]["pid_jobs"], "auto");
    assert_eq!(json["log"]["level"], "info");
    assert_eq!(json["api"]["bus"], "system");
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    const VOCABULARY: &[&str] = &[
        "[node]",
        "[training]",
        "[agent]",
        "[api]",
        "[cgroup]",
        "[log]",
        "[[node.gpu]]",
        "[bogus]",
        "[agent.sub]",
        "",
        "# comment",
        "rt_priority = 0",
        "rt_priority = 50",
        "interval_ms = 0",
        "interval_ms = 500",
        "interval_ms = \"x\"",
        "state_dir = \"rel\"",
        "state_dir = \"/abs\"",
        "index = 0",
        "index = 1",
        "numa_node = 1",
        "level = \"info\"",
        "level = 3",
        "bus = \"system\"",
        "zzz = 1",
        "reserved_cpus = \"0-x\"",
        "reserved_cpus = \"0\"",
        "driver = \"v1\"",
        "group = \"9\"",
        "parent = \"a/b\"",
    ];

    proptest! {
        /// Any text is either a config or one error whose line lies inside the text.
        #[test]
        fn never_panics_and_lines_are_in_the_text(text in "(\\PC|\n|\\[|\\]|=|\"){0,200}") {
            if let Err(e) = parse(&text) {
                let lines = text.split('\n').count();
                if let Some(line) = e.line() {
                    prop_assert!(line >= 1 && line <= lines, "{e} for {text:?}");
                }
                prop_assert!(!e.to_string().contains('\n'), "multi-line: {e}");
            }
        }

        /// Files made of schema-shaped lines, valid or not: whenever an error names a key,
        /// the line it names is the one that holds that key.
        #[test]
        fn errors_point_at_the_line_of_their_key(
            lines in proptest::collection::vec(proptest::sample::select(VOCABULARY), 0..24)
        ) {
            let text = lines.join("\n");
            if let Err(e) = parse(&text) {
                if let (Some(key), Some(line)) = (e.key(), e.line()) {
                    let last = key.rsplit('.').next().unwrap_or(&key);
                    let last = last.split('[').next().unwrap_or(last);
                    let held = text.split('\n').nth(line - 1).unwrap_or("");
                    prop_assert!(held.contains(last), "{e}\nline {line} is {held:?} in\n{text}");
                }
            }
        }

        #[test]
        fn rt_priority_range(p in -200i64..300) {
            let result = parse(&format!("[training]\nrt_priority = {p}\n"));
            if (1..=99).contains(&p) {
                prop_assert_eq!(result.expect("in range").training.rt_priority, i32::try_from(p).expect("small"));
            } else {
                let e = result.expect_err("out of range");
                prop_assert_eq!(e.line(), Some(2));
                prop_assert_eq!(e.key(), Some("training.rt_priority".to_string()));
            }
        }
    }
}

#[test]
fn training_policy_and_rt_guard_keys() {
    let d = parse("").expect("empty");
    assert_eq!(d.training.policy, TrainingPolicy::Rr);
    assert!(d.training.role_priorities && !d.training.lodgers_sched_idle);
    assert_eq!(d.training.rt_headroom_percent, 5);
    let c = parse(
        "[training]\npolicy = \"other\"\nother_nice = -5\nrole_priorities = false\n\
         rt_headroom_percent = 10\nlodgers_sched_idle = true\n",
    )
    .expect("valid");
    assert_eq!(c.training.policy, TrainingPolicy::Other);
    assert_eq!(c.training.other_nice, -5);
    assert!(!c.training.role_priorities && c.training.lodgers_sched_idle);
    assert_eq!(c.training.rt_headroom_percent, 10);
    for (text, says) in [
        ("[training]\npolicy = \"fifo\"\n", "training.policy"),
        ("[training]\nother_nice = 5\n", "between -20 and 0"),
        ("[training]\nrt_headroom_percent = 60\n", "between 0 and 50"),
    ] {
        let e = parse(text).expect_err(text).to_string();
        assert!(e.contains(says), "{text}: {e}");
    }
}
