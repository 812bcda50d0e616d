//! Issue 17's crash suite, as root on a private bus: lodgerd is killed (SIGKILL) at random
//! moments, `LODGER_CRASH_CYCLES` times (default 50), while a churn driver registers and
//! unregisters training, offline and online jobs and some of the training processes exit. Each
//! cycle kills lodgerd a random 0-400 ms into the cycle and starts it again: every other cycle
//! a killer thread does it while the driver goes on calling (calls in flight; only answered ones
//! count, an unanswered unregister may have been done), the others after the driver's calls,
//! while lodgerd ticks (instances starting, stopping, being reaped, searched);
//! `LODGER_CRASH_DURING_CALLS=1` or `0` makes every cycle one or the other. At the end, once the
//! node has settled, it prints and asserts:
//!
//! - lost registrations (answered, process alive or instances wanted, not in `list`): 0;
//! - orphan instances (processes carrying this lodgerd's mark whose job is not registered): 0;
//! - duplicate instances (two process-group leaders for one job and index): 0;
//! - threads left SCHED_RR in the test's training processes that are in no job: 0;
//! - stale lodger cgroups (an instance cgroup of no instance lodgerd lists): 0;
//! - instances restarted by a lodgerd restart (alive when lodgerd died and wanted as they ran
//!   by the plan its state file held, replaced after by a process with the same threads and
//!   batch; a new layout, or a plan that dropped the instance, is the churn's doing): 0;
//!
//! - stale tc/nft rules: lodgerd runs in a network namespace of its own with a veth link it
//!   shapes (`[[network.link]]`) while a multi-node training job is registered (half the
//!   churn's training jobs are); at the end an HTB root or lodger's nftables table on it with no
//!   multi-node job left is stale, and a multi-node job left without the HTB root is unshaped:
//!   both 0 (where `ip`, `tc` or the net_cls controller are missing the suite runs without the
//!   network and says so);
//!
//! and the longest pause of a report-writing instance (a shell loop that writes a report line
//! and a timestamp every 20 ms) over the whole run, a figure printed beside its interval, not a
//! timed assertion. Units are the VM suite's.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;
use lodger::rng::Rng;

const HEARTBEAT_MS: u64 = 20;

/// One registration the driver made and lodgerd answered.
#[derive(Debug)]
struct Registered {
    kind: &'static str,
    /// The training process, for a training job.
    pid: Option<u32>,
}

/// The link lodgerd shapes: one end of a veth pair (a kernel may lack the dummy driver) in the
/// suite's own network namespace, the other end `PEER` beside it.
const LINK: &str = "lc0";
const PEER: &str = "lc0p";

/// A network namespace with [`LINK`] up in it, deleted on drop (with the link).
struct Netns {
    name: String,
}

