//! SIGHUP: re-reading lodgerd's config file and applying what can change live. The file read and
//! the `api.group` look-up (NSS: files, LDAP, sssd) run on a thread of their own, bounded, so a
//! hung mount or directory server never holds one of the runtime's workers that serve D-Bus.

use std::path::Path;
use std::time::Duration;

use tracing::{info, warn};

use super::settings::{agent_settings_on, Enforceable};
use super::{group_exists, shaping_control};
use crate::agent::{AgentHandle, LiveSettings, NetworkReload};
use crate::api::Authority;
use crate::config::{self, Config};
use crate::enforce::network::node::Classifier;
use crate::sys::bounded::{BoundedError, BoundedThreads};

/// How long a reload may spend reading the file and looking its group up before it gives up and
/// keeps the running config.
pub(super) const READ_BOUND: Duration = Duration::from_secs(10);

/// The thread the reload's read runs on: one at a time, so while a hung read's thread lives, a new
/// reload is refused rather than stacking threads up.
pub(super) fn reader() -> BoundedThreads {
    BoundedThreads::new("lodgerd-reload", 1)
}

/// Re-reads the config file lodgerd was started with and applies what can change live
/// (`config::reload`); a file that does not parse, or that cannot be read within `reader`'s
/// bound, changes nothing. Returns the config now running. Registered jobs are never dropped.
/// `classifier`: how CPU jobs' traffic is told apart, known when lodgerd shaped at start
/// (`[network]` can then change live); `enforceable`: what this node's enforcers can do, as at
/// start.
pub(super) async fn reload(
    running: &Config,
    reader: &BoundedThreads,
    handle: &AgentHandle,
    auth: &Authority,
    classifier: Option<&Classifier>,
    enforceable: Enforceable,
) -> Config {
    let Some(path) = running.origin().map(Path::to_path_buf) else {
        info!("reload: lodgerd runs on the built-in defaults (no config file): nothing to re-read");
        return running.clone();
    };
    let new = match read(running, reader, &path, |p| Config::load(p), group_exists).await {
        Ok(new) => new,
        Err(e) => {
            warn!("reload refused, the running config is kept: {e}");
            return running.clone();
        }
    };
    let (next, what) = config::reload(running, &new, classifier.is_some());
    if !what.applied.is_empty() {
        let network = match classifier {
            Some(c) if next.network != running.network => {
                NetworkReload::Replace(shaping_control(&next, c.clone()).map(Box::new))
            }
            _ => NetworkReload::Keep,
        };
        if let Err(e) = handle
            .reload(live_settings(&next, enforceable), network)
            .await
        {
            warn!("reload not applied: {e}");
            return running.clone();
        }
        auth.set_group(next.api.group.clone());
    }
    if what.refused.is_empty() {
        info!("reloaded {}: {}", path.display(), what.describe());
    } else {
        warn!("reloaded {}: {}", path.display(), what.describe());
    }
    next
}

/// The file at `path` read with `load` and its group vetted with `exists` ([`vet_group`]), both
/// off the runtime through `reader`; the error says why there is no new config.
async fn read<L, G>(
    running: &Config,
    reader: &BoundedThreads,
    path: &Path,
    load: L,
    exists: G,
) -> Result<Config, String>
where
    L: FnOnce(&Path) -> Result<Config, config::ConfigError> + Send + 'static,
    G: FnOnce(&str) -> Result<bool, String> + Send + 'static,
{
    let running = running.clone();
    let path = path.to_path_buf();
    let shown = path.display().to_string();
    match reader
        .run_async(READ_BOUND, move || {
            load(&path).map(|new| vet_group(&running, new, exists))
        })
        .await
    {
        Ok(Ok(new)) => Ok(new),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e @ (BoundedError::TimedOut(_) | BoundedError::Busy(_))) => Err(format!(
            "reading {shown}: {e} (a hung mount or name service?)"
        )),
        Err(e) => Err(format!("reading {shown}: {e}")),
    }
}

/// A reloaded config's `api.group`, checked as at start ([`Config::check_group`]): a new group
/// the node does not have is refused (logged, naming the line) and the running one kept; the
/// other keys are `new`'s.
fn vet_group(
    running: &Config,
    mut new: Config,
    exists: impl FnOnce(&str) -> Result<bool, String>,
) -> Config {
    if new.api.group == running.api.group {
        return new;
    }
    match new.check_group(exists) {
        Ok(None) => {}
        Ok(Some(w)) => warn!("reload: {w}"),
        Err(e) => {
            warn!("reload: {e}; api.group stays \"{}\"", running.api.group);
            new.api.group = running.api.group.clone();
        }
    }
    new
}

