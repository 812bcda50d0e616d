//! lodgerctl: the command line for lodgerd, over D-Bus (`org.lodger1`).

use std::collections::HashMap;
use std::process::ExitCode;

use clap::Parser;
use zbus::zvariant::{OwnedValue, Value};

use lodger::api::proxy::ManagerProxy;
use lodger::cli::lodgerctl::{
    Cli, Command, InferenceArgs, OwnerArgs, Register, TopArgs, UnregisterArgs,
};

/// A failure, with the exit code it maps to.
struct Failure {
    code: u8,
    message: String,
}

fn from_zbus(action: &str, e: zbus::Error) -> Failure {
    match e {
        zbus::Error::MethodError(name, msg, _) => {
            let short = name.as_str().rsplit('.').next().unwrap_or("").to_string();
            let text = msg.unwrap_or(short.clone());
            if name.as_str().starts_with("org.lodger1.Error.") {
                Failure {
                    code: 1,
                    message: format!("{action} failed: {text}"),
                }
            } else if name.as_str() == "org.freedesktop.DBus.Error.ServiceUnknown"
                || name.as_str() == "org.freedesktop.DBus.Error.NameHasNoOwner"
            {
                Failure {
                    code: 2,
                    message: "lodgerd is not running (org.lodger1 is not on the bus); start it with `systemctl start lodgerd`".into(),
                }
            } else if name.as_str() == "org.freedesktop.DBus.Error.AccessDenied" {
                Failure {
                    code: 1,
                    message: format!("{action} failed: the bus refused the call ({text}); run as root or as a member of the lodger group"),
                }
            } else {
                Failure {
                    code: 1,
                    message: format!("{action} failed: {text}"),
                }
            }
        }
        other => Failure {
            code: 2,
            message: format!("{action} failed: {other}"),
        },
    }
}

async fn connect(session: bool) -> Result<ManagerProxy<'static>, Failure> {
    let conn = if session {
        zbus::Connection::session().await
    } else {
        zbus::Connection::system().await
    }
    .map_err(|e| Failure {
        code: 2,
        message: format!(
            "cannot connect to the {} bus: {e}",
            if session { "session" } else { "system" }
        ),
    })?;
    ManagerProxy::new(&conn)
        .await
        .map_err(|e| from_zbus("connecting to lodgerd", e))
}

/// Renders an `a{sv}` value for people: strings bare, lists comma-separated.
fn show_value(v: &Value<'_>) -> String {
    match v {
        Value::F64(x) => format!("{x:.2}"),
        Value::Str(s) => s.to_string(),
        Value::Array(a) => a.iter().map(show_value).collect::<Vec<_>>().join(","),
        Value::Bool(b) => if *b { "yes" } else { "no" }.to_string(),
        Value::U32(n) => n.to_string(),
        Value::I32(n) => n.to_string(),
        Value::U64(n) => n.to_string(),
        Value::I64(n) => n.to_string(),
        Value::Value(inner) => show_value(inner),
        other => other.to_string(),
    }
}

fn to_json(v: &Value<'_>) -> serde_json::Value {
    match v {
        Value::F64(x) => serde_json::Number::from_f64(*x)
            .map(serde_json::Value::Number)
            .unwrap_or(serde_json::Value::Null),
        Value::Dict(d) => {
            serde_json::Value::Object(d.iter().map(|(k, v)| (show_value(k), to_json(v))).collect())
        }
        Value::Str(s) => serde_json::Value::from(s.as_str()),
        Value::Array(a) => serde_json::Value::Array(a.iter().map(to_json).collect()),
        Value::Bool(b) => serde_json::Value::from(*b),
        Value::U32(n) => serde_json::Value::from(*n),
        Value::I32(n) => serde_json::Value::from(*n),
        Value::U64(n) => serde_json::Value::from(*n),
        Value::I64(n) => serde_json::Value::from(*n),
        Value::Value(inner) => to_json(inner),
        other => serde_json::Value::from(other.to_string()),
    }
}

fn dict_to_json(d: &HashMap<String, OwnedValue>) -> serde_json::Value {
    serde_json::Value::Object(d.iter().map(|(k, v)| (k.clone(), to_json(v))).collect())
}

