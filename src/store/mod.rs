//! The state file under the state directory (`/var/lib/lodger/state.json`): the registered jobs,
//! what lodger changed for each (so it can be undone after a restart) and the last plan.
//! Written on change only: a save whose bytes equal the last written ones touches nothing, and
//! what changes every sensing pass (samples, their times) is kept in memory, not here. Writes
//! are atomic (temp file, rename): a killed lodgerd leaves the old file or the new one whole.
//! They are made durable (fsync of the file and the directory) on a thread of the store's own,
//! off the caller's path and at most every [`SYNC_EVERY`], since a registration replies only
//! after its save (issue 21: the two fsyncs were the state file's share of `RegisterJob`'s p99
//! on a shared disk); [`Store::flush`] syncs at once (shutdown). What a crash of the node can
//! lose is the last half second of changes, and a crash of the node ends the jobs they
//! describe; after one, a file that did not reach the disk whole is set aside as unreadable,
//! as any is. A file of an older
//! [`STATE_VERSION`] is migrated (`migrate`); a newer or unreadable one is set aside. The intent
//! file of a training registration under way ([`Pending`]) is not renamed into place but
//! written in place, a line per step (see [`Store::write_pending`]). Touches only its own files.

mod migrate;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use serde::{Deserialize, Serialize};

use crate::enforce::JobRecord;
use crate::job::{Job, JobId};
use crate::policy::contention::HeldContention;
use crate::policy::inference::{
    CapacityCheck, InferencePlan, LayoutConfig, LayoutSearch, SearchCache, SearchOutcome,
};
use crate::policy::rightsize::{OwnerHistory, Tuner};
use crate::policy::Plan;

pub const STATE_FILE: &str = "state.json";
/// The state file is made durable at most this often (see the module doc).
pub const SYNC_EVERY: std::time::Duration = std::time::Duration::from_millis(500);
/// The training registration under way (see [`Pending`]), beside the state file.
pub const PENDING_FILE: &str = "registering.json";

/// A training registration between its first change to the node and the state file that records
/// it: written before lodger touches the job's processes, removed once a saved state file
/// supersedes it. A lodgerd killed before the registration is answered leaves it without `job`,
/// and the next one undoes what the registration may have done (its threads back to
/// SCHED_OTHER, out of lodger's cgroup) rather than leave threads real-time that no job owns; the
/// caller, who got no answer, registers again. Once the job is enforced a second record is
/// appended, with the job as it will be recorded (`job`, [`Store::commit_pending`]), and the caller is
/// answered before the state file is saved (issue 21: the state file's write was the largest
/// part of a registration's path): a lodgerd killed between the answer and the save leaves it
/// with `job`, and the next one records the job from it. Not fsynced: it guards against lodgerd
/// dying, and a crash of the node ends the job's processes too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pending {
    pub id: JobId,
    pub target: crate::job::Target,
    pub placement: crate::policy::Placement,
    /// The job as answered (its plan is the next tick's to redo).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<Box<StoredJob>>,
    /// A pid job's processes as they were when the registration was checked (see
    /// `JobRecord::authorized`): what undoing it may touch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorized: Vec<crate::enforce::RootProcess>,
    /// A cgroup job's cpusets before the registration wrote any (see `Enforce::cpusets_now`):
    /// what undoing it restores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpusets: Option<crate::enforce::CgroupJobRecord>,
}
/// Bumped when the file's shape changes; a file of an older version is migrated step by step
/// (`migrate`), a newer one is set aside, not read.
///
/// - 1: the first.
/// - 2: right-sizing's per-sample figures left the file (`Tuning::last_sample_ms`, the samples
///   of the window under way), so a sensing pass inside a window writes nothing.
pub const STATE_VERSION: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create state directory {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
    #[error("cannot write state file {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot read state file {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot encode state: {0}")]
    Encode(#[from] serde_json::Error),
}

/// Why a state file's text is not a state this lodgerd can use.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("not a lodger state file (not JSON: {0})")]
    Json(serde_json::Error),
    #[error("not a lodger state file (no \"version\" number)")]
    NoVersion,
    #[error(
        "state file version {found} is newer than this lodgerd's ({STATE_VERSION}): it was written \
         by a newer lodgerd"
    )]
    Newer { found: u64 },
    #[error("state file version {found} was never written by lodger")]
    Unknown { found: u64 },
    #[error("cannot migrate the state file from version {from} to {to}: {why}")]
    Migrate { from: u32, to: u32, why: String },
    #[error("state file of version {version} does not have that version's shape: {source}")]
    Shape {
        version: u32,
        source: serde_json::Error,
    },
}

