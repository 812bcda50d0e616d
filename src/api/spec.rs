//! Job specs and job views as plain D-Bus dictionaries (`a{sv}`), so `busctl` can build them.
//! The keys are documented in `docs/dbus-api.md`.

use std::collections::HashMap;

use zbus::zvariant::{OwnedValue, Value};

use crate::config::{TrainingConfig, TrainingPolicy};
use crate::job::{
    Category, InferenceSpec, Job, JobKind, JobSpec, Launch, SlurmJob, Target, DEFAULT_MAX_BATCH,
};
use crate::sense::{JobMetrics, NodeMetrics};

/// Keys accepted in a `RegisterJob` spec.
pub const SPEC_KEYS: &[&str] = &[
    "kind",
    "name",
    "pids",
    "cgroup",
    "gpus",
    "cores",
    "category",
    "pipeline",
    "multi_node",
    "rightsize",
    "command",
    "slo_ms",
    "rate_per_s",
    "max_batch",
    "max_instances",
    "owner",
    "cwd",
    "env",
    "output",
    "slurm_job",
    "slurm_node",
    "exclusive",
    "memory_max",
];

fn unsigned(key: &str, v: &Value<'_>) -> Result<u32, String> {
    let wide: i128 = match v {
        Value::U8(n) => (*n).into(),
        Value::U16(n) => (*n).into(),
        Value::U32(n) => (*n).into(),
        Value::U64(n) => (*n).into(),
        Value::I16(n) => (*n).into(),
        Value::I32(n) => (*n).into(),
        Value::I64(n) => (*n).into(),
        Value::Value(inner) => return unsigned(key, inner),
        other => {
            return Err(format!(
                "key '{key}' must be an unsigned integer (u), not '{}'",
                other.value_signature()
            ))
        }
    };
    u32::try_from(wide).map_err(|_| format!("key '{key}' is out of range ({wide})"))
}

/// A size in bytes: an unsigned integer (bytes) or a string such as `"512M"` or `"8G"`.
fn size(key: &str, v: &Value<'_>) -> Result<u64, String> {
    let bytes = match v {
        Value::Str(s) => {
            crate::job::memory::parse_size(s).map_err(|e| format!("key '{key}': {e}"))?
        }
        Value::U32(n) => u64::from(*n),
        Value::U64(n) => *n,
        Value::I32(n) => {
            u64::try_from(*n).map_err(|_| format!("key '{key}' must not be negative"))?
        }
        Value::I64(n) => {
            u64::try_from(*n).map_err(|_| format!("key '{key}' must not be negative"))?
        }
        Value::Value(inner) => return size(key, inner),
        other => {
            return Err(format!(
                "key '{key}' must be a size: bytes (t) or a string such as \"512M\" (s), not '{}'",
                other.value_signature()
            ))
        }
    };
    if bytes < MIN_MEMORY_MAX {
        return Err(format!(
            "key '{key}' is {bytes} bytes; a process needs at least 4M to run"
        ));
    }
    Ok(bytes)
}

/// The smallest memory limit accepted (an instance's or a batch job's): below it no interpreter
/// starts.
const MIN_MEMORY_MAX: u64 = 4 << 20;

fn string(key: &str, v: &Value<'_>) -> Result<String, String> {
    match v {
        Value::Str(s) => Ok(s.to_string()),
        Value::Value(inner) => string(key, inner),
        other => Err(format!(
            "key '{key}' must be a string (s), not '{}'",
            other.value_signature()
        )),
    }
}

fn boolean(key: &str, v: &Value<'_>) -> Result<bool, String> {
    match v {
        Value::Bool(b) => Ok(*b),
        Value::Value(inner) => boolean(key, inner),
        other => Err(format!(
            "key '{key}' must be a boolean (b), not '{}'",
            other.value_signature()
        )),
    }
}

fn float(key: &str, v: &Value<'_>) -> Result<f64, String> {
    match v {
        Value::F64(x) => Ok(*x),
        Value::Value(inner) => float(key, inner),
        other => unsigned(key, other).map(f64::from).map_err(|_| {
            format!(
                "key '{key}' must be a number (d), not '{}'",
                other.value_signature()
            )
        }),
    }
}

