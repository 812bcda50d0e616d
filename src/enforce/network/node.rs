//! The agent's side of network shaping (the node's `NetworkControl`) (SODA §V-E, from §IV-C-2): decides each tick whether
//! the node's interfaces are shaped, keeps CPU jobs' processes classified, and reports what it
//! did. The kernel side (HTB tree, filters, nftables table, `net_cls` cgroups) is
//! [`super`]; this module only drives it.
//!
//! - While at least one multi-node training job runs, every configured interface is shaped and
//!   every CPU job's processes are classified into the CPU-jobs class: on cgroup v1 by moving
//!   them into one `net_cls` cgroup carrying the class id (`<net_cls>/<parent>/cpu-jobs`), on
//!   v2 by matching the cgroup2 directory their instance cgroups live in, or a batch job's own
//!   cgroup (never its parent, which holds other jobs).
//! - When none runs, all of it is removed. The first reconcile after lodgerd starts removes
//!   whatever a previous lodgerd left (only lodger's own handle, table and cgroup) unless a
//!   re-adopted multi-node job wants it, in which case it is adopted as is (apply is idempotent).
//! - An applied tree is re-read every [`VERIFY_TICKS`] ticks, so one someone deleted comes back;
//!   in between, nothing is forked unless what should be shaped changed.
//!
//! On v1 a new CPU-job process is classified at the next tick: what it sends before then is
//! training's. Processes in their own network namespace are not seen (see [`super`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use super::route::CpuJobsRoute;
use super::{
    dissolve_cgroup, read_pids, write_value, CpuJobMatch, CpuJobs, NetClsGroup, NetworkShaping,
    ShapingConfig, Steering, TcError, TcRunner, DEFAULT_HANDLE,
};
use crate::job::JobId;

/// Re-read an applied tree every this many reconciles.
pub const VERIFY_TICKS: u32 = 10;
/// What marks a CPU job's packet (and its v1 `net_cls` class id) when CPU jobs are routed
/// rather than shaped: the class id shaping would give them, `4c44:20`.
pub const CPU_JOBS_MARK: u32 = ((DEFAULT_HANDLE as u32) << 16) | 0x20;
/// The `net_cls` cgroup (under lodger's parent) holding CPU jobs' processes on v1.
pub const NET_CLS_GROUP: &str = "cpu-jobs";
/// What `lodgerctl show` says of a CPU job whose traffic no rule matches while shaping is on:
/// on cgroup v2 a CPU job is told apart by a cgroup of its own, and lodger moves no process it
/// did not start.
pub const UNSHAPED: &str = "not shaped while multi-node training runs: on cgroup v2 a CPU job \
     is matched by a cgroup of its own and this one has none (register it by cgroup, or with \
     cgroup.pid_jobs = \"cgroup\")";

/// How CPU jobs' processes are told apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Classifier {
    /// cgroup v1: a `net_cls` cgroup `<hierarchy>/<relative>` with lodger's class id.
    NetCls {
        hierarchy: PathBuf,
        relative: String,
    },
    /// cgroup v2: by the cgroup2 directories holding the instances' cgroups.
    CgroupV2,
    /// cgroup v2 where instances have no cgroups of their own (pinned by affinity): CPU jobs'
    /// processes are in `<root>/<relative>`, a cgroup with no controllers, which nft matches:
    /// lodger's `<parent>/lodgers` where instances start (issue 17), else, where lodgerd cannot
    /// make that, a child of lodgerd's own cgroup (legal in a delegated subtree, since no
    /// controller is enabled below it). Instances start in it (lodgerd sets
    /// `InstanceSettings::start_cgroup`), since a socket keeps the cgroup its process had when
    /// it was made; shaping moves in any process of a CPU job found outside it. It stays while
    /// lodgerd runs, shaping or not (removed, the sockets made in it would match no later
    /// rule), and across lodgerd's restarts with the instances in it (issue 17); it is dissolved
    /// only when the shaping control is replaced (a reload).
    OwnCgroupV2 { root: PathBuf, relative: String },
    /// Not possible on this node; the reason, said once when shaping is wanted.
    Unavailable(String),
}

/// One CPU job as the agent sees it this tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuJob {
    pub job: JobId,
    /// Its processes (v1 moves them into the `net_cls` cgroup, a hierarchy of its own).
    pub pids: Vec<u32>,
    /// Whether `pids` are lodger's own inference instances, which lodger may move between
    /// cgroup2 directories ([`Classifier::OwnCgroupV2`]). Never a batch job's or a
    /// container's: on v2 a move changes every controller (the Slurm job's memory limit,
    /// accounting, kill by cgroup).
    pub instances: bool,
    /// The cgroup2 directories (relative to the cgroup2 root) whose processes, and everything
    /// below, are this job's, matched exactly as given (v2): the directory holding its
    /// instances' cgroups ([`instances_directory`]), or a batch job's or container's own cgroup.
    pub cgroups: Vec<String>,
}

