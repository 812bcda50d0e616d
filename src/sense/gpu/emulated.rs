//! The emulated GPU source: the bundled training emulator's published busy fraction, read as
//! a [`GpuSource`] so that a host without GPUs drives the same code path as NVML. May touch the
//! emulator's publish directory and `<proc_root>/<pid>` (read); the writes are the emulator's.

use super::*;

/// What the training emulator publishes, one JSON object per process in `<dir>/<pid>.json`:
///
/// ```json
/// {"pid":4242,"gpu":0,"busy":0.873,"iters_per_s":41.5,"updated_unix_ms":1764000000123}
/// ```
///
/// `busy` is the fraction of the last second the emulated GPU step ran (0 to 1); the file is
/// replaced atomically (written to `.<pid>.json.tmp`, then renamed) about once a second and
/// removed when the emulator exits. Readers ignore unknown fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmulatedGpuRecord {
    pub pid: u32,
    pub gpu: u32,
    pub busy: f64,
    pub iters_per_s: f64,
    pub updated_unix_ms: u64,
}

impl EmulatedGpuRecord {
    /// A record stamped now.
    pub fn now(pid: u32, gpu: u32, busy: f64, iters_per_s: f64) -> Self {
        Self {
            pid,
            gpu,
            busy,
            iters_per_s,
            updated_unix_ms: unix_ms(),
        }
    }

    fn check(&self, file_pid: u32) -> Result<(), String> {
        if self.pid != file_pid {
            return Err(format!("pid {} does not match the file name", self.pid));
        }
        if self.pid == 0 {
            return Err("pid 0".to_string());
        }
        if !(self.busy.is_finite() && (0.0..=1.0).contains(&self.busy)) {
            return Err(format!(
                "busy {} is not a fraction between 0 and 1",
                self.busy
            ));
        }
        if !(self.iters_per_s.is_finite() && self.iters_per_s >= 0.0) {
            return Err(format!("iters_per_s {} is not a rate", self.iters_per_s));
        }
        Ok(())
    }
}

/// `<dir>/<pid>.json`.
pub fn emulated_record_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("{pid}.json"))
}

/// Replaces `<dir>/<pid>.json` atomically (temporary file, then rename), creating `dir` if
/// needed. Called by the emulator.
pub fn write_emulated_record(dir: &Path, record: &EmulatedGpuRecord) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.json.tmp", record.pid));
    let json = serde_json::to_vec(record).map_err(io::Error::other)?;
    let mut file = File::create(&tmp)?;
    file.write_all(&json)?;
    file.write_all(b"\n")?;
    drop(file);
    fs::rename(&tmp, emulated_record_path(dir, record.pid))
}

