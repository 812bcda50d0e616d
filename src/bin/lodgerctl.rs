//! lodgerctl: the command line for lodgerd, over D-Bus (`org.lodger1`).

use std::collections::HashMap;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use zbus::zvariant::{OwnedValue, Value};

use lodger::api::proxy::ManagerProxy;

const AFTER_HELP: &str = "\
Exit status:
  0  the request succeeded
  1  lodgerd refused or failed the request (the message says why)
  2  bad command line, or lodgerd could not be reached

The bus is the system bus; DBUS_SYSTEM_BUS_ADDRESS selects another one (tests, the demo).";

/// Control lodgerd, the colocation agent that gives training jobs dedicated cores and lends the
/// rest to CPU work.
#[derive(Parser)]
#[command(name = "lodgerctl", version, after_help = AFTER_HELP)]
struct Cli {
    /// Print JSON instead of tables (for scripts).
    #[arg(long, global = true)]
    json: bool,
    /// Talk to a lodgerd on the session bus instead of the system bus.
    #[arg(long, global = true)]
    session: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Register a job with lodgerd.
    #[command(subcommand)]
    Register(Register),
    /// Release a job: its threads return to SCHED_OTHER, its cgroups are restored, its CPUs freed.
    Unregister {
        /// The job's id, as `lodgerctl list` shows it (e.g. j3).
        id: String,
    },
    /// List registered jobs.
    List,
    /// Show one job in detail.
    Show {
        /// The job's id (e.g. j3).
        id: String,
    },
    /// Show the node: CPUs, reserved, free, training CPUs, enforcement mode.
    Status,
}

#[derive(Subcommand)]
enum Register {
    /// A GPU training job: pinned to whole cores local to its GPUs, every thread SCHED_RR.
    Training(TrainingArgs),
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "cgroup"])))]
struct TrainingArgs {
    /// The job's process(es); their children are included. Repeat or separate with commas.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pid: Vec<u32>,
    /// The job's existing cgroup (e.g. a Slurm step), relative to the cgroup hierarchy root.
    #[arg(long)]
    cgroup: Option<String>,
    /// GPU indices the job uses (nvidia-smi order), e.g. 0,1.
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<u32>,
    /// How many CPUs the job needs (SMT siblings count separately).
    #[arg(long)]
    cores: u32,
    /// A name to recognise the job by.
    #[arg(long)]
    name: Option<String>,
    /// Model category (cv, nlp, speech, other); used by right-sizing.
    #[arg(long)]
    category: Option<String>,
    /// The input pipeline is pipelined (prefetching loader).
    #[arg(long)]
    pipeline: bool,
    /// The job spans several nodes (its network traffic gets a guaranteed share).
    #[arg(long)]
    multi_node: bool,
}

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
    d.get(k).map(|v| show_value(v)).unwrap_or_default()
}

/// Prints rows as aligned columns, like `kubectl get`.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
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
        println!("{}", out.trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let proxy = connect(cli.session).await?;
    match cli.command {
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
        Command::Unregister { id } => {
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
                for (label, key) in keys {
                    let v = get(&d, key);
                    if key == "last_error" && v.is_empty() {
                        continue;
                    }
                    println!("  {label:>12}: {v}");
                }
            }
        }
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
                ] {
                    let v = get(&s, key);
                    println!("  {label:>12}: {}", if v.is_empty() { "-" } else { &v });
                }
            }
        }
    }
    Ok(())
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