/// A state file's text, understood.
#[derive(Debug)]
pub struct Parsed {
    pub state: State,
    /// The version the file was written in, when older than [`STATE_VERSION`].
    pub migrated_from: Option<u32>,
}

/// Reads a state file's text: the current version as it is, an older one migrated step by step
/// to the current one. Everything else is a [`ParseError`] with a message; nothing panics
/// (fuzzed: `fuzz/fuzz_targets/state_file.rs`).
pub fn parse(text: &str) -> Result<Parsed, ParseError> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(ParseError::Json)?;
    let found = value
        .get("version")
        .and_then(serde_json::Value::as_u64)
        .ok_or(ParseError::NoVersion)?;
    if found > u64::from(STATE_VERSION) {
        return Err(ParseError::Newer { found });
    }
    let from = u32::try_from(found)
        .ok()
        .filter(|v| *v >= 1)
        .ok_or(ParseError::Unknown { found })?;
    let value = migrate::to_current(value, from)?;
    let state = serde_json::from_value::<State>(value).map_err(|source| ParseError::Shape {
        version: from,
        source,
    })?;
    Ok(Parsed {
        state,
        migrated_from: (from < STATE_VERSION).then_some(from),
    })
}

/// One registered job and the undo record of what enforcement changed for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredJob {
    pub job: Job,
    pub record: JobRecord,
    /// Inference jobs: the layouts measured for them and the one in use.
    #[serde(default)]
    pub lodging: Lodging,
    /// Training jobs being right-sized (SODA §V-B).
    #[serde(default)]
    pub tuning: Option<Tuning>,
}

/// A training job's right-sizing, kept across restarts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tuning {
    pub tuner: Tuner,
    /// The sensing pass whose sample was taken last (its `unix_ms`). In memory only: it changes
    /// every pass, and after a restart the passes are new ones.
    #[serde(skip)]
    pub last_sample_ms: u64,
    /// The settled count was recorded in the owner's history.
    pub recorded: bool,
}

impl Tuning {
    /// Whether the two would be written the same (see [`Tuner::same_on_disk`]).
    pub fn same_on_disk(&self, other: &Tuning) -> bool {
        self.tuner.same_on_disk(&other.tuner) && self.recorded == other.recorded
    }
}

/// What lodger learnt about an inference job (Cloud Reamer §III-B), kept across restarts so a
/// layout is not searched for again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Lodging {
    /// Search outcomes by core count (the job's core budget when searched).
    pub cache: SearchCache,
    /// The outcome in use.
    pub outcome: Option<SearchOutcome>,
    /// The last capacity check of an online job with an expected rate.
    pub capacity: Option<CapacityCheck>,
    /// The layout search under way and the probe it runs, so a restarted lodgerd resumes it with
    /// the instances it adopted rather than start over (issue 17).
    #[serde(default)]
    pub search: Option<SearchUnderWay>,
    /// An offline job's batch on training cores, once decided (issue 14 item 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training_batch: Option<TrainingBatch>,
}

/// The batch an offline job's instances on training cores run, and what it was decided from
/// (`inference.training_core_batch_ms`; `policy::inference::batch_within`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingBatch {
    pub batch: u32,
    /// The job's batch it was decided for (its instances on idle cores run this).
    pub job_batch: u32,
    /// The bound it was decided under, in ms.
    pub bound_ms: u32,
    /// The measured CPU time of one item, in ms.
    pub ms_per_item: f64,
}

