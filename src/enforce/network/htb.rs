//! The HTB tree lodger keeps on one interface (a [`Shaper`]): root qdisc, parent class, the
//! training and CPU-jobs classes and the filters steering CPU jobs' packets, read with
//! `tc ... show` and changed only where they differ. Touches the interface through a
//! [`TcRunner`].

use super::{argv, check_interface, show_argv, ClassId, Link, ShapingConfig, TcError, TcRunner};
use super::{
    CGROUP_FILTER_PREF, CPU_JOBS_MINOR, FW_FILTER_PREF, HTB_MAX_QUANTUM, MIN_QUANTUM, PARENT_MINOR,
    TC, TRAINING_MINOR,
};

/// How CPU jobs' packets reach their class on an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcFilter {
    /// No filter: nftables sets the packets' priority to the class (or nothing is classified).
    None,
    /// cgroup v1: the `cgroup` classifier reads the socket's `net_cls.classid`.
    Cgroup,
    /// The `fw` classifier maps this packet mark to the CPU jobs' class.
    Fw { mark: u32 },
}

/// What an interface's root qdisc is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootQdisc {
    /// lodger's HTB.
    Lodger,
    /// One the kernel attached by itself (handle `0:`: `noqueue`, `pfifo_fast`, `mq`,
    /// `fq_codel`, ...), replaced freely.
    KernelDefault { kind: String },
    /// One someone configured.
    Foreign { kind: String, handle: String },
}

/// One HTB class as `tc class show` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedClass {
    pub id: ClassId,
    /// `None`: attached at the root.
    pub parent: Option<ClassId>,
    pub rate_bits: u64,
    pub ceil_bits: u64,
}

/// One filter line of `tc filter show`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedFilter {
    pub pref: u32,
    pub kind: String,
    pub handle: Option<String>,
    pub classid: Option<ClassId>,
}

/// An HTB class lodger wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WantedClass {
    id: ClassId,
    parent: Option<ClassId>,
    rate_bits: u64,
    ceil_bits: u64,
}

/// The HTB tree on one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shaper {
    link: Link,
    training_percent: u32,
    cpu_jobs_percent: u32,
    cpu_jobs_ceil_percent: u32,
    handle: u16,
    replace_foreign_root: bool,
}

impl Shaper {
    pub fn new(link: Link, config: &ShapingConfig) -> Result<Self, TcError> {
        check_interface(&link.interface)?;
        Ok(Self {
            link,
            training_percent: config.training_percent,
            cpu_jobs_percent: config.cpu_jobs_percent,
            cpu_jobs_ceil_percent: config.cpu_jobs_ceil_percent,
            handle: config.handle,
            replace_foreign_root: config.replace_foreign_root,
        })
    }

    pub fn interface(&self) -> &str {
        &self.link.interface
    }

    fn class(&self, minor: u16) -> ClassId {
        ClassId {
            major: self.handle,
            minor,
        }
    }

    pub fn training_class(&self) -> ClassId {
        self.class(TRAINING_MINOR)
    }

    pub fn cpu_jobs_class(&self) -> ClassId {
        self.class(CPU_JOBS_MINOR)
    }

    fn qdisc_handle(&self) -> String {
        format!("{:x}:", self.handle)
    }

    fn wanted_classes(&self) -> [WantedClass; 3] {
        let line = self.link.line_rate_mbit.saturating_mul(1_000_000);
        let share = |p: u32| line / 100 * u64::from(p) + line % 100 * u64::from(p) / 100;
        let parent = self.class(PARENT_MINOR);
        [
            WantedClass {
                id: parent,
                parent: None,
                rate_bits: line,
                ceil_bits: line,
            },
            WantedClass {
                id: self.training_class(),
                parent: Some(parent),
                rate_bits: share(self.training_percent),
                ceil_bits: line,
            },
            WantedClass {
                id: self.cpu_jobs_class(),
                parent: Some(parent),
                rate_bits: share(self.cpu_jobs_percent),
                ceil_bits: share(self.cpu_jobs_ceil_percent),
            },
        ]
    }

