//! The state file under the state directory (`/var/lib/lodger/state.json`): the registered jobs,
//! what lodger changed for each (so it can be undone after a restart) and the last plan.
//! Writes are atomic (temp file, fsync, rename, fsync of the directory). Touches only its own
//! files.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::enforce::JobRecord;
use crate::job::{Job, JobId};
use crate::policy::inference::{CapacityCheck, InferencePlan, SearchCache, SearchOutcome};
use crate::policy::rightsize::{OwnerHistory, Tuner};
use crate::policy::Plan;

pub const STATE_FILE: &str = "state.json";
/// Bumped when the file's shape changes incompatibly; an unknown version is set aside, not read.
pub const STATE_VERSION: u32 = 1;

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
    /// The sensing pass whose sample was taken last (its `unix_ms`).
    pub last_sample_ms: u64,
    /// The settled count was recorded in the owner's history.
    pub recorded: bool,
}

/// What lodger learnt about an inference job (Cloud Reamer §III-B), kept across restarts so a
/// layout is not searched for again.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Lodging {
    /// Search outcomes by free-core count.
    pub cache: SearchCache,
    /// The outcome in use.
    pub outcome: Option<SearchOutcome>,
    /// The last capacity check of an online job with an expected rate.
    pub capacity: Option<CapacityCheck>,
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
        }
    }
}

/// What `Store::load` found.
#[derive(Debug)]
pub enum Loaded {
    /// No state file: a first start.
    Fresh(State),
    Found(State),
    /// The file could not be understood; it was renamed to `set_aside` so nothing is lost, and
    /// lodgerd starts empty.
    SetAside {
        state: State,
        set_aside: PathBuf,
        reason: String,
    },
}

pub struct Store {
    dir: PathBuf,
}

impl Store {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
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

    pub fn load(&self) -> Result<Loaded, StoreError> {
        let path = self.path();
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Loaded::Fresh(State::default()))
            }
            Err(source) => return Err(StoreError::Read { path, source }),
        };
        let reason = match serde_json::from_str::<State>(&text) {
            Ok(state) if state.version == STATE_VERSION => return Ok(Loaded::Found(state)),
            Ok(state) => format!(
                "state file version {} is not {STATE_VERSION}",
                state.version
            ),
            Err(e) => e.to_string(),
        };
        let set_aside = self.dir.join(format!(
            "{STATE_FILE}.unreadable-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        ));
        fs::rename(&path, &set_aside).map_err(|source| StoreError::Write {
            path: set_aside.clone(),
            source,
        })?;
        Ok(Loaded::SetAside {
            state: State::default(),
            set_aside,
            reason,
        })
    }

    /// Replaces the state file atomically: a crash leaves either the old or the new file whole.
    pub fn save(&self, state: &State) -> Result<(), StoreError> {
        self.ensure_dir()?;
        let bytes = serde_json::to_vec_pretty(state)?;
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
            f.sync_all().map_err(werr)?;
        }
        fs::rename(&tmp, &path).map_err(|source| StoreError::Write {
            path: path.clone(),
            source,
        })?;
        // The rename is durable only once the directory entry is.
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| StoreError::Write {
                path: self.dir.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_then_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path().join("sub"));
        assert!(matches!(store.load().unwrap(), Loaded::Fresh(_)));
        let state = State {
            next_seq: 7,
            ..State::default()
        };
        store.save(&state).unwrap();
        match store.load().unwrap() {
            Loaded::Found(s) => assert_eq!(s, state),
            other => panic!("{other:?}"),
        }
        // No temp file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path().join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(STATE_FILE)]);
    }

    #[test]
    fn corrupt_file_is_set_aside_not_lost() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        fs::write(store.path(), "{ not json").unwrap();
        match store.load().unwrap() {
            Loaded::SetAside {
                state, set_aside, ..
            } => {
                assert_eq!(state, State::default());
                assert_eq!(fs::read_to_string(set_aside).unwrap(), "{ not json");
                assert!(!store.path().exists());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_version_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        let state = State {
            version: 99,
            ..State::default()
        };
        fs::write(store.path(), serde_json::to_vec(&state).unwrap()).unwrap();
        assert!(matches!(store.load().unwrap(), Loaded::SetAside { .. }));
    }
}
