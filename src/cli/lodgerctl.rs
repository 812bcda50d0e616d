//! `lodgerctl`'s command line.

use clap::{Args, Parser, Subcommand};

const AFTER_HELP: &str = "\
Exit status:
  0  the request succeeded
  1  lodgerd refused or failed the request (the message says why)
  2  bad command line, or lodgerd could not be reached

Who may do what: every user may list, show, status and top; members of lodgerd's api.group may
register their own processes, cgroups and commands and unregister their own jobs; root may do
everything, also for another user (--user). See docs/security.md.

The bus is the system bus; DBUS_SYSTEM_BUS_ADDRESS selects another one (tests, the demo).";

/// Control lodgerd, the colocation agent that gives training jobs dedicated cores and lends the
/// rest to CPU work.
#[derive(Parser, Debug)]
#[command(name = "lodgerctl", version, after_help = AFTER_HELP)]
pub struct Cli {
    /// Print JSON instead of tables (for scripts).
    #[arg(long, global = true)]
    pub json: bool,
    /// Talk to a lodgerd on the session bus instead of the system bus.
    #[arg(long, global = true)]
    pub session: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Register a job with lodgerd.
    #[command(subcommand)]
    Register(Register),
    /// Release a job: its threads return to SCHED_OTHER, its cgroups are restored, its CPUs freed.
    Unregister(UnregisterArgs),
    /// List registered jobs. IN CLASS: the job's threads in the class lodger gives its kind, out
    /// of all, and that class (RR for training under SCHED_RR; BATCH or OTHER for batch jobs).
    List,
    /// Show one job in detail.
    Show {
        /// The job's id (e.g. j3).
        id: String,
    },
    /// Show the node: CPUs, reserved, free, training CPUs, enforcement mode.
    Status,
    /// Undo everything lodgerd did, on purpose: release every job (threads back to SCHED_OTHER,
    /// cgroups restored, network shaping removed) and wait until every inference instance has
    /// stopped. Run it before stopping lodgerd for good (the packages' removal does); a plain
    /// stop or restart undoes nothing, and instances run on for the next lodgerd. Root only.
    Drain(DrainArgs),
    /// Live measurements per job (CPU %, IPC, cache-miss %, GPU %, memory bandwidth), refreshed
    /// like top; `--once` or `--json` print one sample for scripts.
    Top(TopArgs),
    /// Slurm's prolog and epilog (slurm.conf `Prolog=`/`Epilog=`, run by slurmd as root; see
    /// docs/slurm.md). They always exit 0 within their deadline, so lodger never drains a node,
    /// and log what they did to syslog.
    #[command(subcommand)]
    Slurm(Slurm),
}

#[derive(Subcommand, Debug)]
pub enum Slurm {
    /// Registers the job slurmd describes in the environment: training if it has GPUs on this
    /// node, batch if not, or as a [[slurm.rule]] in lodger's config says.
    Prolog(SlurmArgs),
    /// Unregisters the job (its threads back to SCHED_OTHER and their CPU masks restored).
    Epilog(SlurmArgs),
}

#[derive(Args, Debug)]
pub struct SlurmArgs {
    /// lodger's config, for the [[slurm.rule]] entries.
    #[arg(long, default_value = crate::config::DEFAULT_CONFIG_PATH, value_name = "FILE")]
    pub config: std::path::PathBuf,
    /// Give up on lodgerd after this many milliseconds (and still exit 0).
    #[arg(long, default_value_t = 1500, value_name = "MS",
          value_parser = clap::value_parser!(u64).range(100..=10_000))]
    pub deadline_ms: u64,
}

#[derive(Args, Debug)]
pub struct TopArgs {
    /// Print one sample and exit.
    #[arg(long)]
    pub once: bool,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0, value_parser = parse_refresh)]
    pub refresh: f64,
}