impl Netns {
    /// `None`, with the reason printed, where this machine cannot shape a link.
    fn create() -> Option<Netns> {
        let ok = |args: &[&str]| {
            std::process::Command::new("ip")
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let have_tc = std::process::Command::new("tc")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok(&["-V"]) || !have_tc {
            eprintln!("crash suite: no network shaping checked: ip or tc missing (iproute2)");
            return None;
        }
        if common::netcls::net_cls_cgroups().is_none() {
            eprintln!("crash suite: no network shaping checked: no net_cls cgroup controller");
            return None;
        }
        let name = format!("lodger-crash-{}", std::process::id());
        let ns = Netns { name };
        let n = ns.name.as_str();
        if !(ok(&["netns", "add", n])
            && ok(&[
                "-n", n, "link", "add", LINK, "type", "veth", "peer", "name", PEER,
            ])
            && ok(&["-n", n, "link", "set", PEER, "up"])
            && ok(&["-n", n, "link", "set", LINK, "up"]))
        {
            eprintln!("crash suite: no network shaping checked: cannot make {LINK} in {n}");
            return None;
        }
        Some(ns)
    }

    /// lodger's HTB root on the link, and its nftables table, as the namespace shows them.
    fn shaping(&self) -> (bool, bool) {
        let qdiscs = std::process::Command::new("tc")
            .args(["-n", &self.name, "qdisc", "show", "dev", LINK])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let nft = std::process::Command::new("ip")
            .args([
                "netns", "exec", &self.name, "nft", "list", "table", "inet", "lodger",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        (qdiscs.contains("htb 4c44:"), nft)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Processes with `lock` open, each with its command, state and kernel wait channel: who keeps
/// a restarted lodgerd from taking the state directory.
fn lock_holders(lock: &std::path::Path) -> String {
    let proc_root = std::path::Path::new("/proc");
    let out: Vec<String> = lodger::sys::procfs::holding_open(proc_root, lock)
        .into_iter()
        .map(|pid| {
            let read = |f: &str| {
                std::fs::read_to_string(proc_root.join(pid.to_string()).join(f))
                    .unwrap_or_default()
                    .replace('\0', " ")
                    .trim()
                    .to_string()
            };
            let stat = read("stat");
            let state = stat
                .split(") ")
                .nth(1)
                .and_then(|rest| rest.split(' ').next());
            format!(
                "pid {pid} ({}) state {} wchan {} cmdline {:?}",
                read("comm"),
                state.unwrap_or(""),
                read("wchan"),
                read("cmdline"),
            )
        })
        .collect();
    if out.is_empty() {
        "none".to_string()
    } else {
        out.join("; ")
    }
}

/// The registered jobs by id, from `lodgerctl --json list`; None when lodgerd does not answer.
fn listed(d: &Daemon) -> Option<BTreeMap<String, serde_json::Value>> {
    let out = d.ctl(&["--json", "list"]);
    if !out.status.success() {
        return None;
    }
    let jobs: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(
        jobs.as_array()?
            .iter()
            .filter_map(|j| Some((j["id"].as_str()?.to_string(), j.clone())))
            .collect(),
    )
}

/// Running instances' pids by "job-index".
fn instance_pids(jobs: &BTreeMap<String, serde_json::Value>) -> BTreeMap<String, u32> {
    instances(jobs)
        .into_iter()
        .map(|(key, (pid, _))| (key, pid))
        .collect()
}

/// Running instances by "job-index": their pid and the threads and batch they run with (a change
/// of those restarts an instance because the plan changed, not because lodgerd did).
fn instances(jobs: &BTreeMap<String, serde_json::Value>) -> BTreeMap<String, (u32, String)> {
    let mut out = BTreeMap::new();
    for (id, j) in jobs {
        for i in j["instances"].as_array().into_iter().flatten() {
            if i["state"] != "running" {
                continue;
            }
            if let (Some(index), Some(pid)) = (i["index"].as_u64(), i["pid"].as_u64()) {
                let config = format!("{} thread(s), batch {}", i["threads"], i["batch"]);
                out.insert(format!("{id}-{index}"), (pid as u32, config));
            }
        }
    }
    out
}

#[test]
fn lodgerd_killed_at_random_moments_loses_orphans_and_restarts_nothing() {
    if !need_root("crash_suite") {
        return;
    }
    let cycles: u32 = std::env::var("LODGER_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let seed: u64 = std::env::var("LODGER_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    // Which cycles kill with calls in flight: every other one, or (0) none, or (1) all.
    let mode = std::env::var("LODGER_CRASH_DURING_CALLS").unwrap_or_default();
    eprintln!(
        "crash suite: {cycles} cycles, seed {seed} (LODGER_CRASH_SEED to replay), kills {}",
        match mode.as_str() {
            "0" => "between calls, while lodgerd ticks",
            "1" => "with calls in flight",
            _ => "with calls in flight every other cycle, between calls the others",
        }
    );
    let mut rng = Rng::scrambled(seed);
    // Dropped after lodgerd (declared before it): the mount, then the namespace.
    let net_cls = common::netcls::NetClsMount::find_or_mount()
        .map_err(|why| eprintln!("crash suite: no network shaping checked: {why}"))
        .ok();
    let netns = net_cls.as_ref().and_then(|_| Netns::create());
    let bus = PrivateBus::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let network = match &netns {
        Some(_) => {
            format!("[network]\n[[network.link]]\ninterface = \"{LINK}\"\nline_rate_mbit = 1000\n")
        }
        None => String::new(),
    };
    let mut d = Daemon::start(
        &bus,
        dir.path(),
        DaemonOptions {
            reserved: "",
            extra: format!(
                "[inference]\nprobe_seconds = 1\nstop_grace_seconds = 2\n\n\
                 [rightsize]\nmode = \"off\"\n\n{network}"
            ),
            netns: netns.as_ref().map(|n| n.name.clone()),
            ..DaemonOptions::default()
        },
    );
    let worker = example("infer_worker").display().to_string();
    let beats = dir.path().join("beats");
    let heartbeat = format!(
        "while :; do printf '{{{{\"items\":1,\"latency_ms\":1}}}}\\n' >&3; date +%s%N >> {}; \
         sleep {}; done",
        beats.display(),
        HEARTBEAT_MS as f64 / 1000.0
    );
    // An anchor training job for the whole run: offline instances always have its core, so the
    // sentinel is never planned away when online jobs take the leftover cores. Training jobs
    // here are light ones: under emulation the default workload runs its SCHED_RR threads near
    // the RT limit, and while lodgerd is down (no RT guard) three of them left the restarted
    // lodgerd 5 % of the VM's CPUs; its start took over 20 s.
    let anchor = Workload::light();
    let anchor_id = d.register_pid(anchor.pid(), 1);
    // The sentinel: a report-writing instance that runs the whole time.
    let sentinel = d.ctl_json(&[
        "register",
        "offline",
        "--max-instances",
        "1",
        "--",
        "sh",
        "-c",
        &heartbeat,
    ]);
    let sentinel = sentinel["id"].as_str().expect("id").to_string();
    let mut sentinel_pid = 0;
    wait_until(WAIT, "the sentinel instance to run", || {
        listed(&d)
            .and_then(|j| instance_pids(&j).get(&format!("{sentinel}-0")).copied())
            .is_some_and(|p| {
                sentinel_pid = p;
                true
            })
    });

    let mut workloads: Vec<Workload> = Vec::new();
    let mut registered: BTreeMap<String, Registered> = BTreeMap::new();
    let mut unregistered: BTreeSet<String> = BTreeSet::new();
    let mut uncertain: BTreeSet<String> = BTreeSet::new();
    let mut restarted_by_restart = Vec::new();
    // (from, to) in ns since the epoch: lodgerd was down (killed, not yet answering).
    let mut downtimes: Vec<(u64, u64)> = Vec::new();
    let started = Instant::now();
    for cycle in 0..cycles {
        // What runs before the kill, to tell a restart's doing from the plan's.
        let before = listed(&d).map(|j| instances(&j)).unwrap_or_default();
        let log_from = d.log().len();
        let victim = d.pid();
        let delay = Duration::from_millis(u64::from(rng.int(0, 400)));
        let kill_lodgerd = move || {
            std::thread::sleep(delay);
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(victim as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        };
        let during_calls = match mode.as_str() {
            "0" => false,
            "1" => true,
            _ => cycle % 2 == 1,
        };
        let killer = during_calls.then(|| std::thread::spawn(kill_lodgerd));
        // Churn while the killer waits: calls after the kill fail and count for nothing.
        for _ in 0..rng.int(1, 4) {
            match rng.int(0, 5) {
                0 | 1 if workloads.len() < 3 => {
                    let w = Workload::light();
                    // Half of them multi-node: lodgerd shapes the link while one is registered.
                    let out = register_training(&d, w.pid(), rng.chance(0.5));
                    if let Some(id) = answered_id(&out) {
                        registered.insert(
                            id,
                            Registered {
                                kind: "training",
                                pid: Some(w.pid()),
                            },
                        );
                    }
                    workloads.push(w);
                }
                2 => {
                    let kind = if rng.chance(0.5) { "offline" } else { "online" };
                    let mut args = vec!["--json", "register", kind];
                    if kind == "online" {
                        args.extend(["--slo-ms", "1000"]);
                    }
                    args.extend([
                        "--max-instances",
                        "1",
                        "--",
                        &worker,
                        "--quiet",
                        "--model-mib",
                        "1",
                    ]);
                    if let Some(id) = answered_id(&d.ctl(&args)) {
                        registered.insert(id, Registered { kind, pid: None });
                    }
                }
                3 => {
                    let ids: Vec<String> = registered
                        .keys()
                        .filter(|id| !unregistered.contains(*id))
                        .cloned()
                        .collect();
                    if !ids.is_empty() {
                        let id = &ids[rng.int(0, ids.len() as u32 - 1) as usize];
                        if d.ctl(&["unregister", id]).status.success() {
                            unregistered.insert(id.clone());
                        } else {
                            // Unanswered: it may have been done before lodgerd died.
                            uncertain.insert(id.clone());
                        }
                    }
                }
                _ if !workloads.is_empty() => {
                    // A training process exits by itself.
                    let i = rng.int(0, workloads.len() as u32 - 1) as usize;
                    workloads.remove(i);
                }
                _ => {}
            }
        }
        match killer {
            Some(k) => k.join().expect("killer"),
            // Between calls: lodgerd is killed while it ticks (instances starting, stopping,
            // being reaped), with no call in flight.
            None => kill_lodgerd(),
        }
        let down_from = now_ns().saturating_sub(delay_ns_slack());
        let alive_at_kill: BTreeMap<String, (u32, String)> = before
            .into_iter()
            .filter(|(_, (pid, _))| alive(*pid))
            .collect();
        d.kill();
        // What the dead lodgerd's state file plans: the instances the next one must adopt.
        let planned = planned_instances(&dir.path().join("state/state.json"));
        // Instances the dead lodgerd had begun to stop (a plan that dropped them) before the
        // kill: their replacement is the churn's doing even if the saved plan wants them again.
        let stopping: BTreeSet<String> = d
            .log()
            .get(log_from..)
            .unwrap_or("")
            .lines()
            .filter(|l| l.contains("stopping instance"))
            .filter_map(|l| l.split("instance=").nth(1))
            .filter_map(|rest| rest.split_whitespace().next().map(str::to_string))
            .collect();
        let restart_log_from = d.log().len();
        d.restart();
        // The first view after the restart: an instance that was alive is the same process.
        let mut after = BTreeMap::new();
        wait_until_explained(
            WAIT,
            &format!("the restarted lodgerd to list its jobs (cycle {cycle})"),
            || {
                listed(&d).is_some_and(|j| {
                    after = instances(&j);
                    true
                })
            },
            || {
                format!(
                    "load average: {}processes holding the state directory's lock: {}\n\
                     --- the restarted lodgerd's log ---\n{}",
                    std::fs::read_to_string("/proc/loadavg").unwrap_or_default(),
                    lock_holders(&dir.path().join("state/lodgerd.lock")),
                    d.log().get(restart_log_from..).unwrap_or("")
                )
            },
        );
        downtimes.push((down_from, now_ns()));
        for (key, (pid, config)) in &alive_at_kill {
            if let Some((new, new_config)) = after.get(key) {
                // The layout the saved plan wanted, in a new process: restarted because lodgerd
                // was. (A plan saved without it, and wanting it again once lodgerd is back, is
                // the churn's doing.)
                let wanted = planned.get(key) == Some(config);
                let stopped = stopping.contains(key);
                if new != pid && new_config == config && wanted && !stopped && !alive(*pid) {
                    restarted_by_restart.push(format!("cycle {cycle}: {key} {pid} -> {new}"));
                }
            }
        }
    }
    let run_time = started.elapsed();

    // Settle: instances of unregistered jobs finish stopping (grace 2 s), the plan is applied.
    std::thread::sleep(Duration::from_secs(4));
    let jobs = listed(&d).expect("lodgerd answers");
    let lost: Vec<&String> = registered
        .iter()
        .filter(|(id, r)| {
            !unregistered.contains(*id)
                && !uncertain.contains(*id)
                && r.pid.map_or(true, alive)
                && !jobs.contains_key(*id)
        })
        .map(|(id, _)| id)
        .collect();
    let marks = marked(&d.parent);
    let orphans: Vec<_> = marks
        .iter()
        .filter(|m| !jobs.contains_key(&m.job))
        .collect();
    let mut leaders: BTreeMap<(String, String), u32> = BTreeMap::new();
    for m in marks.iter().filter(|m| m.pid == m.pgrp) {
        *leaders.entry((m.job.clone(), m.index.clone())).or_default() += 1;
    }
    let duplicates: Vec<_> = leaders.iter().filter(|(_, n)| **n > 1).collect();
    let in_jobs: BTreeSet<u64> = jobs
        .values()
        .flat_map(|j| j["pids"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p.as_u64())
        .collect();
    let mut rr_outside = 0;
    for w in &workloads {
        if in_jobs.contains(&u64::from(w.pid())) {
            continue;
        }
        for tid in tids(w.pid()) {
            if sched_of(tid).is_some_and(|(p, _)| p == libc::SCHED_RR) {
                rr_outside += 1;
            }
        }
    }
    let running = instance_pids(&jobs);
    let listed_instances: BTreeSet<String> = jobs
        .iter()
        .flat_map(|(id, j)| {
            j["instances"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|i| i["index"].as_u64())
                .map(move |index| format!("{id}-{index}"))
                .collect::<Vec<_>>()
        })
        .collect();
    let lodgers = cgroup_path(&format!("/{}/lodgers", d.parent));
    let stale_cgroups: Vec<String> = std::fs::read_dir(&lodgers)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                // An instance backing off or restarting keeps its cgroup: only a cgroup of no
                // instance lodgerd lists is stale.
                .filter(|name| !listed_instances.contains(name))
                .collect()
        })
        .unwrap_or_default();
    // Shaping follows the multi-node jobs still registered, whatever the kills interrupted.
    let multi_node = jobs
        .values()
        .filter(|j| j["kind"] == "training" && j["multi_node"] == true)
        .count();
    let (stale_network, unshaped) = match &netns {
        Some(ns) => {
            let (htb, nft) = ns.shaping();
            if multi_node == 0 {
                (usize::from(htb) + usize::from(nft), false)
            } else {
                (0, !htb)
            }
        }
        None => (0, false),
    };
    let (gaps_up, gaps_down) = longest_gaps(&beats, &downtimes);
    let kinds = |k: &str| registered.values().filter(|r| r.kind == k).count();
    eprintln!(
        "crash suite: {cycles} kills in {:.0} s; registered {} training, {} offline, {} online, \
         unregistered {}",
        run_time.as_secs_f64(),
        kinds("training"),
        kinds("offline"),
        kinds("online"),
        unregistered.len()
    );
    eprintln!(
        "crash suite: lost registrations {}, orphan instances {}, duplicate instances {}, \
         threads left SCHED_RR outside any job {rr_outside}, stale lodger cgroups {}, \
         stale tc/nft rules {stale_network}{}, instances restarted by a lodgerd restart {}; \
         pauses of the sentinel instance (it writes every {HEARTBEAT_MS} ms; it shares a core \
         with a SCHED_RR training job, which pre-empts it): while lodgerd was down {gaps_down}, \
         while it ran {gaps_up}",
        lost.len(),
        orphans.len(),
        duplicates.len(),
        stale_cgroups.len(),
        match &netns {
            Some(_) if multi_node == 0 => " (no multi-node job left)".to_string(),
            Some(_) => format!(
                " ({multi_node} multi-node job(s) left, shaped: {})",
                !unshaped
            ),
            None => " (not checked)".to_string(),
        },
        restarted_by_restart.len(),
    );
    // And the lodgerd that survived the kills still shapes: a multi-node job now shapes the
    // link, its unregistration (the last one's) takes the shaping away. The churn's training
    // jobs go first: beside the anchor they may hold every CPU.
    if let Some(ns) = &netns {
        for (id, j) in &jobs {
            if j["kind"] == "training" && *id != anchor_id {
                d.ctl_ok(&["unregister", id]);
            }
        }
        let w = Workload::light();
        let out = register_training(&d, w.pid(), true);
        let Some(id) = answered_id(&out) else {
            panic!(
                "a multi-node job was not registered after the kills: {}{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                d.ctl_ok(&["--json", "list"])
            );
        };
        wait_until_explained(
            WAIT,
            "the link shaped for a multi-node job",
            || ns.shaping().0,
            || network_story(&d, ns),
        );
        d.ctl_ok(&["unregister", &id]);
        wait_until_explained(
            WAIT,
            "the shaping taken away",
            || ns.shaping() == (false, false),
            || network_story(&d, ns),
        );
    }
    let log = d.log();
    assert!(lost.is_empty(), "lost: {lost:?}\n{jobs:#?}\n{log}");
    assert!(orphans.is_empty(), "orphans: {orphans:?}");
    assert!(duplicates.is_empty(), "duplicates: {duplicates:?}");
    assert_eq!(
        rr_outside, 0,
        "threads left SCHED_RR outside any job\n{log}"
    );
    assert!(
        stale_cgroups.is_empty(),
        "stale cgroups: {stale_cgroups:?}\n{jobs:#?}\n{log}"
    );
    assert_eq!(stale_network, 0, "stale tc/nft rules\n{log}");
    assert!(
        !unshaped,
        "a multi-node job is registered and {LINK} is not shaped\n{log}"
    );
    assert!(
        restarted_by_restart.is_empty(),
        "restarted by a restart: {restarted_by_restart:?}\n{log}"
    );
    // The sentinel ran the whole time, as one process.
    assert_eq!(
        running.get(&format!("{sentinel}-0")),
        Some(&sentinel_pid),
        "the sentinel instance was replaced or is not running: {:#?}\n{}",
        jobs.get(&sentinel),
        d.log()
    );
}

/// What a wait on the link's shaping that timed out leaves to go on (it failed once under load,
/// and passed when run again): lodgerd's network status and jobs' network lines, the link's
/// qdiscs, lodgerd's network log lines and its last lines (a stalled tick shows there).
fn network_story(d: &Daemon, ns: &Netns) -> String {
    let status = String::from_utf8_lossy(&d.ctl(&["--json", "status"]).stdout).into_owned();
    let jobs: Vec<String> = listed(d)
        .unwrap_or_default()
        .iter()
        .map(|(id, j)| {
            format!(
                "{id} {} multi_node={} network={}",
                j["kind"], j["multi_node"], j["network"]
            )
        })
        .collect();
    let qdiscs = std::process::Command::new("tc")
        .args(["-n", &ns.name, "qdisc", "show", "dev", LINK])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let log = d.log();
    let lines: Vec<&str> = log.lines().collect();
    let network: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.contains("network") || l.contains("shaping"))
        .collect();
    format!(
        "status: {status}\njobs:\n{}\nqdiscs on {LINK}: {qdiscs}\nnetwork log lines:\n{}\nlast log lines:\n{}",
        jobs.join("\n"),
        network.join("\n"),
        lines[lines.len().saturating_sub(60)..].join("\n")
    )
}

/// `lodgerctl --json register training` of `pid` on one core, not right-sized.
fn register_training(d: &Daemon, pid: u32, multi_node: bool) -> std::process::Output {
    let pid = pid.to_string();
    let mut args = vec![
        "--json",
        "register",
        "training",
        "--pid",
        &pid,
        "--cores",
        "1",
        "--no-rightsize",
    ];
    if multi_node {
        args.push("--multi-node");
    }
    d.ctl(&args)
}

/// The instances a state file's inference plan wants, by "job-index", with their threads and
/// batch (as [`instances`] words them).
fn planned_instances(state: &std::path::Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(text) = std::fs::read_to_string(state) else {
        return out;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return out;
    };
    for kind in ["online", "offline"] {
        for (job, insts) in v["inference"][kind].as_object().into_iter().flatten() {
            for (index, inst) in insts.as_object().into_iter().flatten() {
                out.insert(
                    format!("{job}-{index}"),
                    format!("{} thread(s), batch {}", inst["threads"], inst["batch"]),
                );
            }
        }
    }
    out
}

/// The id of an answered `--json register`, None when lodgerd did not answer or refused.
fn answered_id(out: &std::process::Output) -> Option<String> {
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v["id"].as_str().map(str::to_string)
}

/// Nanoseconds since the epoch, the heartbeat file's clock (`date +%s%N`).
fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// lodgerd may have died up to this long before the killer thread was joined.
fn delay_ns_slack() -> u64 {
    50_000_000
}

/// The longest time between two consecutive timestamps (nanoseconds, one a line) in `file`, in
/// all and among the pauses that overlap a downtime.
fn longest_gaps(file: &std::path::Path, downtimes: &[(u64, u64)]) -> (Gaps, Gaps) {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let stamps: Vec<u64> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for w in stamps.windows(2) {
        let gap = w[1].saturating_sub(w[0]);
        if downtimes.iter().any(|&(from, to)| w[0] < to && w[1] > from) {
            down.push(gap);
        } else {
            up.push(gap);
        }
    }
    (Gaps::of(up), Gaps::of(down))
}

/// The pauses between the sentinel's beats over a span: how many, the p99 and the longest.
struct Gaps {
    count: usize,
    p99: Duration,
    max: Duration,
}

impl Gaps {
    fn of(mut ns: Vec<u64>) -> Gaps {
        ns.sort_unstable();
        let at = |q: f64| {
            let i = ((ns.len() as f64 * q).ceil() as usize).saturating_sub(1);
            Duration::from_nanos(ns.get(i).copied().unwrap_or(0))
        };
        Gaps {
            count: ns.len(),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

impl std::fmt::Display for Gaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p99 {:.0} ms, longest {:.0} ms of {} pauses",
            self.p99.as_secs_f64() * 1000.0,
            self.max.as_secs_f64() * 1000.0,
            self.count
        )
    }
}