fn get(d: &HashMap<String, OwnedValue>, k: &str) -> String {
    match (k, d.get(k).map(|v| &**v)) {
        // A command reads as the shell line it is.
        ("command", Some(Value::Array(a))) => {
            a.iter().map(show_value).collect::<Vec<_>>().join(" ")
        }
        (_, v) => v.map(show_value).unwrap_or_default(),
    }
}

/// Prints the array of dictionaries under `key` of `d` as a table with these (header, field)
/// columns, after a blank line; nothing when the key is absent.
fn print_dict_table(d: &HashMap<String, OwnedValue>, key: &str, columns: &[(&str, &str)]) {
    let Some(Value::Array(items)) = d.get(key).map(|v| &**v) else {
        return;
    };
    let rows: Vec<Vec<String>> = items
        .iter()
        .filter_map(|item| match item {
            Value::Dict(dict) => Some(
                columns
                    .iter()
                    .map(|(_, field)| {
                        dict.iter()
                            .find(|(k, _)| show_value(k) == *field)
                            .map(|(_, v)| show_value(v))
                            .unwrap_or_else(|| "-".into())
                    })
                    .collect(),
            ),
            _ => None,
        })
        .collect();
    let header: Vec<&str> = columns.iter().map(|(h, _)| *h).collect();
    println!();
    print!("{}", render_table(&header, &rows));
}

/// Prints rows as aligned columns, like `kubectl get`.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    print!("{}", render_table(header, rows));
}