/// What should be shaped this tick.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworkWant {
    /// Multi-node training jobs running on the node.
    pub multi_node: Vec<JobId>,
    pub cpu_jobs: Vec<CpuJob>,
}

/// A change a job's owner should hear about (a `Throttled` signal, SODA §V-E accounting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetworkEvent {
    /// The CPU job's traffic is now held to its share.
    Held(JobId),
    /// It no longer is.
    Released(JobId),
}

/// What is done to CPU jobs' traffic while multi-node training runs.
#[allow(clippy::large_enum_variant)]
enum Method {
    /// HTB on the configured interfaces: CPU jobs held to their share.
    Shape {
        shaping: NetworkShaping,
        config: ShapingConfig,
    },
    /// The two-network option: CPU jobs' traffic on the slower network.
    Route(CpuJobsRoute),
}

/// Network shaping for the node, driven by the agent.
pub struct NetworkControl {
    method: Method,
    /// The class id CPU jobs' `net_cls` cgroup carries (v1), and their packets' mark.
    classid: u32,
    runner: Box<dyn TcRunner>,
    classifier: Classifier,
    /// Whether the tree is known to be in place (`None`: not known yet, at start).
    active: Option<bool>,
    /// The v2 directories matched by the last apply.
    applied_v2: Vec<String>,
    since_verify: u32,
    /// CPU jobs told they are held.
    held: BTreeSet<JobId>,
    /// CPU jobs no rule can cover on this node (see [`UNSHAPED`]).
    unshaped: BTreeSet<JobId>,
    /// Whether what another configuration left was looked for (the first reconcile).
    swept: bool,
    /// The last problem, logged once until it changes.
    problem: Option<String>,
}

impl NetworkControl {
    pub fn new(
        config: &ShapingConfig,
        steering: Steering,
        runner: Box<dyn TcRunner>,
        classifier: Classifier,
    ) -> Result<Self, TcError> {
        let shaping = NetworkShaping::new(config, steering)?;
        Ok(Self {
            classid: shaping.net_cls_classid(),
            method: Method::Shape {
                shaping,
                config: config.clone(),
            },
            runner,
            classifier,
            active: None,
            applied_v2: Vec::new(),
            since_verify: 0,
            held: BTreeSet::new(),
            unshaped: BTreeSet::new(),
            swept: false,
            problem: None,
        })
    }

    /// The two-network option: CPU jobs' traffic moves to `route`'s slower network while
    /// multi-node training runs.
    pub fn routing(route: CpuJobsRoute, runner: Box<dyn TcRunner>, classifier: Classifier) -> Self {
        Self {
            method: Method::Route(route),
            classid: CPU_JOBS_MARK,
            runner,
            classifier,
            active: None,
            applied_v2: Vec::new(),
            since_verify: 0,
            held: BTreeSet::new(),
            unshaped: BTreeSet::new(),
            swept: false,
            problem: None,
        }
    }

    /// What a `Throttled` signal's level says a held CPU job gets: its share, or the network.
    pub fn held_level(&self) -> String {
        match &self.method {
            Method::Shape { config, .. } => format!("{}%", config.cpu_jobs_percent),
            Method::Route(r) => format!("via {}", r.interface()),
        }
    }

    /// The interfaces, as `eth0 (25000 Mbit/s), eth1 (...)`.
    fn links(&self) -> String {
        match &self.method {
            Method::Shape { config, .. } => config
                .links
                .iter()
                .map(|l| format!("{} ({} Mbit/s)", l.interface, l.line_rate_mbit))
                .collect::<Vec<_>>()
                .join(", "),
            Method::Route(r) => r.interface().to_string(),
        }
    }