/// Removes `<dir>/<pid>.json`; a record already gone is fine.
pub fn remove_emulated_record(dir: &Path, pid: u32) -> io::Result<()> {
    match fs::remove_file(emulated_record_path(dir, pid)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Why a file in the emulator directory was not used.
#[derive(Debug, Clone, PartialEq)]
pub enum Ignored {
    /// Not rewritten for longer than the staleness limit: its writer stopped or hangs.
    Stale { age: Duration },
    /// Its process no longer exists (an emulator killed before it could clean up).
    ProcessGone { pid: u32 },
    /// Not a record: unreadable, not JSON of the right shape, or values out of range.
    Malformed { reason: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct IgnoredRecord {
    pub path: PathBuf,
    pub why: Ignored,
}

/// The training emulator's emulated GPUs, read from the directory it publishes into.
#[derive(Debug, Clone)]
pub struct EmulatedSource {
    dir: PathBuf,
    proc_root: PathBuf,
    stale_after: Duration,
    ignored: Vec<IgnoredRecord>,
}

impl EmulatedSource {
    /// `dir` is where emulators publish (config, default [`DEFAULT_EMULATED_GPU_DIR`]);
    /// `proc_root` (`/proc`) tells live pids from dead ones.
    pub fn new(dir: impl Into<PathBuf>, proc_root: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            proc_root: proc_root.into(),
            stale_after: DEFAULT_EMULATED_STALE_AFTER,
            ignored: Vec::new(),
        }
    }

    pub fn with_stale_after(mut self, stale_after: Duration) -> Self {
        self.stale_after = stale_after;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The files the last sample passed over, and why. For the caller to log when they change;
    /// sampling itself does not log.
    pub fn ignored(&self) -> &[IgnoredRecord] {
        &self.ignored
    }

    fn read(&mut self) -> Result<GpuSnapshot, GpuError> {
        self.ignored.clear();
        let now_ms = unix_ms();
        let mut records = Vec::new();
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            // No emulator has published yet.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(emulated_snapshot(now_ms, Vec::new()))
            }
            Err(source) => {
                return Err(GpuError::EmulatedDir {
                    path: self.dir.clone(),
                    source,
                })
            }
        };
        for entry in entries {
            let entry = entry.map_err(|source| GpuError::EmulatedDir {
                path: self.dir.clone(),
                source,
            })?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            // Hidden files are the emulator's temporaries; other names are not records.
            let Some(stem) = name
                .strip_suffix(".json")
                .filter(|_| !name.starts_with('.'))
            else {
                continue;
            };
            let path = entry.path();
            match self.record(&path, stem, now_ms) {
                Ok(Some(record)) => records.push(record),
                Ok(None) => {}
                Err(why) => self.ignored.push(IgnoredRecord { path, why }),
            }
        }
        Ok(emulated_snapshot(now_ms, records))
    }

    /// One file: `Ok(None)` when it vanished while being read (its emulator just exited).
    fn record(
        &self,
        path: &Path,
        stem: &str,
        now_ms: u64,
    ) -> Result<Option<EmulatedGpuRecord>, Ignored> {
        let malformed = |reason: String| Ignored::Malformed { reason };
        let file_pid: u32 = stem
            .parse()
            .map_err(|_| malformed(format!("'{stem}' is not a pid")))?;
        let mut text = String::new();
        match open_record(path)
            .and_then(|f| f.take(EMULATED_RECORD_MAX_BYTES).read_to_string(&mut text))
        {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(malformed(format!("cannot read: {e}"))),
        }
        let record: EmulatedGpuRecord =
            serde_json::from_str(&text).map_err(|e| malformed(e.to_string()))?;
        record.check(file_pid).map_err(malformed)?;
        let age = Duration::from_millis(now_ms.saturating_sub(record.updated_unix_ms));
        if age > self.stale_after {
            return Err(Ignored::Stale { age });
        }
        if !self.proc_root.join(record.pid.to_string()).exists() {
            return Err(Ignored::ProcessGone { pid: record.pid });
        }
        Ok(Some(record))
    }
}

/// Opens a record file for reading: a regular file only, never through a symlink, and without
/// blocking. The directory may be writable by the emulators' users: a FIFO named like a record
/// blocked the GPU worker in `open` for good (its source stale from then on), and a symlink had
/// lodgerd read whatever it pointed at.
fn open_record(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}

impl GpuSource for EmulatedSource {
    fn kind(&self) -> GpuSourceKind {
        GpuSourceKind::Emulated
    }

    fn sample(&mut self) -> Result<GpuSnapshot, GpuError> {
        self.read()
    }
}

/// One emulated device per GPU index any record names; its utilization is the sum of its
/// processes' busy fractions, at most 1.
fn emulated_snapshot(now_ms: u64, mut records: Vec<EmulatedGpuRecord>) -> GpuSnapshot {
    records.sort_by_key(|r| (r.gpu, r.pid));
    let mut busy: BTreeMap<u32, f64> = BTreeMap::new();
    for r in &records {
        *busy.entry(r.gpu).or_default() += r.busy;
    }
    let devices = busy
        .into_iter()
        .map(|(index, busy)| GpuDevice {
            name: Some(EMULATED_DEVICE_NAME.to_string()),
            util_gpu: Some(busy.min(1.0)),
            ..GpuDevice::bare(index)
        })
        .collect();
    let processes = records
        .iter()
        .map(|r| GpuProcess {
            pid: r.pid,
            gpu: r.gpu,
            sm_util: Some(r.busy),
            mem_util: None,
            used_memory_bytes: None,
            iters_per_s: Some(r.iters_per_s),
        })
        .collect();
    GpuSnapshot {
        source: GpuSourceKind::Emulated,
        taken_unix_ms: now_ms,
        devices,
        processes,
        failed: Vec::new(),
    }
}