    /// `tc` and `line` split at whitespace. Every word lodger puts in a line is validated to
    /// have none (interface names, handles, numbers).
    fn tc(&self, line: &str) -> Vec<String> {
        argv(TC, line)
    }

    /// `tc qdisc replace dev IF root handle H: htb default 10`
    fn root_argv(&self) -> Vec<String> {
        self.tc(&format!(
            "qdisc replace dev {} root handle {} htb default {TRAINING_MINOR:x}",
            self.interface(),
            self.qdisc_handle()
        ))
    }

    fn class_argv(&self, c: &WantedClass) -> Vec<String> {
        let parent = c
            .parent
            .map_or_else(|| self.qdisc_handle(), |p| p.to_string());
        // HTB derives the quantum from rate / r2q and warns when it falls outside what it
        // accepts: give it one in range, at least a full frame.
        let quantum = (c.rate_bits / 8 / 10).clamp(MIN_QUANTUM, HTB_MAX_QUANTUM);
        self.tc(&format!(
            "class replace dev {} parent {parent} classid {} htb rate {}bit ceil {}bit quantum {quantum}",
            self.interface(),
            c.id,
            c.rate_bits,
            c.ceil_bits
        ))
    }

    fn filter_argv(&self, filter: TcFilter) -> Option<Vec<String>> {
        let head = format!(
            "filter add dev {} parent {} protocol all",
            self.interface(),
            self.qdisc_handle()
        );
        match filter {
            TcFilter::None => None,
            TcFilter::Cgroup => Some(self.tc(&format!(
                "{head} prio {CGROUP_FILTER_PREF} handle 1: cgroup"
            ))),
            TcFilter::Fw { mark } => Some(self.tc(&format!(
                "{head} prio {FW_FILTER_PREF} handle {mark:#x} fw classid {}",
                self.cpu_jobs_class()
            ))),
        }
    }

    /// The commands that build the tree from nothing: what `apply` runs on a fresh interface,
    /// and what advise mode shows.
    pub fn build_argv(&self, filter: TcFilter) -> Vec<Vec<String>> {
        let mut all = vec![self.root_argv()];
        for c in self.wanted_classes() {
            all.push(self.class_argv(&c));
        }
        all.extend(self.filter_argv(filter));
        all
    }

    /// The interface's root qdisc.
    pub fn root(&self, runner: &mut dyn TcRunner) -> Result<RootQdisc, TcError> {
        let argv = self.tc(&format!("qdisc show dev {}", self.interface()));
        let out = runner.run(&argv)?;
        for line in out.lines() {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            if tokens.first() != Some(&"qdisc") || !tokens.contains(&"root") {
                continue;
            }
            let (Some(kind), Some(handle)) = (tokens.get(1), tokens.get(2)) else {
                return Err(TcError::Unparsed {
                    argv: show_argv(&argv),
                    line: line.to_string(),
                    reason: "no kind and handle".to_string(),
                });
            };
            let ours = ClassId::parse(handle).is_some_and(|h| h.major == self.handle);
            return Ok(if *kind == "htb" && ours {
                RootQdisc::Lodger
            } else if ClassId::parse(handle).is_some_and(|h| h.major == 0) {
                RootQdisc::KernelDefault {
                    kind: kind.to_string(),
                }
            } else {
                RootQdisc::Foreign {
                    kind: kind.to_string(),
                    handle: handle.to_string(),
                }
            });
        }
        // No root line: a device with no queue at all, as good as a default.
        Ok(RootQdisc::KernelDefault {
            kind: "none".to_string(),
        })
    }