fn string_list(key: &str, v: &Value<'_>) -> Result<Vec<String>, String> {
    match v {
        Value::Array(items) => items.iter().map(|i| string(key, i)).collect(),
        Value::Value(inner) => string_list(key, inner),
        other => Err(format!(
            "key '{key}' must be an array of strings (as), not '{}'",
            other.value_signature()
        )),
    }
}

fn unsigned_list(key: &str, v: &Value<'_>) -> Result<Vec<u32>, String> {
    match v {
        Value::Array(items) => items.iter().map(|i| unsigned(key, i)).collect(),
        Value::Value(inner) => unsigned_list(key, inner),
        other => Err(format!(
            "key '{key}' must be an array of unsigned integers (au), not '{}'",
            other.value_signature()
        )),
    }
}

/// The `owner` key (u): the uid a job is registered for, when not the caller's. Only root may
/// set it to another uid (Slurm and NRI register on a user's behalf); the agent checks that.
pub fn owner_from_dict(dict: &HashMap<String, OwnedValue>) -> Result<Option<u32>, String> {
    dict.get("owner").map(|v| unsigned("owner", v)).transpose()
}

/// Builds a `JobSpec` from a D-Bus dictionary. Refuses unknown keys and wrong types with a message
/// naming the key; semantic checks are `JobSpec::validate`'s.
pub fn spec_from_dict(dict: &HashMap<String, OwnedValue>) -> Result<JobSpec, String> {
    if let Some(unknown) = dict.keys().find(|k| !SPEC_KEYS.contains(&k.as_str())) {
        return Err(format!(
            "unknown key '{unknown}' in the spec; known keys: {}",
            SPEC_KEYS.join(", ")
        ));
    }
    let get = |k: &str| dict.get(k).map(|v| &**v);
    let kind = match get("kind") {
        None => return Err("the spec needs a 'kind' (s), e.g. \"training\"".into()),
        Some(v) => {
            let s = string("kind", v)?;
            JobKind::parse(&s).ok_or_else(|| {
                format!("kind '{s}' is not one of training, online, offline, batch")
            })?
        }
    };
    if kind.is_inference() {
        return inference_spec_from_dict(kind, dict);
    }
    for key in [
        "command",
        "slo_ms",
        "rate_per_s",
        "max_batch",
        "max_instances",
        "cwd",
        "env",
        "output",
    ] {
        if dict.contains_key(key) {
            return Err(format!(
                "key '{key}' is for online and offline inference jobs, not {} jobs",
                kind.as_str()
            ));
        }
    }
    if kind != JobKind::Batch && dict.contains_key("memory_max") {
        return Err(format!(
            "key 'memory_max' is for inference and batch jobs, not {} jobs",
            kind.as_str()
        ));
    }
    let pids = get("pids").map(|v| unsigned_list("pids", v)).transpose()?;
    let cgroup = get("cgroup").map(|v| string("cgroup", v)).transpose()?;
    let slurm = get("slurm_job")
        .map(|v| unsigned("slurm_job", v))
        .transpose()?;
    let target = match (pids, cgroup, slurm) {
        (Some(p), None, None) => Target::Pids(p),
        (None, Some(c), None) => Target::Cgroup(crate::job::canonical_cgroup_path(&c)),
        // The owner's uid is filled in by the agent (it is the registration's owner).
        (None, None, Some(j)) => Target::Slurm(SlurmJob {
            job_id: u64::from(j),
            uid: 0,
            node: get("slurm_node")
                .map(|v| string("slurm_node", v))
                .transpose()?,
        }),
        (None, None, None) => {
            return Err(
                "the spec needs 'pids' (au), 'cgroup' (s) or 'slurm_job' (u) to say which \
                 processes are the job"
                    .into(),
            )
        }
        _ => return Err("give one of 'pids', 'cgroup' and 'slurm_job', not several".into()),
    };
    let cores = match get("cores") {
        Some(v) => unsigned("cores", v)?,
        // A batch job takes what is left; `cores` would cap it.
        None if kind == JobKind::Batch => 0,
        None => return Err("the spec needs 'cores' (u): how many CPUs the job asks for".into()),
    };
    let category = match get("category") {
        Some(v) => {
            let s = string("category", v)?;
            Category::parse(&s)
                .ok_or_else(|| format!("category '{s}' is not one of cv, nlp, speech, other"))?
        }
        None => Category::Other,
    };
    Ok(JobSpec {
        kind,
        name: get("name").map(|v| string("name", v)).transpose()?,
        target,
        gpus: get("gpus")
            .map(|v| unsigned_list("gpus", v))
            .transpose()?
            .unwrap_or_default(),
        cores,
        category,
        pipeline: get("pipeline")
            .map(|v| boolean("pipeline", v))
            .transpose()?
            .unwrap_or(false),
        multi_node: get("multi_node")
            .map(|v| boolean("multi_node", v))
            .transpose()?
            .unwrap_or(false),
        inference: None,
        rightsize: get("rightsize")
            .map(|v| boolean("rightsize", v))
            .transpose()?
            .unwrap_or(true),
        exclusive: get("exclusive")
            .map(|v| boolean("exclusive", v))
            .transpose()?
            .unwrap_or(false),
        memory_max: get("memory_max")
            .map(|v| size("memory_max", v))
            .transpose()?,
    })
}

