//! `lodgerctl slurm prolog|epilog`: what slurmd runs for every job (docs/slurm.md). Reads the
//! job from the environment (`lodger::slurm`), registers or unregisters it with lodgerd within a
//! deadline, logs one line to syslog, and exits 0 whatever happened: a failing prolog or epilog
//! drains the node, and a node must never be drained because of lodger.

use std::collections::HashMap;
use std::ffi::{CString, OsString};
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::Parser;
use zbus::zvariant::Value;

use lodger::api::proxy::ManagerProxy;
use lodger::cli::lodgerctl::{Cli, Command, Slurm, SlurmArgs};
use lodger::config::Config;
use lodger::job::JobKind;
use lodger::slurm::{Decision, SlurmEnv};

use super::connect;

/// Whether `args` (lodgerctl's, its name first) ask for `slurm ...`: the global options
/// (`--json`, `--session`) take no value, so the first word that is not an option names the
/// command.
pub fn invoked(args: &[OsString]) -> bool {
    args.iter()
        .skip(1)
        .find(|a| !a.to_string_lossy().starts_with('-'))
        .is_some_and(|a| a == "slurm")
}

/// `lodgerctl slurm ...` from its command line to its one logged line. Whatever goes wrong
/// (an option clap refuses, a runtime that cannot start, a panic) is logged as the failures of
/// [`run`] are, and the caller exits 0 all the same: slurmd drains a node whose prolog or
/// epilog fails (docs/slurm.md).
pub fn main(args: Vec<OsString>) {
    let what = args
        .iter()
        .skip_while(|a| *a != "slurm")
        .nth(1)
        .map(|a| a.to_string_lossy().into_owned())
        .filter(|w| w == "prolog" || w == "epilog")
        .unwrap_or_else(|| "prolog/epilog".into());
    let nothing_done = |why: &str| {
        let job = std::env::var("SLURM_JOB_ID")
            .map(|j| format!("job {j}: "))
            .unwrap_or_default();
        report(&format!("lodger slurm {what}: {job}nothing done: {why}"));
    };
    let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let cli = match Cli::try_parse_from(&args) {
            Ok(cli) => cli,
            Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
                let _ = e.print();
                return;
            }
            Err(e) => {
                let text = e.to_string();
                let first = text.lines().next().unwrap_or("").trim();
                let first = first.strip_prefix("error: ").unwrap_or(first);
                nothing_done(&format!(
                    "bad command line ({first}): fix slurm.conf's Prolog/Epilog"
                ));
                return;
            }
        };
        let Command::Slurm(cmd) = cli.command else {
            nothing_done("not a slurm command");
            return;
        };
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => {
                rt.block_on(run(cmd, cli.session));
            }
            Err(e) => nothing_done(&format!("cannot start its runtime: {e}")),
        }
    }));
    if ran.is_err() {
        nothing_done("lodgerctl panicked (a bug: please report it with the message above)");
    }
}

/// Runs the prolog or epilog; returns the line it logged (also printed to stderr, which slurmd
/// keeps in its log when debugging).
async fn run(cmd: Slurm, session: bool) -> String {
    let (args, prolog) = match &cmd {
        Slurm::Prolog(a) => (a, true),
        Slurm::Epilog(a) => (a, false),
    };
    let what = if prolog { "prolog" } else { "epilog" };
    let line = match SlurmEnv::read(|k| std::env::var(k).ok()) {
        Err(e) => format!("lodger slurm {what}: nothing done: {e}"),
        Ok(env) => {
            let deadline = Duration::from_millis(args.deadline_ms);
            let work = async {
                if prolog {
                    prolog_for(&env, args, session).await
                } else {
                    epilog_for(&env, session).await
                }
            };
            match tokio::time::timeout(deadline, work).await {
                Ok(Ok(done)) => format!("lodger slurm {what}: job {}: {done}", env.job_id),
                Ok(Err(e)) => format!("lodger slurm {what}: job {}: nothing done: {e}", env.job_id),
                Err(_) => format!(
                    "lodger slurm {what}: job {}: nothing done: lodgerd did not answer within \
                     {} ms ({})",
                    env.job_id,
                    args.deadline_ms,
                    if prolog {
                        "the job runs unmanaged unless lodgerd still registers it"
                    } else {
                        "lodgerd forgets the job when Slurm removes its cgroup"
                    }
                ),
            }
        }
    };
    report(&line);
    line
}

/// The one line a run logs: to syslog, and to stderr (which slurmd keeps when debugging).
fn report(line: &str) {
    syslog(line);
    eprintln!("{line}");
}