    /// The node's shaping in words, for `lodgerctl status`.
    pub fn status(&self) -> String {
        if let Some(p) = &self.problem {
            return format!("not shaping: {p}");
        }
        let unshaped = match (self.active, self.unshaped.len()) {
            (Some(true), n) if n > 0 => {
                format!("; {n} CPU job(s) not shaped (no cgroup of their own)")
            }
            _ => String::new(),
        };
        let text = match (&self.method, self.active) {
            (Method::Shape { shaping, config }, Some(true)) => format!(
                "shaping {}: training {}%, CPU jobs {}% (ceil {}%), steering {}",
                self.links(),
                config.training_percent,
                config.cpu_jobs_percent,
                config.cpu_jobs_ceil_percent,
                steering_name(shaping.steering())
            ),
            (Method::Shape { .. }, _) => format!(
                "idle: no multi-node training job ({} unshaped)",
                self.links()
            ),
            (Method::Route(r), Some(true)) => format!(
                "routing CPU jobs' IPv4 traffic via {} (the slower network)",
                r.interface()
            ),
            (Method::Route(_), _) => {
                "idle: no multi-node training job (CPU jobs on their usual routes)".to_string()
            }
        };
        text + &unshaped
    }

    /// What a job's `lodgerctl show` says about the network while shaping is on.
    pub fn job_text(&self, id: &JobId, multi_node_training: bool) -> Option<String> {
        if self.active != Some(true) {
            return None;
        }
        if self.unshaped.contains(id) {
            return Some(UNSHAPED.to_string());
        }
        match (&self.method, multi_node_training, self.held.contains(id)) {
            (Method::Shape { config, .. }, true, _) => Some(format!(
                "training traffic guaranteed {}% of {}",
                config.training_percent,
                self.links()
            )),
            (Method::Shape { config, .. }, false, true) => Some(format!(
                "held to {}% (ceil {}%) of {} while multi-node training runs",
                config.cpu_jobs_percent,
                config.cpu_jobs_ceil_percent,
                self.links()
            )),
            (Method::Route(r), true, _) => Some(format!(
                "CPU jobs' traffic moved to {} (the slower network)",
                r.interface()
            )),
            (Method::Route(r), false, true) => Some(format!(
                "IPv4 traffic routed via {} (the slower network) while multi-node training runs",
                r.interface()
            )),
            _ => None,
        }
    }

    fn note_problem(&mut self, problem: Option<String>) {
        if problem != self.problem {
            match &problem {
                Some(p) => warn!("network shaping: {p}"),
                None if self.problem.is_some() => info!("network shaping: recovered"),
                None => {}
            }
        }
        self.problem = problem;
    }

    /// One tick: shape while `want` has a multi-node training job, remove everything otherwise.
    pub fn reconcile(&mut self, want: &NetworkWant) -> Vec<NetworkEvent> {
        if !std::mem::replace(&mut self.swept, true) {
            self.remove_other_leftovers();
        }
        if want.multi_node.is_empty() {
            return self.remove_all(false);
        }
        if let Classifier::Unavailable(why) = &self.classifier {
            let p = format!("cannot tell CPU jobs' traffic apart: {why}");
            self.note_problem(Some(p));
            return Vec::new();
        }
        match self.shape(want) {
            Ok(events) => {
                self.note_problem(None);
                events
            }
            Err(e) => {
                self.note_problem(Some(e.to_string()));
                // Re-read everything next time.
                self.since_verify = VERIFY_TICKS;
                Vec::new()
            }
        }
    }