/// Rows as aligned columns, one line each, the header first.
fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        format!("{}\n", out.trim_end())
    };
    let mut text = line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        text.push_str(&line(row.clone()));
    }
    text
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let proxy = connect(cli.session).await?;
    match cli.command {
        Command::Register(Register::Online(a)) => {
            let mut spec = inference_spec("online", &a.common)?;
            spec.insert("slo_ms", Value::from(a.slo_ms));
            if let Some(rate) = a.rate {
                spec.insert("rate_per_s", Value::from(rate));
            }
            register_and_show(&proxy, spec, cli.json).await?;
        }
        Command::Register(Register::Offline(a)) => {
            let spec = inference_spec("offline", &a.common)?;
            register_and_show(&proxy, spec, cli.json).await?;
        }
        Command::Register(Register::Training(a)) => {
            let mut spec: HashMap<&str, Value<'_>> = HashMap::new();
            spec.insert("kind", Value::from("training"));
            if let Some(c) = &a.cgroup {
                spec.insert("cgroup", Value::from(c.as_str()));
            } else {
                spec.insert("pids", Value::from(a.pid.clone()));
            }
            spec.insert("gpus", Value::from(a.gpus.clone()));
            spec.insert("cores", Value::from(a.cores));
            if let Some(n) = &a.name {
                spec.insert("name", Value::from(n.as_str()));
            }
            if let Some(c) = &a.category {
                spec.insert("category", Value::from(c.as_str()));
            }
            spec.insert("pipeline", Value::from(a.pipeline));
            spec.insert("multi_node", Value::from(a.multi_node));
            spec.insert("rightsize", Value::from(!a.no_rightsize));
            if let Some(uid) = owner_uid(&a.owner)? {
                spec.insert("owner", Value::from(uid));
            }
            let (id, path) = proxy
                .register_job(spec)
                .await
                .map_err(|e| from_zbus("register", e))?;
            let job = proxy
                .get_job(&id)
                .await
                .map_err(|e| from_zbus("register", e))?;
            if cli.json {
                let mut v = dict_to_json(&job);
                if let serde_json::Value::Object(m) = &mut v {
                    m.insert("path".into(), path.as_str().into());
                }
                println!("{v}");
            } else {
                println!(
                    "registered {id}: cpus {} (NUMA {}), {} thread(s) {}",
                    get(&job, "cpus"),
                    get(&job, "mems"),
                    get(&job, "threads"),
                    get(&job, "sched_policy")
                );
            }
        }
        Command::Unregister(UnregisterArgs { id: Some(id), .. }) => {
            proxy
                .unregister_job(&id)
                .await
                .map_err(|e| from_zbus(&format!("unregister {id}"), e))?;
            if cli.json {
                println!("{}", serde_json::json!({ "unregistered": id }));
            } else {
                println!("unregistered {id}");
            }
        }
        Command::Unregister(UnregisterArgs { id: None, .. }) => {
            let jobs = proxy
                .list_jobs()
                .await
                .map_err(|e| from_zbus("unregister --all", e))?;
            let mut released = Vec::new();
            for (id, ..) in jobs {
                match proxy.unregister_job(&id).await {
                    Ok(()) => released.push(id),
                    // It ended between the two calls: nothing left to release.
                    Err(zbus::Error::MethodError(name, ..))
                        if name.as_str() == "org.lodger1.Error.NotFound" => {}
                    Err(e) => return Err(from_zbus(&format!("unregister {id}"), e)),
                }
            }
            if cli.json {
                println!("{}", serde_json::json!({ "unregistered": released }));
            } else if released.is_empty() {
                println!("No jobs registered.");
            } else {
                for id in released {
                    println!("unregistered {id}");
                }
            }
        }
        Command::List => {
            let jobs = proxy.list_jobs().await.map_err(|e| from_zbus("list", e))?;
            let mut details = Vec::new();
            for (id, ..) in &jobs {
                // A job can end between the two calls; skip it rather than fail the listing.
                if let Ok(d) = proxy.get_job(id).await {
                    details.push(d);
                }
            }
            if cli.json {
                let v: Vec<_> = details.iter().map(dict_to_json).collect();
                println!("{}", serde_json::Value::Array(v));
            } else if details.is_empty() {
                println!("No jobs registered.");
            } else {
                let rows: Vec<Vec<String>> = details
                    .iter()
                    .map(|d| {
                        vec![
                            get(d, "id"),
                            get(d, "name"),
                            get(d, "kind"),
                            get(d, "state"),
                            get(d, "cpus"),
                            get(d, "gpus"),
                            get(d, "pids"),
                            format!("{}/{}", get(d, "rr_threads"), get(d, "threads")),
                        ]
                    })
                    .collect();
                print_table(
                    &[
                        "ID",
                        "NAME",
                        "KIND",
                        "STATE",
                        "CPUS",
                        "GPUS",
                        "PIDS",
                        "RR/THREADS",
                    ],
                    &rows,
                );
            }
        }
        Command::Show { id } => {
            let d = proxy
                .get_job(&id)
                .await
                .map_err(|e| from_zbus(&format!("show {id}"), e))?;
            if cli.json {
                println!("{}", dict_to_json(&d));
            } else {
                let name = get(&d, "name");
                println!(
                    "● {id}{} - {} job",
                    if name.is_empty() {
                        String::new()
                    } else {
                        format!(" ({name})")
                    },
                    get(&d, "kind")
                );
                let mut keys = vec![
                    ("State", "state"),
                    ("CPUs", "cpus"),
                    ("NUMA nodes", "mems"),
                    ("GPUs", "gpus"),
                    ("Cores asked", "cores"),
                    ("Policy", "sched_policy"),
                    ("Processes", "pids"),
                    ("Threads", "threads"),
                    ("RR threads", "rr_threads"),
                ];
                if d.contains_key("cgroup") {
                    keys.push(("Cgroup", "cgroup"));
                } else {
                    keys.push(("Registered", "registered_pids"));
                }
                keys.extend([
                    ("Category", "category"),
                    ("Owner uid", "owner_uid"),
                    ("Last error", "last_error"),
                ]);
                if d.contains_key("command") {
                    keys.retain(|(_, k)| {
                        !matches!(
                            *k,
                            "gpus" | "cores" | "category" | "registered_pids" | "mems"
                        )
                    });
                    keys.extend([
                        ("Command", "command"),
                        ("SLO ms", "slo_ms"),
                        ("Rate /s", "rate_per_s"),
                        ("Max batch", "max_batch"),
                        ("Layout", "layout"),
                    ]);
                }
                for (label, key) in keys {
                    let v = get(&d, key);
                    if (key == "last_error" || key == "slo_ms" || key == "rate_per_s")
                        && v.is_empty()
                    {
                        continue;
                    }
                    println!("  {label:>12}: {v}");
                }
                if d.contains_key("rightsize") {
                    println!("  {:>12}: {}", "Right-sizing", get(&d, "rightsize"));
                }
                if d.contains_key("throttle") {
                    println!("  {:>12}: {}", "Throttled", get(&d, "throttle"));
                }
                if d.contains_key("network") {
                    println!("  {:>12}: {}", "Network", get(&d, "network"));
                }
                if d.contains_key("rt") {
                    println!("  {:>12}: {}", "RT limit", get(&d, "rt"));
                }
                print_dict_table(
                    &d,
                    "tuning",
                    &[
                        ("CORES", "cores"),
                        ("GPU %", "gpu_percent"),
                        ("NOISE", "noise"),
                        ("DECISION", "decision"),
                    ],
                );
                print_dict_table(
                    &d,
                    "instances",
                    &[
                        ("INSTANCE", "index"),
                        ("PID", "pid"),
                        ("STATE", "state"),
                        ("CPUS", "cpus"),
                        ("THREADS", "threads"),
                        ("BATCH", "batch"),
                        ("ITEMS/S", "items_per_s"),
                        ("P99 MS", "p99_ms"),
                        ("RESTARTS", "restarts"),
                    ],
                );
            }
        }
        Command::Top(args) => top(&proxy, cli.json, args).await?,
        Command::Status => {
            let s = proxy
                .get_status()
                .await
                .map_err(|e| from_zbus("status", e))?;
            if cli.json {
                println!("{}", dict_to_json(&s));
            } else {
                println!("● lodgerd {}", get(&s, "version"));
                for (label, key) in [
                    ("CPUs", "cpus"),
                    ("Reserved", "reserved"),
                    ("Training", "training_cpus"),
                    ("Free", "free"),
                    ("NUMA nodes", "numa_nodes"),
                    ("GPUs", "gpus"),
                    ("SMT", "smt"),
                    ("Jobs", "jobs"),
                    ("Enforcement", "enforcement"),
                    ("RT priority", "rt_priority"),
                    ("Interval ms", "interval_ms"),
                    ("Contention", "contention"),
                    ("Network", "network"),
                    ("Sample age", "sensing"),
                ] {
                    let v = get(&s, key);
                    println!("  {label:>12}: {}", if v.is_empty() { "-" } else { &v });
                }
            }
        }
    }
    Ok(())
}