/// The inference part of `spec_from_dict`: `command` (as), `slo_ms` (d, online), `rate_per_s`
/// (d), `max_batch` (u), `max_instances` (u), `name` (s).
fn inference_spec_from_dict(
    kind: JobKind,
    dict: &HashMap<String, OwnedValue>,
) -> Result<JobSpec, String> {
    let get = |k: &str| dict.get(k).map(|v| &**v);
    for key in [
        "pids",
        "cgroup",
        "slurm_job",
        "gpus",
        "cores",
        "category",
        "pipeline",
        "multi_node",
        "exclusive",
    ] {
        if dict.contains_key(key) {
            return Err(format!(
                "key '{key}' is for training jobs; {} jobs are started by lodger from 'command'",
                kind.as_str()
            ));
        }
    }
    let command = match get("command") {
        Some(v) => string_list("command", v)?,
        None => {
            return Err(format!(
                "a {} job needs 'command' (as): the argv of one instance",
                kind.as_str()
            ))
        }
    };
    Ok(JobSpec {
        kind,
        name: get("name").map(|v| string("name", v)).transpose()?,
        target: Target::Instances,
        gpus: Vec::new(),
        cores: 0,
        category: Category::Other,
        pipeline: false,
        multi_node: false,
        rightsize: false,
        exclusive: false,
        memory_max: None,
        inference: Some(InferenceSpec {
            command,
            slo_ms: get("slo_ms").map(|v| float("slo_ms", v)).transpose()?,
            rate_per_s: get("rate_per_s")
                .map(|v| float("rate_per_s", v))
                .transpose()?,
            max_batch: get("max_batch")
                .map(|v| unsigned("max_batch", v))
                .transpose()?
                .unwrap_or(DEFAULT_MAX_BATCH),
            max_instances: get("max_instances")
                .map(|v| unsigned("max_instances", v))
                .transpose()?,
            launch: Launch {
                cwd: get("cwd").map(|v| string("cwd", v)).transpose()?,
                env: get("env")
                    .map(|v| string_list("env", v))
                    .transpose()?
                    .unwrap_or_default(),
                output: get("output").map(|v| string("output", v)).transpose()?,
            },
            memory_max: get("memory_max")
                .map(|v| size("memory_max", v))
                .transpose()?,
        }),
    })
}

/// The scheduling policies lodger keeps jobs' threads in, as shown to people (`sched_policy`):
/// one for training jobs, one for offline instances, one for the other lodgers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedLabels {
    pub training: String,
    pub offline: String,
    pub lodger: String,
    pub batch: String,
}