    /// The HTB classes under lodger's qdisc.
    pub fn classes(&self, runner: &mut dyn TcRunner) -> Result<Vec<ObservedClass>, TcError> {
        let argv = self.tc(&format!("class show dev {}", self.interface()));
        let out = runner.run(&argv)?;
        let mut classes = Vec::new();
        for line in out.lines() {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            if tokens.first() != Some(&"class") || tokens.get(1) != Some(&"htb") {
                continue;
            }
            let bad = |reason: &str| TcError::Unparsed {
                argv: show_argv(&argv),
                line: line.to_string(),
                reason: reason.to_string(),
            };
            let id = tokens
                .get(2)
                .and_then(|t| ClassId::parse(t))
                .ok_or_else(|| bad("no class id"))?;
            if id.major != self.handle {
                continue;
            }
            let after = |key: &str| {
                tokens
                    .iter()
                    .position(|t| *t == key)
                    .and_then(|i| tokens.get(i + 1))
                    .copied()
            };
            let parent = match after("parent") {
                Some(p) => Some(ClassId::parse(p).ok_or_else(|| bad("bad parent"))?),
                None => None,
            };
            let rate = after("rate")
                .and_then(parse_rate)
                .ok_or_else(|| bad("no rate"))?;
            let ceil = after("ceil")
                .and_then(parse_rate)
                .ok_or_else(|| bad("no ceil"))?;
            classes.push(ObservedClass {
                id,
                parent,
                rate_bits: rate,
                ceil_bits: ceil,
            });
        }
        Ok(classes)
    }

    /// The filters attached to lodger's qdisc.
    pub fn filters(&self, runner: &mut dyn TcRunner) -> Result<Vec<ObservedFilter>, TcError> {
        let argv = self.tc(&format!(
            "filter show dev {} parent {}",
            self.interface(),
            self.qdisc_handle()
        ));
        let out = runner.run(&argv)?;
        let mut filters = Vec::new();
        for line in out.lines() {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            if tokens.first() != Some(&"filter") {
                continue;
            }
            let Some(i) = tokens.iter().position(|t| *t == "pref") else {
                continue;
            };
            let pref = tokens.get(i + 1).and_then(|p| p.parse().ok());
            let (Some(pref), Some(kind)) = (pref, tokens.get(i + 2)) else {
                return Err(TcError::Unparsed {
                    argv: show_argv(&argv),
                    line: line.to_string(),
                    reason: "no pref and kind".to_string(),
                });
            };
            let after = |key: &str| {
                tokens
                    .iter()
                    .position(|t| *t == key)
                    .and_then(|i| tokens.get(i + 1))
                    .copied()
            };
            filters.push(ObservedFilter {
                pref,
                kind: kind.to_string(),
                handle: after("handle").map(str::to_string),
                classid: after("classid").and_then(ClassId::parse),
            });
        }
        Ok(filters)
    }

    /// Makes the interface carry lodger's tree with `filter`; returns whether anything changed.
    pub fn apply(&self, runner: &mut dyn TcRunner, filter: TcFilter) -> Result<bool, TcError> {
        let fresh = match self.root(runner)? {
            RootQdisc::Lodger => false,
            RootQdisc::KernelDefault { .. } => true,
            RootQdisc::Foreign { kind, handle } => {
                if !self.replace_foreign_root {
                    return Err(TcError::ForeignRoot {
                        interface: self.interface().to_string(),
                        kind,
                        handle,
                    });
                }
                true
            }
        };
        if fresh {
            for argv in self.build_argv(filter) {
                run_filter_aware(runner, &argv, filter)?;
            }
            return Ok(true);
        }
        let mut changed = false;
        let observed = self.classes(runner)?;
        let wanted = self.wanted_classes();
        for w in &wanted {
            let same = observed.iter().any(|o| {
                o.id == w.id
                    && o.parent == w.parent
                    && close(o.rate_bits, w.rate_bits)
                    && close(o.ceil_bits, w.ceil_bits)
            });
            if !same {
                runner.run(&self.class_argv(w))?;
                changed = true;
            }
        }
        // Classes lodger did not make under its qdisc: children before root-level ones.
        let mut extra: Vec<&ObservedClass> = observed
            .iter()
            .filter(|o| !wanted.iter().any(|w| w.id == o.id))
            .collect();
        extra.sort_by_key(|o| o.parent.is_none());
        for o in extra {
            runner.run(&self.tc(&format!(
                "class del dev {} classid {}",
                self.interface(),
                o.id
            )))?;
            changed = true;
        }
        let filters = self.filters(runner)?;
        if !self.filters_match(&filters, filter) {
            let mut prefs: Vec<u32> = filters.iter().map(|f| f.pref).collect();
            prefs.sort_unstable();
            prefs.dedup();
            for pref in prefs {
                runner.run(&self.tc(&format!(
                    "filter del dev {} parent {} prio {pref}",
                    self.interface(),
                    self.qdisc_handle()
                )))?;
            }
            if let Some(argv) = self.filter_argv(filter) {
                run_filter_aware(runner, &argv, filter)?;
            }
            changed = true;
        }
        Ok(changed)
    }