/// `--user NAME`: the uid to register for (a name looked up on this node, or a number).
fn owner_uid(a: &OwnerArgs) -> Result<Option<u32>, Failure> {
    let Some(user) = &a.user else {
        return Ok(None);
    };
    if let Ok(uid) = user.parse::<u32>() {
        return Ok(Some(uid));
    }
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok(Some(u.uid.as_raw())),
        Ok(None) => Err(Failure {
            code: 2,
            message: format!("--user {user}: no such user on this node"),
        }),
        Err(e) => Err(Failure {
            code: 2,
            message: format!("--user {user}: cannot look the user up: {e}"),
        }),
    }
}

/// The common keys of an online or offline job's spec, with where and as whom its instances
/// start (the working directory is the current one unless --cwd says otherwise).
fn inference_spec<'a>(
    kind: &'a str,
    a: &'a InferenceArgs,
) -> Result<HashMap<&'a str, Value<'a>>, Failure> {
    let bad = |message: String| Failure { code: 2, message };
    let cwd = match &a.cwd {
        Some(dir) => std::path::absolute(dir),
        None => std::env::current_dir(),
    }
    .map_err(|e| bad(format!("cannot tell the working directory: {e}")))?;
    let cwd = cwd
        .to_str()
        .ok_or_else(|| bad(format!("{} is not UTF-8", cwd.display())))?
        .to_string();
    let mut spec: HashMap<&str, Value<'_>> = HashMap::new();
    spec.insert("cwd", Value::from(cwd));
    if !a.env.is_empty() {
        spec.insert("env", Value::from(a.env.clone()));
    }
    if let Some(out) = &a.output {
        let out = std::path::absolute(out)
            .map_err(|e| bad(format!("--output {}: {e}", out.display())))?;
        let out = out
            .to_str()
            .ok_or_else(|| bad(format!("{} is not UTF-8", out.display())))?
            .to_string();
        spec.insert("output", Value::from(out));
    }
    if let Some(uid) = owner_uid(&a.owner)? {
        spec.insert("owner", Value::from(uid));
    }
    spec.insert("kind", Value::from(kind));
    spec.insert("command", Value::from(a.command.clone()));
    spec.insert("max_batch", Value::from(a.max_batch));
    if let Some(n) = a.max_instances {
        spec.insert("max_instances", Value::from(n));
    }
    if let Some(n) = &a.name {
        spec.insert("name", Value::from(n.as_str()));
    }
    Ok(spec)
}