impl SchedLabels {
    /// From `[training]`: SCHED_RR at `rt_priority` (and one above it for threads that mostly
    /// wait, with `role_priorities`), or SCHED_OTHER at `other_nice`; offline instances
    /// SCHED_IDLE when `lodgers_sched_idle` or `policy = "other"`.
    pub fn new(t: &TrainingConfig) -> Self {
        let training = match (t.policy, t.role_priorities) {
            (TrainingPolicy::Rr, false) => format!("SCHED_RR/{}", t.rt_priority),
            (TrainingPolicy::Rr, true) => {
                format!(
                    "SCHED_RR/{}-{}",
                    t.rt_priority,
                    t.rt_priority.saturating_add(1)
                )
            }
            (TrainingPolicy::Other, _) => format!("SCHED_OTHER/nice {}", t.other_nice),
        };
        let idle = t.lodgers_sched_idle || t.policy == TrainingPolicy::Other;
        Self {
            training,
            offline: if idle { "SCHED_IDLE" } else { "SCHED_OTHER" }.to_string(),
            lodger: "SCHED_OTHER".to_string(),
            batch: "SCHED_OTHER".to_string(),
        }
    }

    /// With `[batch]`'s class for batch jobs.
    pub fn with_batch(mut self, b: &crate::config::BatchConfig) -> Self {
        self.batch = match b.policy {
            crate::config::BatchPolicy::Other => "SCHED_OTHER",
            crate::config::BatchPolicy::Batch => "SCHED_BATCH",
        }
        .to_string();
        self
    }

    /// The label of a job of `kind`.
    pub fn of(&self, kind: JobKind) -> &str {
        match kind {
            JobKind::Offline => &self.offline,
            JobKind::Batch => &self.batch,
            k if k.is_lodger() => &self.lodger,
            _ => &self.training,
        }
    }
}

impl Default for SchedLabels {
    fn default() -> Self {
        Self::new(&TrainingConfig::default())
    }
}