    fn filters_match(&self, observed: &[ObservedFilter], filter: TcFilter) -> bool {
        match filter {
            TcFilter::None => observed.is_empty(),
            TcFilter::Cgroup => {
                !observed.is_empty()
                    && observed
                        .iter()
                        .all(|f| f.pref == CGROUP_FILTER_PREF && f.kind == "cgroup")
            }
            TcFilter::Fw { mark } => {
                let handle = format!("{mark:#x}");
                let class = self.cpu_jobs_class();
                observed
                    .iter()
                    .all(|f| f.pref == FW_FILTER_PREF && f.kind == "fw")
                    && observed.iter().any(|f| {
                        f.handle.as_deref() == Some(handle.as_str()) && f.classid == Some(class)
                    })
            }
        }
    }

    /// Removes lodger's tree (the kernel puts its default qdisc back). Leaves any other root
    /// qdisc alone; `Ok(false)` when there was nothing of lodger's.
    pub fn remove(&self, runner: &mut dyn TcRunner) -> Result<bool, TcError> {
        if self.root(runner)? != RootQdisc::Lodger {
            return Ok(false);
        }
        runner.run(&self.tc(&format!("qdisc del dev {} root", self.interface())))?;
        Ok(true)
    }
}

/// Runs a command, turning "no such classifier" into [`TcError::ClassifierMissing`].
fn run_filter_aware(
    runner: &mut dyn TcRunner,
    argv: &[String],
    filter: TcFilter,
) -> Result<String, TcError> {
    match runner.run(argv) {
        Err(TcError::Failed {
            argv: shown,
            stderr,
            ..
        }) if argv.get(1).map(String::as_str) == Some("filter") && classifier_missing(&stderr) => {
            Err(TcError::ClassifierMissing {
                argv: shown,
                kind: match filter {
                    TcFilter::Fw { .. } => "fw",
                    _ => "cgroup",
                },
                stderr,
            })
        }
        other => other,
    }
}

/// tc's words when the kernel lacks a classifier ("TC classifier not found", the kernel's
/// extack) or tc itself does ("Unknown filter").
fn classifier_missing(stderr: &str) -> bool {
    stderr.contains("classifier not found") || stderr.contains("Unknown filter")
}

/// Rates as tc prints them are truncated to three significant digits at most: equal within
/// 0.1% (and a byte).
pub(super) fn close(observed: u64, wanted: u64) -> bool {
    observed.abs_diff(wanted) <= (wanted / 1000).max(8)
}

/// `75Mbit`, `1600bit`, `2Gbit`, `10Kibit` → bits per second.
pub fn parse_rate(s: &str) -> Option<u64> {
    let number_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(number_end);
    let value: f64 = number.parse().ok()?;
    let unit = unit.strip_suffix("bit")?;
    let (prefix, iec) = match unit.strip_suffix('i') {
        Some(p) => (p, true),
        None => (unit, false),
    };
    let base: f64 = if iec { 1024.0 } else { 1000.0 };
    let exp = match prefix {
        "" => 0,
        "K" | "k" => 1,
        "M" => 2,
        "G" => 3,
        "T" => 4,
        _ => return None,
    };
    let bits = (value * base.powi(exp)).round();
    // A rate is far below 2^63: the conversion cannot wrap.
    (0.0..9.0e18).contains(&bits).then_some(bits as u64)
}