/// An online job's layout search between two probes, as the state file keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchUnderWay {
    pub search: LayoutSearch,
    /// The layout being measured.
    pub probe: LayoutConfig,
    /// The job's core budget it searches within (`policy::inference::online_budgets`; the
    /// name is the state file's); another budget starts a new search.
    pub free_cores: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    /// The sequence number of the next job id; never reused, so an id in a log means one job.
    pub next_seq: u64,
    pub jobs: BTreeMap<JobId, StoredJob>,
    pub plan: Plan,
    /// Where the inference instances run.
    #[serde(default)]
    pub inference: InferencePlan,
    /// Core counts owners' training jobs settled on (SODA §V-B-1 start points).
    #[serde(default)]
    pub owner_history: OwnerHistory,
    /// The contention throttles in force and what contention control learnt (issue 17: a
    /// restart keeps both).
    #[serde(default, skip_serializing_if = "HeldContention::is_empty")]
    pub contention: HeldContention,
}

impl Default for State {
    fn default() -> Self {
        Self {
            version: STATE_VERSION,
            next_seq: 1,
            jobs: BTreeMap::new(),
            plan: Plan::default(),
            inference: InferencePlan::default(),
            owner_history: OwnerHistory::default(),
            contention: HeldContention::default(),
        }
    }
}

/// What `Store::load` found.
#[derive(Debug)]
pub enum Loaded {
    /// No state file: a first start.
    Fresh(State),
    Found(State),
    /// The file was of an older version, `from`, and was migrated; it is rewritten in the current
    /// version at the next save.
    Migrated {
        state: State,
        from: u32,
    },
    /// The file could not be understood (not JSON, not a state, or a newer version); it was renamed to `set_aside` so nothing is lost, and
    /// lodgerd starts empty.
    SetAside {
        state: State,
        set_aside: PathBuf,
        reason: String,
    },
}

pub struct Store {
    dir: PathBuf,
    /// The bytes the file holds (last written, or read and current): a save of the same bytes
    /// is skipped.
    on_disk: Option<Vec<u8>>,
    /// Files written since this store was made.
    writes: u64,
    /// The thread that makes written files durable (started at the first write); a request
    /// waiting in the channel already covers any later write.
    syncer: Option<mpsc::SyncSender<()>>,
    /// The pending file holds an answered registration ([`Store::commit_pending`]) that no
    /// saved state file covers yet.
    committed: bool,
    /// The last save failed: the file is behind the state ([`Store::behind`]).
    behind: bool,
}