/// A job as a D-Bus dictionary (`GetJob`).
pub fn job_to_dict(job: &Job, sched: &SchedLabels) -> HashMap<String, Value<'static>> {
    let mut d: HashMap<String, Value<'static>> = HashMap::new();
    let mut put = |k: &str, v: Value<'static>| {
        d.insert(k.to_string(), v);
    };
    put("id", Value::from(job.id.to_string()));
    put("name", Value::from(job.spec.label().unwrap_or_default()));
    put("kind", Value::from(job.spec.kind.as_str().to_string()));
    put("state", Value::from(job.state.as_str().to_string()));
    match &job.spec.target {
        Target::Pids(p) => put("registered_pids", Value::from(p.clone())),
        Target::Cgroup(c) => put("cgroup", Value::from(c.clone())),
        Target::Slurm(j) => put("slurm_job", Value::from(j.job_id)),
        Target::Container(c) => {
            put("container", Value::from(c.id.clone()));
            put("pod", Value::from(c.label()));
            put("cgroup", Value::from(c.cgroup.clone()));
        }
        Target::Instances => {}
    }
    put("pids", Value::from(job.pids.clone()));
    put("cpus", Value::from(job.cpus.to_string()));
    put("mems", Value::from(job.mems.to_string()));
    put("gpus", Value::from(job.spec.gpus.clone()));
    put("cores", Value::from(job.spec.cores));
    put(
        "category",
        Value::from(job.spec.category.as_str().to_string()),
    );
    put("pipeline", Value::from(job.spec.pipeline));
    put("multi_node", Value::from(job.spec.multi_node));
    put("exclusive", Value::from(job.spec.exclusive));
    if let Some(max) = job
        .spec
        .inference
        .as_ref()
        .and_then(|i| i.memory_max)
        .or(job.spec.memory_max)
    {
        put("memory_max", Value::from(max));
    }
    // Lent CPU time (issue 19), CPU-seconds.
    if job.spec.kind.role() == crate::job::Role::Training {
        put("lent_cpu_s", Value::from(job.account.lent_s));
        put("idle_cpu_s", Value::from(job.account.idle_s));
        if let Some(share) = job.account.lent_share() {
            put("lent_share", Value::from(share));
        }
    } else if job.spec.kind.is_inference() {
        put("lodged_cpu_s", Value::from(job.account.used_s));
        put(
            "lodged_on_training_cpu_s",
            Value::from(job.account.on_training_s),
        );
    }
    put("threads", Value::from(job.threads));
    put("rr_threads", Value::from(job.rr_threads));
    put(
        "sched_policy",
        Value::from(sched.of(job.spec.kind).to_string()),
    );
    put(
        "last_error",
        Value::from(job.last_error.clone().unwrap_or_default()),
    );
    put("owner_uid", Value::from(job.owner_uid));
    put("registered_at", Value::from(job.registered_at));
    put("rightsize_enabled", Value::from(job.spec.rightsize));
    if let Some(t) = &job.throttle {
        put("throttle", Value::from(t.clone()));
    }
    if let Some(n) = &job.network {
        put("network", Value::from(n.clone()));
    }
    if let Some(rt) = &job.rt {
        put("rt", Value::from(rt.describe()));
        put("rt_share_percent", Value::from(rt.share_percent));
        put("runq_wait_ms_per_s", Value::from(rt.runq_wait_ms_per_s));
        put("rt_extra_cores", Value::from(rt.extra_cores));
    }
    if let Some(r) = &job.rightsize {
        put("rightsize", Value::from(r.clone()));
    }
    if !job.tuning.is_empty() {
        let probes: Vec<HashMap<String, Value<'static>>> = job
            .tuning
            .iter()
            .map(|p| {
                let mut m: HashMap<String, Value<'static>> = HashMap::new();
                m.insert("cores".into(), Value::from(p.cores));
                m.insert("gpu_percent".into(), Value::from(p.gpu_percent));
                m.insert("noise".into(), Value::from(p.noise));
                m.insert("decision".into(), Value::from(p.decision.clone()));
                m
            })
            .collect();
        put("tuning", Value::from(probes));
    }
    if let Some(inf) = &job.spec.inference {
        put("command", Value::from(inf.command.clone()));
        if let Some(slo) = inf.slo_ms {
            put("slo_ms", Value::from(slo));
        }
        if let Some(rate) = inf.rate_per_s {
            put("rate_per_s", Value::from(rate));
        }
        put("max_batch", Value::from(inf.max_batch));
        put(
            "layout",
            Value::from(job.layout.clone().unwrap_or_default()),
        );
        if let Some(budget) = job.core_budget {
            put("core_budget", Value::from(budget));
        }
        // The job's requests, every instance's batches pooled (what the SLO is judged by).
        if let Some(l) = job.latency_ms {
            put("latency_p50_ms", Value::from(l.p50));
            put("latency_p99_ms", Value::from(l.p99));
        }
        let instances: Vec<HashMap<String, Value<'static>>> = job
            .instances
            .iter()
            .map(|i| {
                let mut m: HashMap<String, Value<'static>> = HashMap::new();
                m.insert("index".into(), Value::from(i.index));
                m.insert("pid".into(), Value::from(i.pid.unwrap_or(0)));
                m.insert("cpus".into(), Value::from(i.cpus.to_string()));
                m.insert("threads".into(), Value::from(i.threads));
                m.insert("batch".into(), Value::from(i.batch));
                m.insert("state".into(), Value::from(i.state.clone()));
                m.insert("restarts".into(), Value::from(i.restarts));
                m.insert("oom_kills".into(), Value::from(i.oom_kills));
                if let Some(max) = i.memory_max {
                    m.insert("memory_max".into(), Value::from(max));
                }
                m.insert("items_per_s".into(), Value::from(i.items_per_s));
                if let Some(p) = i.p50_ms {
                    m.insert("p50_ms".into(), Value::from(p));
                }
                if let Some(p) = i.p99_ms {
                    m.insert("p99_ms".into(), Value::from(p));
                }
                m
            })
            .collect();
        put("instances", Value::from(instances));
        // Issue 19: the instances' memory limit (one per job) and how often it killed one.
        if let Some(limit) = job.instances.iter().find_map(|i| i.memory_max) {
            put("memory_limit", Value::from(limit));
        }
        let kills: u32 = job.instances.iter().map(|i| i.oom_kills).sum();
        put("oom_kills", Value::from(kills));
    }
    d
}