async fn prolog_for(env: &SlurmEnv, args: &SlurmArgs, session: bool) -> Result<String, String> {
    // The rules are read at every run: an edited config applies to the next job.
    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) if !args.config.exists() => {
            let _ = e;
            Config::default()
        }
        Err(e) => return Err(format!("{e} (fix the config; the job runs unmanaged)")),
    };
    let kind = match env.decide(&config.slurm) {
        Decision::Leave(why) => return Ok(format!("left alone: {why}")),
        Decision::Register(kind) => kind,
    };
    let proxy = connect(session).await.map_err(|f| f.message)?;
    let mut spec: HashMap<&str, Value<'_>> = HashMap::new();
    spec.insert("kind", Value::from(kind.as_str()));
    spec.insert("slurm_job", Value::from(env.job_id));
    spec.insert("owner", Value::from(env.uid));
    spec.insert("name", Value::from(format!("slurm-{}", env.job_id)));
    if let Some(node) = &env.node {
        spec.insert("slurm_node", Value::from(node.as_str()));
    }
    let mut note = String::new();
    if kind == JobKind::Training {
        spec.insert("cores", Value::from(env.cpus_per_node.unwrap_or(0)));
        spec.insert("multi_node", Value::from(env.nodes > 1));
        if env.exclusive {
            spec.insert("exclusive", Value::from(true));
        }
        let gpus = usable_gpus(&proxy, env.gpus.as_deref(), &mut note).await;
        spec.insert("gpus", Value::from(gpus));
    }
    let (id, _) = proxy
        .register_job(spec)
        .await
        .map_err(|e| super::from_zbus("register", e).message)?;
    Ok(format!(
        "registered as {} job {id} for uid {}{note}{}",
        kind.as_str(),
        env.uid,
        env.sluid
            .as_deref()
            .map(|s| format!(" (SLUID {s})"))
            .unwrap_or_default()
    ))
}

/// The job's GPU indices lodgerd can place by; none (with a note) where lodgerd sees fewer
/// GPUs than Slurm named, or Slurm named them by UUID only.
async fn usable_gpus(
    proxy: &ManagerProxy<'_>,
    gpus: Option<&[u32]>,
    note: &mut String,
) -> Vec<u32> {
    let Some(gpus) = gpus else {
        *note = "; its GPUs are named by UUID only: no GPU locality".into();
        return Vec::new();
    };
    let seen = match proxy.get_status().await {
        Ok(status) => status
            .get("gpus")
            .and_then(|v| u32::try_from(&**v).ok())
            .unwrap_or(0),
        Err(_) => 0,
    };
    if gpus.iter().all(|&g| g < seen) {
        gpus.to_vec()
    } else {
        *note = format!(
            "; lodgerd sees {seen} GPU(s), Slurm named {gpus:?}: placed without GPU locality"
        );
        Vec::new()
    }
}

async fn epilog_for(env: &SlurmEnv, session: bool) -> Result<String, String> {
    let proxy = connect(session).await.map_err(|f| f.message)?;
    let jobs = proxy
        .list_jobs()
        .await
        .map_err(|e| super::from_zbus("list", e).message)?;
    let mut released = Vec::new();
    for (id, ..) in jobs {
        let Ok(job) = proxy.get_job(&id).await else {
            continue;
        };
        let slurm = job.get("slurm_job").and_then(|v| u64::try_from(&**v).ok());
        if slurm == Some(u64::from(env.job_id)) {
            match proxy.unregister_job(&id).await {
                Ok(()) => released.push(id),
                Err(zbus::Error::MethodError(name, ..))
                    if name.as_str() == "org.lodger1.Error.NotFound" => {}
                Err(e) => return Err(super::from_zbus("unregister", e).message),
            }
        }
    }
    Ok(if released.is_empty() {
        "not registered (nothing to undo)".to_string()
    } else {
        format!("unregistered {}", released.join(", "))
    })
}

/// One line to syslog (the journal where systemd runs), facility daemon. Written through libc:
/// it is one call, and the log must be written even when everything else failed.
fn syslog(line: &str) {
    let (Ok(ident), Ok(fmt), Ok(msg)) = (
        CString::new("lodgerctl"),
        CString::new("%s"),
        CString::new(line.replace('\0', " ")),
    ) else {
        return;
    };
    // SAFETY: the strings are NUL-terminated and live until closelog; "%s" takes one string.
    unsafe {
        libc::openlog(ident.as_ptr(), libc::LOG_PID, libc::LOG_DAEMON);
        libc::syslog(libc::LOG_NOTICE, fmt.as_ptr(), msg.as_ptr());
        libc::closelog();
    }
}
