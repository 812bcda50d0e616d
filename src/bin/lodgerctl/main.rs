//! lodgerctl: the command line for lodgerd, over D-Bus (`org.lodger1`).

use std::collections::HashMap;
use std::ffi::OsString;
use std::process::ExitCode;

use clap::Parser;
use zbus::zvariant::{OwnedValue, Value};

use lodger::api::proxy::ManagerProxy;
use lodger::cli::lodgerctl::{Cli, Command, InferenceArgs, OwnerArgs, Register, UnregisterArgs};

/// A failure, with the exit code it maps to.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    /// Writing to stdout failed. Its reader going away is no failure of lodgerctl's
    /// (`lodgerctl top | head -n 5`): status 0, nothing said.
    fn stdout(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Failure {
                code: 0,
                message: String::new(),
            };
        }
        Failure {
            code: 2,
            message: format!("cannot write to stdout: {e}"),
        }
    }
}

/// `print!`, but a failed write returns [`Failure::stdout`] from the enclosing function instead
/// of panicking as `print!` does when stdout's reader has gone.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout(), $($arg)*).map_err(crate::Failure::stdout)?
    }};
}

/// `println!` as [`out!`] is `print!`.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($arg)*).map_err(crate::Failure::stdout)?
    }};
}

mod release;
mod render;
mod slurm;
mod top;

use render::{dict_to_json, get, render_table, show_value};