fn parse_refresh(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "'{s}' is not a number of seconds between 0.1 and 3600"
        )),
    }
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["id", "all"])))]
pub struct UnregisterArgs {
    /// The job's id, as `lodgerctl list` shows it (e.g. j3).
    pub id: Option<String>,
    /// Release every registered job (the packages' removal scripts use it before stopping
    /// lodgerd, which otherwise leaves its jobs pinned on purpose). As anyone but root: every
    /// job of yours; other users' jobs are listed as skipped. Exits 1 only if one of the jobs it
    /// acts on could not be released, after releasing the rest.
    #[arg(long)]
    pub all: bool,
}

/// The longest `drain --timeout`: a day (longer waits on nothing a drain could still end).
pub const DRAIN_TIMEOUT_MAX: u64 = 86_400;

#[derive(Args, Debug)]
pub struct DrainArgs {
    /// Seconds to wait for the instances to stop (each gets lodgerd's stop grace, then SIGKILL);
    /// at most a day.
    #[arg(long, default_value_t = 60, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(0..=DRAIN_TIMEOUT_MAX))]
    pub timeout: u64,
}

#[derive(Subcommand, Debug)]
pub enum Register {
    /// A GPU training job: pinned to whole cores local to its GPUs, every thread SCHED_RR.
    Training(TrainingArgs),
    /// Online CPU inference: lodger runs instances of COMMAND on exclusive leftover cores and
    /// searches for the layout (cores per instance, instances, batch) with the best throughput
    /// within the latency SLO.
    Online(OnlineArgs),
    /// Offline CPU inference: lodger runs single-thread instances of COMMAND on every core,
    /// training's included (training pre-empts them).
    Offline(OfflineArgs),
    /// A CPU batch job lodger did not start (data preparation, a CPU-only job): its processes
    /// run on the cores training and online inference leave, SCHED_OTHER (or SCHED_BATCH,
    /// batch.policy), and are throttled first when memory bandwidth runs short.
    Batch(BatchArgs),
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "cgroup"])))]
pub struct BatchArgs {
    /// The job's process(es); their children are included. Repeat or separate with commas.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub pid: Vec<u32>,
    /// The job's existing cgroup (e.g. a container's), relative to the cgroup hierarchy root.
    #[arg(long)]
    pub cgroup: Option<String>,
    /// At most this many CPUs of the leftover ones (default: all of them).
    #[arg(long)]
    pub cores: Option<u32>,
    /// The job's memory limit, e.g. 2G (powers of 1024), in the cgroup lodger makes for it; at
    /// most the node's batch.memory_max, which applies when not given. Only with --pid: lodger
    /// never writes the memory settings of a cgroup it did not make.
    #[arg(long, value_name = "SIZE", value_parser = crate::job::memory::parse_size,
          conflicts_with = "cgroup")]
    pub memory_max: Option<u64>,
    /// A name to recognise the job by.
    #[arg(long)]
    pub name: Option<String>,
    #[command(flatten)]
    pub owner: OwnerArgs,
}

#[derive(Args, Debug)]
pub struct OnlineArgs {
    /// The p99 latency the job's requests must stay under (every instance's batches
    /// together), in milliseconds.
    #[arg(long, value_name = "MS")]
    pub slo_ms: f64,
    /// The job's expected request rate, per second (lodger signals CapacityExceeded when the
    /// node cannot serve it).
    #[arg(long, value_name = "PER_S")]
    pub rate: Option<f64>,
    #[command(flatten)]
    pub common: InferenceArgs,
}

#[derive(Args, Debug)]
pub struct OfflineArgs {
    #[command(flatten)]
    pub common: InferenceArgs,
}