async fn register_and_show(
    proxy: &ManagerProxy<'_>,
    spec: HashMap<&str, Value<'_>>,
    json: bool,
) -> Result<(), Failure> {
    let (id, path) = proxy
        .register_job(spec)
        .await
        .map_err(|e| from_zbus("register", e))?;
    let job = proxy
        .get_job(&id)
        .await
        .map_err(|e| from_zbus("register", e))?;
    if json {
        let mut v = dict_to_json(&job);
        if let serde_json::Value::Object(m) = &mut v {
            m.insert("path".into(), path.as_str().into());
        }
        println!("{v}");
    } else {
        println!(
            "registered {id}: {} job, {} instance(s) on cpus {}; layout: {}",
            get(&job, "kind"),
            job.get("instances")
                .map(|v| match &**v {
                    Value::Array(a) => a.len(),
                    _ => 0,
                })
                .unwrap_or(0),
            get(&job, "cpus"),
            get(&job, "layout"),
        );
    }
    Ok(())
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "-".into())
}

fn fmt_bytes_per_s(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(b) if b >= 1e9 => format!("{:.1}G/s", b / 1e9),
        Some(b) if b >= 1e6 => format!("{:.1}M/s", b / 1e6),
        Some(b) if b >= 1e3 => format!("{:.1}k/s", b / 1e3),
        Some(b) => format!("{b:.0}B/s"),
    }
}

fn num(d: &HashMap<String, OwnedValue>, k: &str) -> Option<f64> {
    match d.get(k).map(|v| &**v) {
        Some(Value::F64(x)) => Some(*x),
        _ => None,
    }
}