fn from_zbus(action: &str, e: zbus::Error) -> Failure {
    match e {
        zbus::Error::MethodError(name, msg, _) => {
            let short = name.as_str().rsplit('.').next().unwrap_or("").to_string();
            // lodgerd's message may name what a caller chose (a path, a command): shown safe.
            let text = render::printable(&msg.unwrap_or(short.clone()));
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

/// Prints the array of dictionaries under `key` of `d` as a table with these (header, field)
/// columns, after a blank line; nothing when the key is absent.
fn print_dict_table(
    d: &HashMap<String, OwnedValue>,
    key: &str,
    columns: &[(&str, &str)],
) -> Result<(), Failure> {
    let Some(Value::Array(items)) = d.get(key).map(|v| &**v) else {
        return Ok(());
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
    outln!();
    out!("{}", render_table(&header, &rows));
    Ok(())
}

/// Prints rows as aligned columns, like `kubectl get`.
fn print_table(header: &[&str], rows: &[Vec<String>]) -> Result<(), Failure> {
    out!("{}", render_table(header, rows));
    Ok(())
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
            register_and_show(&proxy, spec, cli.json, inference_summary).await?;
        }
        Command::Register(Register::Offline(a)) => {
            let spec = inference_spec("offline", &a.common)?;
            register_and_show(&proxy, spec, cli.json, inference_summary).await?;
        }
        Command::Register(Register::Batch(a)) => {
            let mut spec: HashMap<&str, Value<'_>> = HashMap::new();
            spec.insert("kind", Value::from("batch"));
            if let Some(c) = &a.cgroup {
                spec.insert("cgroup", Value::from(c.as_str()));
            } else {
                spec.insert("pids", Value::from(a.pid.clone()));
            }
            if let Some(n) = a.cores {
                spec.insert("cores", Value::from(n));
            }
            if let Some(bytes) = a.memory_max {
                spec.insert("memory_max", Value::from(bytes));
            }
            if let Some(n) = &a.name {
                spec.insert("name", Value::from(n.as_str()));
            }
            if let Some(uid) = owner_uid(&a.owner)? {
                spec.insert("owner", Value::from(uid));
            }
            register_and_show(&proxy, spec, cli.json, training_summary).await?;
        }
        // Handled in `slurm::main`, never here: they must exit 0 whatever happens.
        Command::Slurm(_) => {}
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
            if a.exclusive {
                spec.insert("exclusive", Value::from(true));
            }
            if let Some(uid) = owner_uid(&a.owner)? {
                spec.insert("owner", Value::from(uid));
            }
            register_and_show(&proxy, spec, cli.json, training_summary).await?;
        }
        Command::Unregister(UnregisterArgs { id: Some(id), .. }) => {
            proxy
                .unregister_job(&id)
                .await
                .map_err(|e| from_zbus(&format!("unregister {id}"), e))?;
            if cli.json {
                outln!("{}", serde_json::json!({ "unregistered": id }));
            } else {
                outln!("unregistered {id}");
            }
        }
        Command::Unregister(UnregisterArgs { id: None, .. }) => {
            let caller = nix::unistd::geteuid().as_raw();
            let mut done = release::unregister_all(&proxy, "unregister --all", caller).await;
            // What was done is said, also when something failed; nothing when only that.
            let nothing = done.released.is_empty() && done.skipped.is_empty();
            if !nothing || done.failed.is_empty() {
                if cli.json {
                    outln!("{}", done.to_json());
                } else if nothing {
                    outln!("No jobs registered.");
                } else {
                    for id in &done.released {
                        outln!("unregistered {id}");
                    }
                    for (id, why) in &done.skipped {
                        outln!("skipped {id}: {why}");
                    }
                }
            }
            done.result()?;
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
                outln!("{}", serde_json::Value::Array(v));
            } else if details.is_empty() {
                outln!("No jobs registered.");
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
                            render::in_class(d),
                        ]
                    })
                    .collect();
                print_table(
                    &[
                        "ID", "NAME", "KIND", "STATE", "CPUS", "GPUS", "PIDS", "IN CLASS",
                    ],
                    &rows,
                )?;
            }
        }
        Command::Show { id } => {
            let d = proxy
                .get_job(&id)
                .await
                .map_err(|e| from_zbus(&format!("show {id}"), e))?;
            if cli.json {
                outln!("{}", dict_to_json(&d));
            } else {
                let name = get(&d, "name");
                outln!(
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
                    (render::class_label(&d), "rr_threads"),
                ];
                if d.contains_key("pod") {
                    // Registered by the runtime through NRI (docs/kubernetes.md).
                    keys.extend([
                        ("Pod", "pod"),
                        ("Container", "container"),
                        ("Cgroup", "cgroup"),
                    ]);
                } else if d.contains_key("cgroup") {
                    keys.push(("Cgroup", "cgroup"));
                } else if d.contains_key("slurm_job") {
                    keys.push(("Slurm job", "slurm_job"));
                } else {
                    keys.push(("Registered", "registered_pids"));
                }
                keys.extend([
                    ("Category", "category"),
                    ("Owner uid", "owner_uid"),
                    ("Last error", "last_error"),
                ]);
                if get(&d, "kind") == "batch" {
                    // No GPU, no category; at most its cores.
                    keys.retain(|(_, k)| !matches!(*k, "gpus" | "category"));
                    for (label, key) in &mut keys {
                        if *key == "cores" {
                            *label = "Most cores";
                        }
                    }
                }
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
                        ("p99 ms", "latency_p99_ms"),
                        ("Rate /s", "rate_per_s"),
                        ("Max batch", "max_batch"),
                        ("Budget", "core_budget"),
                        ("Layout", "layout"),
                    ]);
                }
                for (label, key) in keys {
                    let v = render::shown_field(&d, key);
                    if matches!(
                        key,
                        "last_error" | "slo_ms" | "rate_per_s" | "latency_p99_ms" | "core_budget"
                    ) && v.is_empty()
                    {
                        continue;
                    }
                    outln!("  {label:>12}: {v}");
                }
                if get(&d, "exclusive") == "yes" {
                    outln!(
                        "  {:>12}: yes (its cores are lent to no lodger)",
                        "Exclusive"
                    );
                }
                if d.contains_key("lent_cpu_s") {
                    let share = d
                        .get("lent_share")
                        .and_then(|v| f64::try_from(&**v).ok())
                        .map(|s| format!(" ({:.0}% of its cores' idle time)", s * 100.0))
                        .unwrap_or_default();
                    outln!(
                        "  {:>12}: {} CPU-s to lodgers{share}",
                        "Lent",
                        get(&d, "lent_cpu_s")
                    );
                }
                if d.contains_key("lodged_cpu_s") {
                    outln!(
                        "  {:>12}: {} CPU-s, {} on training cores",
                        "CPU used",
                        get(&d, "lodged_cpu_s"),
                        get(&d, "lodged_on_training_cpu_s")
                    );
                }
                if d.contains_key("oom_kills") {
                    let limit = d
                        .get("memory_limit")
                        .and_then(|v| u64::try_from(&**v).ok())
                        .map_or("no limit".to_string(), |b| {
                            format!("{} per instance", lodger::job::memory::show_size(b))
                        });
                    outln!(
                        "  {:>12}: {limit}, {} OOM kill(s)",
                        "Memory",
                        get(&d, "oom_kills")
                    );
                } else if let Some(b) = d.get("memory_max").and_then(|v| u64::try_from(&**v).ok()) {
                    // A batch job's own limit (otherwise the node's batch.memory_max).
                    outln!(
                        "  {:>12}: {} limit, the job's own",
                        "Memory",
                        lodger::job::memory::show_size(b)
                    );
                }
                if d.contains_key("rightsize") {
                    outln!("  {:>12}: {}", "Right-sizing", get(&d, "rightsize"));
                }
                if d.contains_key("throttle") {
                    outln!("  {:>12}: {}", "Throttled", get(&d, "throttle"));
                }
                if d.contains_key("network") {
                    outln!("  {:>12}: {}", "Network", get(&d, "network"));
                }
                if d.contains_key("rt") {
                    outln!("  {:>12}: {}", "RT limit", get(&d, "rt"));
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
                )?;
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
                        ("OOM KILLS", "oom_kills"),
                    ],
                )?;
            }
        }
        Command::Top(args) => top::top(&proxy, cli.json, args).await?,
        Command::Drain(args) => {
            let caller = nix::unistd::geteuid().as_raw();
            if caller != 0 {
                // Drain waits for the node to hold no job: only root may release them all.
                return Err(Failure {
                    code: 1,
                    message: "drain releases every job on the node: run it as root \
                              (`lodgerctl unregister --all` releases your own jobs)"
                        .into(),
                });
            }
            let mut done = release::unregister_all(&proxy, "drain", caller).await;
            done.result()?;
            if !done.skipped.is_empty() {
                // A job lodgerd refused to release would keep the node from emptying: say so
                // now rather than wait out the timeout.
                let refused: Vec<String> = done
                    .skipped
                    .iter()
                    .map(|(id, why)| format!("{id}: {why}"))
                    .collect();
                return Err(Failure {
                    code: 1,
                    message: format!("drain: lodgerd refused to release {}", refused.join("; ")),
                });
            }
            let released = done.released;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.timeout);
            let left = loop {
                let s = proxy
                    .get_status()
                    .await
                    .map_err(|e| from_zbus("drain", e))?;
                let left = (get(&s, "jobs"), get(&s, "instances"));
                if left == ("0".to_string(), "0".to_string())
                    || std::time::Instant::now() >= deadline
                {
                    break left;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            };
            if left != ("0".to_string(), "0".to_string()) {
                return Err(Failure {
                    code: 1,
                    message: format!(
                        "drain: after {} s, {} job(s) and {} instance(s) are left; see \
                         `lodgerctl list` and lodgerd's log",
                        args.timeout, left.0, left.1
                    ),
                });
            }
            if cli.json {
                outln!(
                    "{}",
                    serde_json::json!({ "unregistered": released, "drained": true })
                );
            } else {
                outln!(
                    "drained: {} job(s) released, no instance running",
                    released.len()
                );
            }
        }
        Command::Status => {
            let s = proxy
                .get_status()
                .await
                .map_err(|e| from_zbus("status", e))?;
            if cli.json {
                outln!("{}", dict_to_json(&s));
            } else {
                outln!("● lodgerd {}", get(&s, "version"));
                for (label, key) in [
                    ("CPUs", "cpus"),
                    ("Reserved", "reserved"),
                    ("Training", "training_cpus"),
                    ("Free", "free"),
                    ("NUMA nodes", "numa_nodes"),
                    ("GPUs", "gpus"),
                    ("SMT", "smt"),
                    ("Jobs", "jobs"),
                    ("Instances", "instances"),
                    ("Enforcement", "enforcement"),
                    ("RT priority", "rt_priority"),
                    ("Interval ms", "interval_ms"),
                    ("Contention", "contention"),
                    ("Network", "network"),
                    ("Sample age", "sensing"),
                ] {
                    let v = get(&s, key);
                    outln!("  {label:>12}: {}", if v.is_empty() { "-" } else { &v });
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
    if let Some(bytes) = a.memory_max {
        spec.insert("memory_max", Value::from(bytes));
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
    summary: fn(&str, &HashMap<String, OwnedValue>) -> String,
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
        outln!("{v}");
    } else {
        outln!("{}", summary(&id, &job));
    }
    Ok(())
}

/// `register training`'s line.
fn training_summary(id: &str, job: &HashMap<String, OwnedValue>) -> String {
    format!(
        "registered {id}: cpus {} (NUMA {}), {} thread(s) {}",
        get(job, "cpus"),
        get(job, "mems"),
        get(job, "threads"),
        get(job, "sched_policy")
    )
}

/// `register online|offline`'s line.
fn inference_summary(id: &str, job: &HashMap<String, OwnedValue>) -> String {
    format!(
        "registered {id}: {} job, {} instance(s) on cpus {}; layout: {}",
        get(job, "kind"),
        job.get("instances")
            .map(|v| match &**v {
                Value::Array(a) => a.len(),
                _ => 0,
            })
            .unwrap_or(0),
        get(job, "cpus"),
        get(job, "layout"),
    )
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if slurm::invoked(&args) {
        slurm::main(args);
        // Never a failure: a failing prolog or epilog drains the node (docs/slurm.md).
        return ExitCode::SUCCESS;
    }
    let cli = Cli::parse_from(args);
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
        // stdout's reader went away (see Failure::stdout).
        Err(f) if f.code == 0 => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("lodgerctl: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