#[derive(Args, Debug)]
pub struct InferenceArgs {
    /// Largest batch an instance may be given.
    #[arg(long, default_value_t = 64)]
    pub max_batch: u32,
    /// Most instances to run.
    #[arg(long)]
    pub max_instances: Option<u32>,
    /// Each instance's memory limit, e.g. 512M or 4G (powers of 1024, as systemd's
    /// MemoryMax=); at most the node's inference.memory_max, which applies when not given. An
    /// instance past it is killed by the OOM killer and restarted with back-off.
    #[arg(long, value_name = "SIZE", value_parser = crate::job::memory::parse_size)]
    pub memory_max: Option<u64>,
    /// A name to recognise the job by.
    #[arg(long)]
    pub name: Option<String>,
    /// The instances' working directory (default: the current one). It must be a directory
    /// the job's owner may enter.
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<std::path::PathBuf>,
    /// An environment variable for the instances, NAME=value; repeat for more. Instances get
    /// only PATH, HOME, USER, LOGNAME, LANG, lodger's LODGER_* and thread-count variables and
    /// these, never lodgerd's environment.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Append the instances' stdout and stderr to FILE, opened as the job's owner (default:
    /// lodgerd's own stderr, the journal under systemd).
    #[arg(long, value_name = "FILE")]
    pub output: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub owner: OwnerArgs,
    /// One instance's command, after `--`. Placeholders: {threads}, {batch}, {cpus},
    /// {instance}, {job} (docs/instance-protocol.md). It runs as the job's owner.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "cgroup"])))]
pub struct TrainingArgs {
    /// The job's process(es); their children are included. Repeat or separate with commas.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub pid: Vec<u32>,
    /// The job's existing cgroup (e.g. a Slurm step), relative to the cgroup hierarchy root.
    #[arg(long)]
    pub cgroup: Option<String>,
    /// GPU indices the job uses (nvidia-smi order), e.g. 0,1.
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<u32>,
    /// How many CPUs the job needs (SMT siblings count separately).
    #[arg(long)]
    pub cores: u32,
    /// A name to recognise the job by.
    #[arg(long)]
    pub name: Option<String>,
    /// Model category (cv, nlp, speech, other); used by right-sizing.
    #[arg(long)]
    pub category: Option<String>,
    /// The input pipeline is pipelined (prefetching loader).
    #[arg(long)]
    pub pipeline: bool,
    /// The job spans several nodes (its network traffic gets a guaranteed share).
    #[arg(long)]
    pub multi_node: bool,
    /// Keep exactly --cores: never right-size this job from its GPU utilization.
    #[arg(long)]
    pub no_rightsize: bool,
    /// Lend none of this job's cores: no inference instance or batch job runs on them (a
    /// benchmark, a latency-critical job).
    #[arg(long)]
    pub exclusive: bool,
    #[command(flatten)]
    pub owner: OwnerArgs,
}

#[derive(Args, Debug)]
pub struct OwnerArgs {
    /// Register the job for user NAME (a name or a uid) instead of for yourself: root only
    /// (Slurm prologs, container runtimes). It counts against that user's caps; its instances
    /// run as that user.
    #[arg(long, value_name = "NAME")]
    pub user: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definitions_are_consistent() {
        Cli::command().debug_assert();
        crate::cli::lodgerd::Cli::command().debug_assert();
    }

    #[test]
    fn unregister_takes_an_id_or_all_but_not_both() {
        let parse = |args: &[&str]| Cli::try_parse_from(args);
        assert!(parse(&["lodgerctl", "unregister", "j1"]).is_ok());
        assert!(parse(&["lodgerctl", "unregister", "--all"]).is_ok());
        assert!(parse(&["lodgerctl", "unregister"]).is_err());
        assert!(parse(&["lodgerctl", "unregister", "j1", "--all"]).is_err());
    }

    /// A timeout past any deadline an Instant can hold was accepted and panicked in drain.
    #[test]
    fn drain_timeout_is_at_most_a_day() {
        let parse = |t: &str| Cli::try_parse_from(["lodgerctl", "drain", "--timeout", t]);
        assert!(parse("0").is_ok());
        assert!(parse("86400").is_ok());
        let err = parse("18446744073709551615").expect_err("refused");
        assert!(err.to_string().contains("--timeout"), "{err}");
        assert!(parse("86401").is_err());
    }
}