impl Store {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            on_disk: None,
            writes: 0,
            syncer: None,
            committed: false,
            behind: false,
        }
    }

    /// Makes the state file as last written durable, now, on the caller's thread (shutdown).
    pub fn flush(&self) -> Result<(), StoreError> {
        if self.writes == 0 {
            return Ok(());
        }
        sync_file_and_dir(&self.path(), &self.dir)
    }

    /// Asks the syncing thread to make the last write durable; syncs here if it cannot run.
    fn sync_later(&mut self) -> Result<(), StoreError> {
        if self.syncer.is_none() {
            let (tx, rx) = mpsc::sync_channel::<()>(1);
            let (path, dir) = (self.path(), self.dir.clone());
            let started = std::thread::Builder::new()
                .name("lodger-store".into())
                .spawn(move || {
                    while rx.recv().is_ok() {
                        if let Err(e) = sync_file_and_dir(&path, &dir) {
                            tracing::warn!("{e}");
                        }
                        // At most one sync per SYNC_EVERY: each forces a journal commit, which
                        // the next registration's rename would wait behind (a request that came
                        // meanwhile is served after the pause).
                        std::thread::sleep(SYNC_EVERY);
                    }
                });
            if started.is_ok() {
                self.syncer = Some(tx);
            }
        }
        match &self.syncer {
            Some(tx) => match tx.try_send(()) {
                Ok(()) | Err(mpsc::TrySendError::Full(())) => Ok(()),
                Err(mpsc::TrySendError::Disconnected(())) => {
                    self.syncer = None;
                    self.flush()
                }
            },
            None => self.flush(),
        }
    }

    /// How many times the file was written by this store (saves that changed nothing are not
    /// counted: they write nothing).
    pub fn writes(&self) -> u64 {
        self.writes
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }

    /// Creates the directory (mode 0700: the file lists other users' processes) if needed.
    pub fn ensure_dir(&self) -> Result<(), StoreError> {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|source| StoreError::CreateDir {
                path: self.dir.clone(),
                source,
            })
    }

    /// Reads the state file. A file of an older version is migrated; one that cannot be
    /// understood (garbage, or a newer version) is renamed aside, never deleted, and lodgerd
    /// starts without it.
    pub fn load(&mut self) -> Result<Loaded, StoreError> {
        let path = self.path();
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Loaded::Fresh(State::default()))
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return self.set_aside(&path, "not a lodger state file (not UTF-8)".into())
            }
            Err(source) => return Err(StoreError::Read { path, source }),
        };
        match parse(&text) {
            Ok(Parsed {
                state,
                migrated_from: None,
            }) => {
                self.on_disk = Some(text.into_bytes());
                Ok(Loaded::Found(state))
            }
            Ok(Parsed {
                state,
                migrated_from: Some(from),
            }) => Ok(Loaded::Migrated { state, from }),
            Err(e) => self.set_aside(&path, e.to_string()),
        }
    }

    fn set_aside(&mut self, path: &std::path::Path, reason: String) -> Result<Loaded, StoreError> {
        let set_aside = self.dir.join(format!(
            "{STATE_FILE}.unreadable-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        ));
        fs::rename(path, &set_aside).map_err(|source| StoreError::Write {
            path: set_aside.clone(),
            source,
        })?;
        self.on_disk = None;
        Ok(Loaded::SetAside {
            state: State::default(),
            set_aside,
            reason,
        })
    }

    /// Records the registration about to touch the node (see [`Pending`]): the file's first line.
    ///
    /// Neither this nor [`Store::commit_pending`] renames: on ext4, a file renamed over another
    /// has its data written out at once (`auto_da_alloc`), which was most of the commit's share
    /// of a registration (issue 21 item 1). The file is written in place instead, one JSON line
    /// per step, and read back by its last whole line (see [`Store::take_pending`]). No earlier
    /// record is lost by it: the previous registration's is in a saved state file before this
    /// one starts, and lodger touches nothing before this line is written.
    pub fn write_pending(&self, pending: &Pending) -> Result<(), StoreError> {
        self.write_pending_line(pending, false)
    }

    /// Records an answered registration until the next saved state file covers it (see
    /// [`Pending`]): `pending.job` is the job as the caller is told it is registered. Appended
    /// to the intent: a lodgerd killed while writing it leaves a cut last line, and the intent
    /// is read (the caller got no answer; the registration is undone).
    pub fn commit_pending(&mut self, pending: &Pending) -> Result<(), StoreError> {
        self.write_pending_line(pending, true)?;
        self.committed = true;
        Ok(())
    }

    fn write_pending_line(&self, pending: &Pending, append: bool) -> Result<(), StoreError> {
        use std::os::unix::fs::OpenOptionsExt;
        self.ensure_dir()?;
        let mut bytes = serde_json::to_vec(pending)?;
        bytes.push(b'\n');
        let path = self.dir.join(PENDING_FILE);
        let werr = |source| StoreError::Write {
            path: path.clone(),
            source,
        };
        let mut f = fs::OpenOptions::new();
        f.create(true).mode(0o600);
        if append {
            f.append(true);
        } else {
            f.write(true).truncate(true);
        }
        // One write(2): whole unless lodgerd is killed inside it, and then cut, never mixed.
        f.open(&path)
            .and_then(|mut f| f.write_all(&bytes))
            .map_err(werr)
    }

    /// The pending file holds an answered registration no saved state file covers yet: the
    /// next [`Store::save`] must succeed before another registration may write its own.
    pub fn committed(&self) -> bool {
        self.committed
    }

    /// The last save failed (a full or read-only disk): the file holds an older state, so the
    /// agent saves again at its next tick even when nothing else changed.
    pub fn behind(&self) -> bool {
        self.behind
    }

    /// The registration is recorded in the state file, or abandoned and undone.
    pub fn clear_pending(&mut self) {
        let _ = fs::remove_file(self.dir.join(PENDING_FILE));
        self.committed = false;
    }

    /// The registration a killed lodgerd left under way, if any: its last whole record (an
    /// answered registration's, or the intent when the answer's record was cut short). A file
    /// with no whole record counts as none, and is set aside.
    pub fn take_pending(&mut self) -> Option<Pending> {
        let path = self.dir.join(PENDING_FILE);
        let bytes = fs::read(&path).ok()?;
        let mut last = None;
        for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            // A file of lodger before issue 21's in-place records holds one record, no newline.
            match serde_json::from_slice::<Pending>(line) {
                Ok(p) => last = Some(Ok(p)),
                Err(e) if last.is_none() => last = Some(Err(e)),
                Err(_) => {}
            }
        }
        let pending = match last {
            // Empty: lodgerd was killed before its intent was written, so before it touched
            // anything.
            None => None,
            Some(Ok(p)) => Some(p),
            Some(Err(e)) => {
                // Kept for the operator: it may name a job whose threads are still real-time.
                let aside = self.dir.join(format!(
                    "{PENDING_FILE}.unreadable-{}",
                    crate::clock::now_secs()
                ));
                let kept = fs::rename(&path, &aside).is_ok();
                tracing::warn!(
                    "the record of a registration under way ({}) is unreadable ({e}): it is not \
                     undone{}",
                    path.display(),
                    if kept {
                        format!("; kept as {}", aside.display())
                    } else {
                        String::new()
                    }
                );
                None
            }
        };
        self.clear_pending();
        pending
    }

    /// Replaces the state file atomically: a crash leaves either the old or the new file whole.
    /// Returns whether it wrote: a state encoded as the file already holds it writes nothing.
    /// Either way the file now says what `state` does, so an answered registration's pending
    /// file ([`Store::commit_pending`]) is superseded and removed: the job is in the file, or
    /// was unregistered since.
    pub fn save(&mut self, state: &State) -> Result<bool, StoreError> {
        let wrote = self.write_state(state);
        self.behind = wrote.is_err();
        let wrote = wrote?;
        if self.committed {
            self.clear_pending();
        }
        Ok(wrote)
    }

    fn write_state(&mut self, state: &State) -> Result<bool, StoreError> {
        // Compact: at 50 jobs the pretty form was about twice the bytes to encode and write on
        // every registration's path (`jq . state.json` reads it).
        let bytes = serde_json::to_vec(state)?;
        if self.on_disk.as_deref() == Some(bytes.as_slice()) {
            return Ok(false);
        }
        self.ensure_dir()?;
        let path = self.path();
        let tmp = self.dir.join(format!(".{STATE_FILE}.tmp"));
        let werr = |source| StoreError::Write {
            path: tmp.clone(),
            source,
        };
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(werr)?;
            f.write_all(&bytes).map_err(werr)?;
        }
        fs::rename(&tmp, &path).map_err(|source| StoreError::Write {
            path: path.clone(),
            source,
        })?;
        self.writes += 1;
        self.on_disk = Some(bytes);
        self.sync_later()?;
        Ok(true)
    }
}

/// fsync of the file, then of the directory that names it (a rename is durable only once the
/// directory entry is).
fn sync_file_and_dir(path: &Path, dir: &Path) -> Result<(), StoreError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StoreError::Write { path, source }
    };
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(err(path))?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(err(dir))
}