/// What a reload to `next` changes in the running agent, on a node whose enforcers can do what
/// `node` says (the same adjustment as at start).
fn live_settings(next: &Config, node: Enforceable) -> LiveSettings {
    LiveSettings {
        sense_pace: Some((next.sense.interval(), next.sense.deadline())),
        ..agent_settings_on(next, node).live()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    /// Where the batch enforcer cannot limit memory (v2 with affinity pinning, --sim), a batch
    /// job may not ask for a limit: at start and after any reload that applies something. The
    /// reload used to resolve batch.memory_max again and let such jobs register with a limit
    /// nobody wrote.
    #[test]
    fn a_reload_keeps_batch_memory_limits_refused_where_none_is_written() {
        let config = Config::default();
        let none = Enforceable {
            batch_memory: false,
        };
        assert_eq!(
            agent_settings_on(&config, none).trust.batch_memory_max,
            None
        );
        assert_eq!(live_settings(&config, none).trust.batch_memory_max, None);
        // Where limits are written, the default share of the node is the most one may ask for.
        let limits = Enforceable { batch_memory: true };
        assert!(live_settings(&config, limits)
            .trust
            .batch_memory_max
            .is_some());
    }

    /// A reload naming a group the node does not have keeps the running group; the rest of the
    /// file applies. A group that exists is taken.
    #[test]
    fn a_reload_to_a_missing_group_keeps_the_running_one() {
        let path = Path::new("/etc/lodger/lodger.toml");
        let running = Config::parse("[api]\ngroup = \"trainers\"\n", path).expect("parses");
        let new = Config::parse(
            "[agent]\ninterval_ms = 250\n[api]\ngroup = \"trainres\"\n",
            path,
        )
        .expect("parses");
        let vetted = vet_group(&running, new.clone(), |name| Ok(name == "trainers"));
        assert_eq!(vetted.api.group, "trainers");
        assert_eq!(vetted.agent.interval_ms, 250);
        let (next, what) = config::reload(&running, &vetted, false);
        assert_eq!(next.api.group, "trainers");
        assert_eq!(what.applied, ["agent.interval_ms = 250 (was 1000)"]);
        let vetted = vet_group(&running, new, |_| Ok(true));
        assert_eq!(vetted.api.group, "trainres");
    }

    /// The reload read the file and looked `api.group` up on a runtime worker: an NSS look-up
    /// that hangs (LDAP down) held one of the two workers that serve D-Bus, and the reload never
    /// ended. Now the read gives up at the bound and the running config is kept; a second
    /// reload while the hung one still runs is refused without starting another thread; once
    /// the hung look-up returns, reloads read again. Time is tokio's paused clock while the
    /// look-up hangs (the bound passes without waiting for it), the real one after (a paused
    /// clock would also jump past the bound while a quick read's thread starts).
    #[tokio::test(start_paused = true)]
    async fn a_reload_whose_group_look_up_hangs_gives_up_at_the_bound() {
        let path = Path::new("/etc/lodger/lodger.toml");
        let running = Config::parse("[api]\ngroup = \"trainers\"\n", path).expect("parses");
        let text = "[agent]\ninterval_ms = 250\n[api]\ngroup = \"trainres\"\n";
        let load = move |p: &Path| Config::parse(text, p);
        let reader = reader();

        let (release, hung) = mpsc::channel::<()>();
        let (ended_tx, ended) = mpsc::channel::<()>();
        let hangs = move |_: &str| {
            let _ = hung.recv();
            let _ = ended_tx.send(());
            Ok(true)
        };
        let err = read(&running, &reader, path, load, hangs)
            .await
            .expect_err("a hung look-up gives no config");
        assert_eq!(
            err,
            format!(
                "reading {}: it did not finish within 10s (a hung mount or name service?)",
                path.display()
            )
        );
        let err = read(&running, &reader, path, load, |_| Ok(true))
            .await
            .expect_err("one read at a time");
        assert!(err.contains("the one before is still running"), "{err}");

        // The look-up returns: its late answer is dropped, and the next reload reads.
        release.send(()).expect("the hung look-up waits");
        ended.recv().expect("the hung look-up ends");
        while reader.running() > 0 {
            // Its thread clears the flag right after the look-up: wait for that, not for time.
            std::thread::yield_now();
        }
        tokio::time::resume();
        let new = read(&running, &reader, path, load, |_| Ok(true))
            .await
            .expect("reads");
        assert_eq!(new.api.group, "trainres");
        assert_eq!(new.agent.interval_ms, 250);
    }

    /// A file that does not parse, or a reader that panics, is an error, not a new config.
    #[tokio::test]
    async fn a_reload_that_fails_to_read_says_why() {
        let path = Path::new("/etc/lodger/lodger.toml");
        let running = Config::default();
        let reader = reader();
        let bad = |p: &Path| Config::parse("[agent]\ninterval_ms = \"soon\"\n", p);
        let err = read(&running, &reader, path, bad, |_| Ok(true))
            .await
            .expect_err("does not parse");
        assert!(err.contains("interval_ms"), "{err}");
        // Unwinds as a panic does, without the panic hook: the hook's backtrace (RUST_BACKTRACE=1,
        // symbols read from the whole test binary on the first panic) once took longer than
        // READ_BOUND on a loaded CI machine, and the read was reported timed out, not panicked.
        let panics = |_: &Path| -> Result<Config, config::ConfigError> {
            std::panic::resume_unwind(Box::new("reader bug"))
        };
        assert_eq!(
            reader
                .run_async(READ_BOUND, move || panics(path))
                .await
                .err(),
            Some(BoundedError::Panicked)
        );
        // A panicked read leaves the reader usable.
        assert_eq!(reader.run_async(READ_BOUND, || 7).await, Ok(7));
    }
}
