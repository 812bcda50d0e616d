//! config::reload: what a reload (`systemctl reload lodgerd`, SIGHUP) may change in a running
//! lodgerd. Compares the running config with the file as it reads now and returns the config to
//! run with: the keys that can change live taken from the file, every other key kept as it runs,
//! each refusal said with the key. Touches no file.

use super::Config;

/// What a reload did: the keys taken from the file, and the sections that differ but cannot
/// change without a restart (kept as they run).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reload {
    pub applied: Vec<String>,
    pub refused: Vec<String>,
}

impl Reload {
    /// One log line's worth: what changed, and what was refused and why.
    pub fn describe(&self) -> String {
        let applied = if self.applied.is_empty() {
            "nothing changed".to_string()
        } else {
            format!("applied {}", self.applied.join(", "))
        };
        if self.refused.is_empty() {
            return applied;
        }
        format!(
            "{applied}; refused (they need a restart, the running values are kept): {}",
            self.refused.join(", ")
        )
    }
}

/// The config to run with after a reload to `new`, and what that changed. Live:
/// `agent.interval_ms` (the loop's tick), `[rightsize]` (a search under way keeps the window it
/// started with), `[contention]` (mode, threshold, tick counts; off gives every throttle back),
/// `training.rt_headroom_percent`, and `[api]`'s group, cgroup roots and per-owner caps (from the
/// next call), `sense.interval_ms` and `sense.deadline_ms` (from each source's next pass), and
/// `[network]` when `network_live` (lodgerd shaped or routed at start, so it knows
/// how CPU jobs' traffic is told apart here: links, shares, steering and the two-network option
/// change; the tree in place is removed and the new one applied). Every other key is wired into
/// threads, cgroups, the bus or the kernel at start, so a change there is refused and the running
/// value kept.
pub fn reload(running: &Config, new: &Config, network_live: bool) -> (Config, Reload) {
    // Destructured so that a section added to `Config` does not build until it is applied live
    // or refused below: a change nobody looks at would be neither, and the log would say
    // "nothing changed".
    let Config {
        node,
        training,
        agent,
        api,
        cgroup,
        log,
        sense,
        metrics,
        inference,
        rightsize,
        contention,
        network,
        batch,
        slurm,
        kubernetes,
        source: _,
    } = new;
    let mut next = running.clone();
    let mut r = Reload::default();
    if agent.interval_ms != running.agent.interval_ms {
        next.agent.interval_ms = agent.interval_ms;
        r.applied.push(format!(
            "agent.interval_ms = {} (was {})",
            agent.interval_ms, running.agent.interval_ms
        ));
    }
    if *rightsize != running.rightsize {
        next.rightsize = rightsize.clone();
        r.applied.push("[rightsize]".to_string());
    }
    if *contention != running.contention {
        next.contention = contention.clone();
        r.applied.push("[contention]".to_string());
    }
    if training.rt_headroom_percent != running.training.rt_headroom_percent {
        next.training.rt_headroom_percent = training.rt_headroom_percent;
        r.applied.push(format!(
            "training.rt_headroom_percent = {} (was {})",
            training.rt_headroom_percent, running.training.rt_headroom_percent
        ));
    }
    let mut api_live = running.api.clone();
    api_live.group = api.group.clone();
    api_live.cgroup_roots = api.cgroup_roots.clone();
    api_live.max_jobs_per_owner = api.max_jobs_per_owner;
    api_live.max_instances_per_owner = api.max_instances_per_owner;
    if api_live != running.api {
        next.api = api_live;
        r.applied
            .push("[api] group/cgroup_roots/max_*_per_owner".to_string());
    }
    let network_refused = *network != running.network && !network_live;
    if *network != running.network && network_live {
        next.network = network.clone();
        r.applied.push("[network]".to_string());
    }
    if (sense.interval_ms, sense.deadline_ms)
        != (running.sense.interval_ms, running.sense.deadline_ms)
    {
        next.sense.interval_ms = sense.interval_ms;
        next.sense.deadline_ms = sense.deadline_ms;
        r.applied.push(format!(
            "sense.interval_ms = {}, sense.deadline_ms = {}",
            sense.interval_ms, sense.deadline_ms
        ));
    }
    let mut sense_rest = sense.clone();
    sense_rest.interval_ms = running.sense.interval_ms;
    sense_rest.deadline_ms = running.sense.deadline_ms;
    let mut agent_rest = agent.clone();
    agent_rest.interval_ms = running.agent.interval_ms;
    if slurm.rules != running.slurm.rules {
        // The prolog reads them from the file at every run; lodgerd only keeps the text.
        next.slurm.rules = slurm.rules.clone();
        r.applied
            .push("[[slurm.rule]] (read by the next prolog)".to_string());
    }
    let mut slurm_rest = slurm.clone();
    slurm_rest.rules = running.slurm.rules.clone();
    let mut training_rest = training.clone();
    training_rest.rt_headroom_percent = running.training.rt_headroom_percent;
    let refused = [
        ("[node]", *node != running.node),
        (
            "[training] (but rt_headroom_percent)",
            training_rest != running.training,
        ),
        (
            "[agent] state_dir/command_timeout_ms",
            agent_rest != running.agent,
        ),
        ("api.bus", api.bus != running.api.bus),
        ("[cgroup]", *cgroup != running.cgroup),
        ("[log]", *log != running.log),
        (
            "[sense] (but interval_ms and deadline_ms)",
            sense_rest != running.sense,
        ),
        ("[metrics]", *metrics != running.metrics),
        ("[inference]", *inference != running.inference),
        ("[batch]", *batch != running.batch),
        ("[slurm] (but [[slurm.rule]])", slurm_rest != running.slurm),
        (
            "[network] (shaping was off at start: a restart turns it on)",
            network_refused,
        ),
        // The NRI plugin connects to the runtime once, at start.
        ("[kubernetes]", *kubernetes != running.kubernetes),
    ];
    r.refused = refused
        .into_iter()
        .filter(|(_, differs)| *differs)
        .map(|(name, _)| name.to_string())
        .collect();
    (next, r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn parse(text: &str) -> Config {
        Config::parse(text, Path::new("/etc/lodger/lodger.toml")).expect("config")
    }

    #[test]
    fn live_keys_are_taken_and_the_others_refused_and_kept() {
        let running = parse("[agent]\ninterval_ms = 1000\n[api]\ngroup = \"lodger\"\n");
        let new = parse(
            "[agent]\ninterval_ms = 250\nstate_dir = \"/srv/lodger\"\n\
             [api]\ngroup = \"gpu\"\nbus = \"session\"\nmax_jobs_per_owner = 4\n\
             [rightsize]\nmode = \"advise\"\n\
             [contention]\nmode = \"off\"\nmembw_threshold = 0.5\n\
             [training]\nrt_headroom_percent = 10\nrt_priority = 20\n\
             [sense]\ninterval_ms = 2000\ngpu = \"off\"\n",
        );
        let (next, r) = reload(&running, &new, false);
        assert_eq!(next.agent.interval_ms, 250);
        assert_eq!(next.rightsize, new.rightsize);
        assert_eq!(next.contention, new.contention);
        assert_eq!(next.training.rt_headroom_percent, 10);
        assert_eq!(next.api.group, "gpu");
        assert_eq!(next.api.max_jobs_per_owner, 4);
        assert_eq!(next.sense.interval_ms, 2000);
        assert_eq!(next.sense.gpu, running.sense.gpu);
        // Refused: kept as they run.
        assert_eq!(next.agent.state_dir, running.agent.state_dir);
        assert_eq!(next.api.bus, running.api.bus);
        assert_eq!(next.training.rt_priority, running.training.rt_priority);
        assert_eq!(
            r.applied,
            [
                "agent.interval_ms = 250 (was 1000)",
                "[rightsize]",
                "[contention]",
                "training.rt_headroom_percent = 10 (was 5)",
                "[api] group/cgroup_roots/max_*_per_owner",
                "sense.interval_ms = 2000, sense.deadline_ms = 5000",
            ]
        );
        assert_eq!(
            r.refused,
            [
                "[training] (but rt_headroom_percent)",
                "[agent] state_dir/command_timeout_ms",
                "api.bus",
                "[sense] (but interval_ms and deadline_ms)",
            ]
        );
        assert!(
            r.describe().contains("refused (they need a restart"),
            "{}",
            r.describe()
        );
    }

    #[test]
    fn the_same_file_changes_nothing() {
        let running = parse("[agent]\ninterval_ms = 500\n");
        let (next, r) = reload(&running, &running.clone(), true);
        assert_eq!(next, running);
        assert_eq!(r, Reload::default());
        assert_eq!(r.describe(), "nothing changed");
    }

    #[test]
    fn network_changes_live_only_where_lodgerd_shaped_at_start() {
        let running =
            parse("[network]\n[[network.link]]\ninterface = \"eth0\"\nline_rate_mbit = 100\n");
        let new = parse("[network]\n[[network.link]]\ninterface = \"eth0\"\nline_rate_mbit = 40\n");
        let (next, r) = reload(&running, &new, true);
        assert_eq!(next.network, new.network);
        assert_eq!(r.applied, ["[network]"]);
        assert!(r.refused.is_empty());
        let (next, r) = reload(&running, &new, false);
        assert_eq!(next.network, running.network);
        assert_eq!(
            r.refused,
            ["[network] (shaping was off at start: a restart turns it on)"]
        );
    }

    #[test]
    fn slurm_rules_are_taken_and_batch_and_cgroup_paths_need_a_restart() {
        let running = parse("");
        let new = parse(
            "[batch]\npolicy = \"batch\"\n[slurm]\nappear_timeout_seconds = 60\n\
             [[slurm.rule]]\npartition = \"debug\"\nkind = \"leave\"\n",
        );
        let (next, r) = reload(&running, &new, false);
        assert_eq!(next.slurm.rules, new.slurm.rules);
        assert_eq!(next.slurm.appear_timeout_seconds, 600);
        assert_eq!(next.batch, running.batch);
        assert_eq!(r.applied, ["[[slurm.rule]] (read by the next prolog)"]);
        assert_eq!(r.refused, ["[batch]", "[slurm] (but [[slurm.rule]])"]);
    }

    /// The NRI plugin starts (or not) with lodgerd: turning it on by a reload is refused by
    /// name, not logged as "nothing changed".
    #[test]
    fn kubernetes_changes_are_refused() {
        let running = parse("");
        let (next, r) = reload(&running, &parse("[kubernetes]\nnri = true\n"), true);
        assert!(!next.kubernetes.nri);
        assert!(r.applied.is_empty(), "{r:?}");
        assert_eq!(r.refused, ["[kubernetes]"]);
    }
}