    fn shape(&mut self, want: &NetworkWant) -> Result<Vec<NetworkEvent>, TcError> {
        // Which CPU jobs a rule covers: on v1 every one (its processes are moved into the
        // `net_cls` cgroup); on v2 those with a cgroup of their own, and under
        // `OwnCgroupV2` also lodger's instances, moved into lodger's cgroup.
        let covered = |j: &CpuJob| match &self.classifier {
            Classifier::NetCls { .. } => true,
            Classifier::CgroupV2 => !v2_directories(std::slice::from_ref(j)).is_empty(),
            Classifier::OwnCgroupV2 { .. } => {
                j.instances || !v2_directories(std::slice::from_ref(j)).is_empty()
            }
            Classifier::Unavailable(_) => false,
        };
        let (shaped, unshaped): (Vec<&CpuJob>, Vec<&CpuJob>) =
            want.cpu_jobs.iter().partition(|j| covered(j));
        let cpu_jobs = match &self.classifier {
            Classifier::NetCls {
                hierarchy,
                relative,
            } => {
                let (group, _) = NetClsGroup::create(hierarchy, relative, self.classid)?;
                move_into(
                    group.path(),
                    want.cpu_jobs.iter().flat_map(|j| j.pids.iter()),
                )?;
                CpuJobs::NetCls
            }
            Classifier::CgroupV2 => CpuJobs::CgroupV2(v2_directories(&want.cpu_jobs)),
            Classifier::OwnCgroupV2 { root, relative } => {
                let dir = root.join(relative);
                if !dir.is_dir() {
                    std::fs::create_dir_all(&dir).map_err(|source| TcError::Create {
                        path: dir.clone(),
                        source,
                    })?;
                }
                // Only lodger's instances: a batch job's or container's processes stay in
                // their own cgroup, matched there.
                move_into(
                    &dir,
                    want.cpu_jobs
                        .iter()
                        .filter(|j| j.instances)
                        .flat_map(|j| j.pids.iter()),
                )?;
                let mut dirs = vec![relative.clone()];
                dirs.extend(v2_directories(&want.cpu_jobs));
                dirs.sort();
                dirs.dedup();
                CpuJobs::CgroupV2(dirs)
            }
            Classifier::Unavailable(_) => return Ok(Vec::new()),
        };
        let v2_changed = match &cpu_jobs {
            CpuJobs::CgroupV2(dirs) => *dirs != self.applied_v2,
            CpuJobs::NetCls => false,
        };
        let due = self.active != Some(true) || v2_changed || self.since_verify >= VERIFY_TICKS;
        if due {
            let changed = match &mut self.method {
                Method::Shape { shaping, .. } => {
                    shaping.apply(self.runner.as_mut(), &cpu_jobs)?.changed
                }
                Method::Route(route) => {
                    let matches: Vec<CpuJobMatch> = match &cpu_jobs {
                        CpuJobs::NetCls => vec![CpuJobMatch::NetClsClassid(self.classid)],
                        CpuJobs::CgroupV2(dirs) => {
                            dirs.iter().cloned().map(CpuJobMatch::CgroupV2).collect()
                        }
                    };
                    route.apply(self.runner.as_mut(), &matches)? || self.active != Some(true)
                }
            };
            if changed {
                info!(
                    "network shaping on ({}): {}",
                    want.multi_node
                        .iter()
                        .map(|j| j.to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.status_when_on()
                );
            }
            self.active = Some(true);
            self.since_verify = 0;
            if let CpuJobs::CgroupV2(dirs) = cpu_jobs {
                self.applied_v2 = dirs;
            }
        } else {
            self.since_verify += 1;
        }
        let now: BTreeSet<JobId> = shaped.iter().map(|j| j.job.clone()).collect();
        let unshaped: BTreeSet<JobId> = unshaped.iter().map(|j| j.job.clone()).collect();
        // Held before and no rule covers it now (its cgroup went): released.
        let mut events: Vec<NetworkEvent> = self
            .held
            .intersection(&unshaped)
            .map(|j| NetworkEvent::Released(j.clone()))
            .collect();
        events.extend(
            now.difference(&self.held)
                .map(|j| NetworkEvent::Held(j.clone())),
        );
        self.held = now;
        for j in unshaped.difference(&self.unshaped) {
            info!(job = %j, "network shaping: {UNSHAPED}");
        }
        self.unshaped = unshaped;
        Ok(events)
    }

    /// At the first reconcile: removes what an earlier lodgerd with another configuration left
    /// (lodger's HTB root on an interface this control does not shape, the other method's tree
    /// or route). What is this control's own is adopted or removed by it, as at any reconcile.
    fn remove_other_leftovers(&mut self) {
        let interfaces: Vec<String> = match &self.method {
            Method::Shape { config, .. } => {
                config.links.iter().map(|l| l.interface.clone()).collect()
            }
            Method::Route(_) => Vec::new(),
        };
        let own = super::Own {
            interfaces: &interfaces,
            shaping_table: matches!(self.method, Method::Shape { .. }),
            route: matches!(self.method, Method::Route(_)),
        };
        let (removed, errors) = super::remove_leftovers_but(self.runner.as_mut(), own, None);
        if !removed.is_empty() {
            warn!(
                "network shaping: removed what an earlier lodgerd with another configuration left: {}",
                removed.join(", ")
            );
        }
        for e in errors {
            warn!("network shaping: cannot remove what an earlier lodgerd left: {e}");
        }
    }

    fn status_when_on(&self) -> String {
        match &self.method {
            Method::Shape { config, .. } => format!(
                "{}: training {}%, CPU jobs {}%",
                self.links(),
                config.training_percent,
                config.cpu_jobs_percent
            ),
            Method::Route(r) => format!("CPU jobs' IPv4 traffic via {}", r.interface()),
        }
    }

    /// Removes the tree; `stopping`: lodgerd stops, so lodgerd's own CPU jobs' cgroup
    /// ([`Classifier::OwnCgroupV2`]) goes too.
    fn remove_all(&mut self, stopping: bool) -> Vec<NetworkEvent> {
        if self.active == Some(false) {
            return Vec::new();
        }
        let mut problems = Vec::new();
        let removed = match &mut self.method {
            Method::Shape { shaping, .. } => shaping.remove(self.runner.as_mut()),
            Method::Route(route) => route.remove(self.runner.as_mut()),
        };
        let removed = match removed {
            Ok(changed) => changed,
            Err(e) => {
                problems.push(e.to_string());
                false
            }
        };
        if let Classifier::NetCls {
            hierarchy,
            relative,
        } = &self.classifier
        {
            if let Err(e) = super::net_cls::remove_group(hierarchy, relative) {
                problems.push(e.to_string());
            }
        }
        if let (Classifier::OwnCgroupV2 { root, relative }, true) = (&self.classifier, stopping) {
            let dir = root.join(relative);
            if dir.is_dir() {
                // Its processes go back to lodgerd's cgroup, where they came from.
                let back = dir.parent().unwrap_or(root);
                if let Err(e) = dissolve_cgroup(&dir, back) {
                    problems.push(e.to_string());
                }
            }
        }
        if problems.is_empty() {
            if removed {
                info!("network shaping off: {} unshaped", self.links());
            }
            self.active = Some(false);
            self.applied_v2.clear();
            self.unshaped.clear();
            self.note_problem(None);
        } else {
            // Part of it may be gone (the tree removed, the net_cls group not): nothing is
            // known to be in place, and the next shaping applies everything again.
            self.active = None;
            self.note_problem(Some(format!(
                "cannot remove shaping: {}",
                problems.join("; ")
            )));
        }
        std::mem::take(&mut self.held)
            .into_iter()
            .map(NetworkEvent::Released)
            .collect()
    }

    /// Remove everything, whatever runs, and lodgerd's own CPU jobs' cgroup too (its processes
    /// back to lodgerd's cgroup): shaping ends for good.
    pub fn shutdown(&mut self) -> Vec<NetworkEvent> {
        self.active = None;
        self.remove_all(true)
    }

    /// Remove the tree, whatever runs, for another control to take over (a reload): lodgerd's
    /// own CPU jobs' cgroup stays, with the instances and the sockets they made in it.
    pub fn remove_for_replacement(&mut self) -> Vec<NetworkEvent> {
        self.active = None;
        self.remove_all(false)
    }
}

/// The cgroup2 directories CPU jobs' processes are matched by, as the jobs give them, sorted,
/// once each. Taken as given, never widened to a parent: a batch job's own cgroup (a Slurm
/// job's, a container's) has siblings that are not CPU jobs, the training job among them.
fn v2_directories(jobs: &[CpuJob]) -> Vec<String> {
    let dirs: BTreeSet<String> = jobs
        .iter()
        .flat_map(|j| j.cgroups.iter())
        .map(|c| c.trim_matches('/'))
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect();
    dirs.into_iter().collect()
}

/// The cgroup2 directory holding an inference instance's cgroup (`instance`, relative to the
/// cgroup2 root), which shaping matches for all of a job's instances: long-lived, so nft's
/// path-to-id resolution stays valid while instances come and go, and holding only lodger's
/// instances. `None` for a cgroup at the root.
pub fn instances_directory(instance: &str) -> Option<String> {
    Path::new(instance.trim_matches('/'))
        .parent()
        .and_then(|p| p.to_str())
        .filter(|p| !p.is_empty())
        .map(str::to_string)
}

fn steering_name(s: Steering) -> &'static str {
    match s {
        Steering::Auto => "auto",
        Steering::TcFilter => "tc filter",
        Steering::Nft => "nftables",
    }
}

/// Moves `pids` not yet in the cgroup `dir` into it; one that exited meanwhile is skipped.
fn move_into<'a>(dir: &Path, pids: impl Iterator<Item = &'a u32>) -> Result<(), TcError> {
    let procs = dir.join("cgroup.procs");
    let inside: BTreeSet<u32> = read_pids(&procs)?.into_iter().collect();
    for pid in pids {
        if inside.contains(pid) {
            continue;
        }
        match write_value(&procs, &pid.to_string()) {
            Ok(()) => {}
            Err(TcError::Write { source, .. }) if source.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Every process of the cgroups `dirs` (instance cgroups: an instance and its children).
pub fn procs_of(dirs: &[PathBuf]) -> Vec<u32> {
    let mut pids = BTreeMap::new();
    for dir in dirs {
        if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                pids.insert(pid, ());
            }
        }
    }
    pids.into_keys().collect()
}

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;