/// A job's measurements as a D-Bus dictionary: a key is present only when measured.
pub fn job_metrics_to_dict(m: &JobMetrics) -> HashMap<String, Value<'static>> {
    let mut d: HashMap<String, Value<'static>> = HashMap::new();
    let mut put = |k: &str, v: Option<f64>| {
        if let Some(v) = v.filter(|v| v.is_finite()) {
            d.insert(k.to_string(), Value::from(v));
        }
    };
    put("cpu_percent", m.cpu_percent);
    put("memory_pressure_percent", m.memory_pressure_percent);
    put("ipc", m.ipc);
    put("cache_miss_percent", m.cache_miss_percent);
    put("gpu_percent", m.gpu_percent);
    put("membw_bytes_per_s", m.membw_bytes_per_s);
    put("net_rx_bytes_per_s", m.net_rx_bytes_per_s);
    put("net_tx_bytes_per_s", m.net_tx_bytes_per_s);
    if let Some(src) = &m.gpu_source {
        d.insert("gpu_source".into(), Value::from(src.clone()));
    }
    let domains: HashMap<u32, f64> = m
        .membw_domains
        .iter()
        .filter(|(_, v)| v.is_finite())
        .map(|(k, v)| (*k, *v))
        .collect();
    if !domains.is_empty() {
        d.insert("membw_domains".into(), Value::from(domains));
    }
    if let Some(why) = &m.membw_unavailable {
        d.insert("membw_unavailable".into(), Value::from(why.clone()));
    }
    if let Some(why) = &m.net_unavailable {
        d.insert("net_unavailable".into(), Value::from(why.to_string()));
    }
    d
}

/// The node's measurements as a D-Bus dictionary: scalars when measured, GPUs and interfaces
/// as `a{sv}` per index or name.
pub fn node_metrics_to_dict(n: &NodeMetrics) -> HashMap<String, Value<'static>> {
    let mut d: HashMap<String, Value<'static>> = HashMap::new();
    let mut put = |k: &str, v: Option<f64>| {
        if let Some(v) = v.filter(|v| v.is_finite()) {
            d.insert(k.to_string(), Value::from(v));
        }
    };
    put("cpu_percent", n.cpu_percent);
    put("cpu_pressure_percent", n.cpu_pressure_percent);
    put("memory_pressure_percent", n.memory_pressure_percent);
    put("membw_bytes_per_s", n.membw_bytes_per_s);
    put("membw_fraction_of_peak", n.membw_fraction_of_peak);
    let per_cpu: HashMap<u32, f64> = n.per_cpu_percent.iter().map(|(k, v)| (*k, *v)).collect();
    d.insert("per_cpu_percent".into(), Value::from(per_cpu));
    let gpus: Vec<HashMap<String, Value<'static>>> = n
        .gpus
        .iter()
        .map(|g| {
            let mut m: HashMap<String, Value<'static>> = HashMap::new();
            m.insert("index".into(), Value::from(g.index));
            m.insert("source".into(), Value::from(g.source.clone()));
            let mut f = |k: &str, v: Option<f64>| {
                if let Some(v) = v.filter(|v| v.is_finite()) {
                    m.insert(k.to_string(), Value::from(v));
                }
            };
            f("util_percent", g.util_percent);
            f("mem_util_percent", g.mem_util_percent);
            f("power_watts", g.power_watts);
            f("pcie_tx_bytes_per_s", g.pcie_tx_bytes_per_s);
            f("pcie_rx_bytes_per_s", g.pcie_rx_bytes_per_s);
            f("sm_clock_mhz", g.sm_clock_mhz.map(f64::from));
            f("mem_used_bytes", g.mem_used_bytes.map(|b| b as f64));
            f("mem_total_bytes", g.mem_total_bytes.map(|b| b as f64));
            m
        })
        .collect();
    d.insert("gpus".into(), Value::from(gpus));
    let net: Vec<HashMap<String, Value<'static>>> = n
        .net
        .iter()
        .map(|i| {
            let mut m: HashMap<String, Value<'static>> = HashMap::new();
            m.insert("interface".into(), Value::from(i.interface.clone()));
            m.insert("rx_bytes_per_s".into(), Value::from(i.rx_bytes_per_s));
            m.insert("tx_bytes_per_s".into(), Value::from(i.tx_bytes_per_s));
            if let Some(s) = i.speed_mbps {
                m.insert("speed_mbps".into(), Value::from(s));
            }
            m
        })
        .collect();
    d.insert("net".into(), Value::from(net));
    d
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;