/// One `top` screen (or JSON document).
async fn top_once(proxy: &ManagerProxy<'_>, json: bool) -> Result<String, Failure> {
    let (node, metrics, sources) = proxy
        .get_observations()
        .await
        .map_err(|e| from_zbus("top", e))?;
    let jobs = proxy.list_jobs().await.map_err(|e| from_zbus("top", e))?;
    let status = proxy.get_status().await.map_err(|e| from_zbus("top", e))?;
    let mut details = Vec::new();
    for (id, ..) in &jobs {
        if let Ok(d) = proxy.get_job(id).await {
            details.push(d);
        }
    }
    if json {
        let jobs: Vec<serde_json::Value> = details
            .iter()
            .map(|d| {
                let id = get(d, "id");
                let mut v = serde_json::json!({
                    "id": id,
                    "name": get(d, "name"),
                    "state": get(d, "state"),
                    "cpus": get(d, "cpus"),
                    "threads": d.get("threads").map(|v| to_json(v)),
                });
                if let serde_json::Value::Object(o) = &mut v {
                    if let Some(m) = metrics.get(&id) {
                        o.insert("metrics".into(), dict_to_json(m));
                    }
                    // Contention throttles and network shaping in force on the job.
                    for key in ["throttle", "network", "rt"] {
                        if d.contains_key(key) {
                            o.insert(key.into(), get(d, key).into());
                        }
                    }
                }
                v
            })
            .collect();
        let v = serde_json::json!({
            "node": dict_to_json(&node),
            "sources": sources,
            "contention": get(&status, "contention"),
            "network": get(&status, "network"),
            "sensing": get(&status, "sensing"),
            "jobs": jobs,
        });
        return Ok(v.to_string());
    }
    let mut out = String::new();
    let src = |k: &str| sources.get(k).cloned().unwrap_or_else(|| "-".into());
    out.push_str(&format!(
        "node: cpu {}%  pressure {}%  membw {}\n",
        fmt_opt(num(&node, "cpu_percent"), 1),
        fmt_opt(num(&node, "cpu_pressure_percent"), 1),
        fmt_bytes_per_s(num(&node, "membw_bytes_per_s")),
    ));
    for k in ["gpu", "perf", "membw"] {
        out.push_str(&format!("{k:>5}: {}\n", src(k)));
    }
    out.push_str(&format!("contention: {}\n", get(&status, "contention")));
    out.push_str(&format!("   network: {}\n", get(&status, "network")));
    out.push_str(&format!("sample age: {}\n", get(&status, "sensing")));
    out.push('\n');
    let header = [
        "ID", "NAME", "STATE", "CPUS", "CPU%", "IPC", "MISS%", "GPU%", "MEMBW", "NET",
    ];
    let rows: Vec<Vec<String>> = details
        .iter()
        .map(|d| {
            let id = get(d, "id");
            let empty = HashMap::new();
            let m = metrics.get(&id).unwrap_or(&empty);
            let gpu = match (
                num(m, "gpu_percent"),
                m.get("gpu_source").map(|v| show_value(v)),
            ) {
                (Some(g), Some(s)) if s == "emulated" => format!("{g:.1} (emulated)"),
                (g, _) => fmt_opt(g, 1),
            };
            vec![
                id,
                get(d, "name"),
                get(d, "state"),
                get(d, "cpus"),
                fmt_opt(num(m, "cpu_percent"), 1),
                fmt_opt(num(m, "ipc"), 2),
                fmt_opt(num(m, "cache_miss_percent"), 1),
                gpu,
                if m.contains_key("membw_unavailable") {
                    "n/a".to_string()
                } else {
                    fmt_bytes_per_s(num(m, "membw_bytes_per_s"))
                },
                // Received + sent in the job's own network namespace.
                match (num(m, "net_rx_bytes_per_s"), num(m, "net_tx_bytes_per_s")) {
                    (Some(rx), Some(tx)) => fmt_bytes_per_s(Some(rx + tx)),
                    _ => "-".to_string(),
                },
            ]
        })
        .collect();
    out.push_str(&render_table(&header, &rows));
    if rows.is_empty() {
        out.push_str("No jobs registered.\n");
    }
    // Throttles and network shaping in force, with their evidence.
    for d in &details {
        let id = get(d, "id");
        if d.contains_key("throttle") {
            out.push_str(&format!("{id}: throttled: {}\n", get(d, "throttle")));
        }
        if d.contains_key("network") {
            out.push_str(&format!("{id}: network: {}\n", get(d, "network")));
        }
        if d.contains_key("rt") {
            out.push_str(&format!("{id}: RT limit: {}\n", get(d, "rt")));
        }
    }
    // Why a job's bandwidth is not measured while the node's is (no free RMID).
    for d in &details {
        let id = get(d, "id");
        if let Some(why) = metrics.get(&id).map(|m| get(m, "membw_unavailable")) {
            if !why.is_empty() {
                out.push_str(&format!("{id}: memory bandwidth unavailable: {why}\n"));
            }
        }
    }
    Ok(out)
}

async fn top(proxy: &ManagerProxy<'_>, json: bool, args: TopArgs) -> Result<(), Failure> {
    use std::io::IsTerminal;
    if args.once || json {
        print!("{}", top_once(proxy, json).await?);
        if json {
            println!();
        }
        return Ok(());
    }
    let clear = std::io::stdout().is_terminal();
    loop {
        let screen = top_once(proxy, false).await?;
        if clear {
            // Home the cursor and clear the screen, like top(1).
            print!("\x1b[H\x1b[2J");
        }
        print!("{screen}");
        if !clear {
            println!();
        }
        tokio::time::sleep(std::time::Duration::from_secs_f64(args.refresh)).await;
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lodgerctl: cannot start: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("lodgerctl: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
