//! Network sensing: per-interface byte counters and link speed from sysfs
//! (`class/net/<if>/statistics/{rx_bytes,tx_bytes}`, `class/net/<if>/speed`), under a sysfs root
//! given by the caller. Reads only; rates come from two samples ([`rates`]).
//!
//! Per job, traffic is measured where the job has a network namespace of its own (a container
//! or a Kubernetes pod without host networking): that namespace's interfaces are the job's, read
//! through one of its processes (`/proc/<pid>/net/dev`, [`job_netns_sample`]). A job sharing the
//! host's namespace is not attributed: the host's interface counters cannot tell one process's
//! bytes from another's, and lodger's cgroup classification (`enforce::shaping`) groups all CPU
//! jobs into one class rather than counting each.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{info, warn};

/// Where interfaces live under the sysfs root.
const CLASS_NET: &str = "class/net";
const RX_BYTES: &str = "statistics/rx_bytes";
const TX_BYTES: &str = "statistics/tx_bytes";
const SPEED: &str = "speed";
const IFINDEX: &str = "ifindex";
/// Present (a symlink to the bus device) only for interfaces backed by hardware.
const DEVICE_LINK: &str = "device";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: '{value}' {reason}")]
    Parse {
        path: PathBuf,
        value: String,
        reason: String,
    },
}

/// One interface's counters at one instant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InterfaceSample {
    /// Bytes received since the interface was created (or its driver last reset them).
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// Negotiated link speed in Mbit/s; `None` for virtual devices (the kernel answers EINVAL),
    /// a link that is down, or an unknown speed (-1).
    pub speed_mbps: Option<u64>,
    /// The kernel's interface index: a change means the interface was deleted and recreated
    /// under the same name, so its counters started again.
    pub ifindex: Option<u64>,
    /// Backed by a hardware device (has a `device` link), as opposed to lo, veth, bridges,
    /// ifb and other virtual interfaces.
    pub physical: bool,
}

/// Every interface's counters, read at `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetSample {
    pub at: Instant,
    pub interfaces: BTreeMap<String, InterfaceSample>,
}

/// One interface's rates between two samples. A rate is `None` when it cannot be derived
/// honestly: the interface is new, was recreated, or its counter went backwards.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InterfaceRate {
    pub rx_bytes_per_s: Option<f64>,
    pub tx_bytes_per_s: Option<f64>,
    /// Line rate in bytes/s from the newer sample's speed, when known.
    pub line_bytes_per_s: Option<f64>,
    pub physical: bool,
}

impl InterfaceRate {
    /// The busier direction as a fraction of the line rate (links are full duplex), when
    /// both are known.
    pub fn utilization(&self) -> Option<f64> {
        let line = self.line_bytes_per_s.filter(|l| *l > 0.0)?;
        let busiest = match (self.rx_bytes_per_s, self.tx_bytes_per_s) {
            (Some(rx), Some(tx)) => rx.max(tx),
            (Some(one), None) | (None, Some(one)) => one,
            (None, None) => return None,
        };
        Some(busiest / line)
    }
}

/// Rates for every interface present in the newer sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NetRates {
    pub interval: Duration,
    pub interfaces: BTreeMap<String, InterfaceRate>,
}

/// A source of interface samples: [`NetReader`], or a fake in the agent's tests.
pub trait NetSource: Send {
    fn sample(&mut self) -> Result<NetSample, NetError>;
}

impl NetSource for NetReader {
    fn sample(&mut self) -> Result<NetSample, NetError> {
        NetReader::sample(self)
    }
}

/// Reads network interface counters from a sysfs tree.
#[derive(Debug, Clone)]
pub struct NetReader {
    sysfs_root: PathBuf,
    /// (interface, error) already logged as unreadable, so a veth that keeps failing while it
    /// is torn down is logged once, not every pass. Forgotten when the interface leaves the
    /// listing, so the set stays as small as the node's interface list.
    unreadable: BTreeSet<(String, String)>,
}

impl NetReader {
    /// `sysfs_root` is the directory mounted at `/sys` (`topology::DEFAULT_SYSFS`) or a fixture.
    pub fn new(sysfs_root: impl Into<PathBuf>) -> Self {
        Self {
            sysfs_root: sysfs_root.into(),
            unreadable: BTreeSet::new(),
        }
    }

    /// Reads every interface. An interface that disappears while being read is left out, and so
    /// is one whose files answer an error (a veth being torn down answers EINVAL or ENODEV):
    /// logged once per interface and error, the other interfaces kept. A counter that is not a
    /// number still fails the pass: the kernel does not write one, so it is a format to learn.
    pub fn sample(&mut self) -> Result<NetSample, NetError> {
        let dir = self.sysfs_root.join(CLASS_NET);
        let entries = fs::read_dir(&dir).map_err(|source| NetError::Io {
            path: dir.clone(),
            source,
        })?;
        let mut interfaces = BTreeMap::new();
        let mut listed = BTreeSet::new();
        for entry in entries {
            let entry = entry.map_err(|source| NetError::Io {
                path: dir.clone(),
                source,
            })?;
            let Ok(name) = entry.file_name().into_string() else {
                // Interface names are ASCII; anything else is not an interface we can report.
                continue;
            };
            match read_interface(&entry.path()) {
                Ok(Some(sample)) => {
                    interfaces.insert(name.clone(), sample);
                }
                Ok(None) => {}
                Err(NetError::Io { path, source }) => {
                    if self.first_report(&name, &source) {
                        let what = format!(
                            "network interface left out of sensing while it cannot be read: \
                             {}: {source}",
                            path.display()
                        );
                        // A pod's veth going away is routine; a NIC that cannot be read is not.
                        if entry.path().join(DEVICE_LINK).exists() {
                            warn!(interface = %name, "{what}");
                        } else {
                            info!(interface = %name, "{what}");
                        }
                    }
                }
                Err(e) => return Err(e),
            }
            listed.insert(name);
        }
        self.unreadable.retain(|(name, _)| listed.contains(name));
        Ok(NetSample {
            at: Instant::now(),
            interfaces,
        })
    }

    /// Whether this error on this interface is new, and so worth a log line.
    fn first_report(&mut self, interface: &str, error: &io::Error) -> bool {
        self.unreadable
            .insert((interface.to_string(), error.to_string()))
    }
}

/// `None` when the interface vanished between listing and reading.
fn read_interface(dir: &Path) -> Result<Option<InterfaceSample>, NetError> {
    let Some(rx_bytes) = read_counter(&dir.join(RX_BYTES))? else {
        return Ok(None);
    };
    let Some(tx_bytes) = read_counter(&dir.join(TX_BYTES))? else {
        return Ok(None);
    };
    let ifindex = read_counter(&dir.join(IFINDEX))?;
    Ok(Some(InterfaceSample {
        rx_bytes,
        tx_bytes,
        speed_mbps: read_speed(&dir.join(SPEED))?,
        ifindex,
        physical: dir.join(DEVICE_LINK).exists(),
    }))
}

/// A decimal counter; `None` when the file does not exist (the interface went away).
fn read_counter(path: &Path) -> Result<Option<u64>, NetError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(NetError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let value = text.trim();
    value.parse().map(Some).map_err(|_| NetError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        reason: "is not a non-negative integer".to_string(),
    })
}

/// Link speed in Mbit/s. Virtual devices and down links answer EINVAL (or EOPNOTSUPP) on read;
/// a driver that does not know prints -1 (older kernels: 4294967295 or 65535 for SPEED_UNKNOWN).
fn read_speed(path: &Path) -> Result<Option<u64>, NetError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if speed_not_reported(&e) => return Ok(None),
        Err(source) => {
            return Err(NetError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let value = text.trim();
    let speed: i64 = value.parse().map_err(|_| NetError::Parse {
        path: path.to_path_buf(),
        value: value.to_string(),
        reason: "is not an integer speed in Mbit/s".to_string(),
    })?;
    const SPEED_UNKNOWN_U32: i64 = 4_294_967_295;
    const SPEED_UNKNOWN_U16: i64 = 65_535;
    if speed <= 0 || speed == SPEED_UNKNOWN_U32 || speed == SPEED_UNKNOWN_U16 {
        return Ok(None);
    }
    Ok(u64::try_from(speed).ok())
}

fn speed_not_reported(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound
        || matches!(
            e.raw_os_error(),
            Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(libc::ENODEV)
        )
}

/// Rates between two samples, for every interface of `cur`. Pure: depends only on its
/// arguments. A delta is dropped (rate `None`) when the interface is new, its ifindex changed
/// (deleted and recreated), or a counter went backwards (driver reset, e.g. on some NICs when
/// the link flaps); a zero or negative interval yields no rates at all.
pub fn rates(prev: &NetSample, cur: &NetSample) -> NetRates {
    let interval = cur.at.saturating_duration_since(prev.at);
    let secs = interval.as_secs_f64();
    let interfaces = cur
        .interfaces
        .iter()
        .map(|(name, now)| {
            let before = prev
                .interfaces
                .get(name)
                .filter(|before| before.ifindex == now.ifindex && secs > 0.0);
            let rate = |old: u64, new: u64| counter_rate(old, new, secs);
            let rate = InterfaceRate {
                rx_bytes_per_s: before.and_then(|b| rate(b.rx_bytes, now.rx_bytes)),
                tx_bytes_per_s: before.and_then(|b| rate(b.tx_bytes, now.tx_bytes)),
                // Mbit/s → bytes/s.
                line_bytes_per_s: now.speed_mbps.map(|mbps| mbps as f64 * 1e6 / 8.0),
                physical: now.physical,
            };
            (name.clone(), rate)
        })
        .collect();
    NetRates {
        interval,
        interfaces,
    }
}

/// `(new - old) / secs`, or `None` when the counter went backwards.
fn counter_rate(old: u64, new: u64, secs: f64) -> Option<f64> {
    new.checked_sub(old).map(|delta| delta as f64 / secs)
}

/// A job's own network namespace's traffic at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetnsSample {
    pub at: Instant,
    /// The namespace's identity (`net:[4026532291]`): a change means the counters are another
    /// namespace's.
    pub netns: String,
    /// Summed over its interfaces but `lo`.
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

/// What can be said of a job's network traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobNet {
    /// It has a namespace of its own: these are its counters.
    Own(NetnsSample),
    /// It is in lodgerd's namespace (the host's), or its namespace cannot be read: not
    /// attributable; the process that told, and the reason.
    NotAttributable { pid: u32, why: String },
    /// None of its processes could be read (they exited).
    Gone,
}

/// Reads the network namespace of the first readable process of `pids` under `proc_root`, and
/// compares it with lodgerd's own (`<proc_root>/self/ns/net`).
pub fn job_netns_sample(proc_root: &Path, pids: &[u32]) -> JobNet {
    let own = fs::read_link(proc_root.join("self/ns/net")).ok();
    for pid in pids {
        let dir = proc_root.join(pid.to_string());
        let netns = match fs::read_link(dir.join("ns/net")) {
            Ok(l) => l.to_string_lossy().into_owned(),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return JobNet::NotAttributable {
                    pid: *pid,
                    why: "cannot tell its network namespace: reading another user's \
                          /proc/<pid>/ns/net needs CAP_SYS_PTRACE"
                        .into(),
                }
            }
            Err(_) => continue,
        };
        if own.as_deref().map(|o| o.to_string_lossy()) == Some(netns.as_str().into()) {
            return JobNet::NotAttributable {
                pid: *pid,
                why: "shares the host's network namespace: its traffic cannot be told from others'"
                    .into(),
            };
        }
        let Ok(text) = fs::read_to_string(dir.join("net/dev")) else {
            continue;
        };
        let Some((rx_bytes, tx_bytes)) = parse_net_dev(&text) else {
            continue;
        };
        return JobNet::Own(NetnsSample {
            at: Instant::now(),
            netns,
            rx_bytes,
            tx_bytes,
        });
    }
    JobNet::Gone
}

/// Received and sent bytes summed over every interface of a `/proc/net/dev` text but `lo`;
/// `None` if the text is not in that format.
pub fn parse_net_dev(text: &str) -> Option<(u64, u64)> {
    let mut lines = text.lines();
    // Two header lines: "Inter-|   Receive ... |  Transmit" and " face |bytes ...".
    if !lines.next()?.contains('|') || !lines.next()?.contains("bytes") {
        return None;
    }
    let (mut rx, mut tx) = (0u64, 0u64);
    for line in lines {
        let (name, counters) = line.split_once(':')?;
        let fields: Vec<u64> = counters
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        // 8 receive fields, then 8 transmit fields; bytes first in each.
        if fields.len() < 16 {
            return None;
        }
        if name.trim() == "lo" {
            continue;
        }
        rx = rx.saturating_add(fields[0]);
        tx = tx.saturating_add(fields[8]);
    }
    Some((rx, tx))
}

/// Received and sent bytes/s between two samples of one namespace; `None` when the namespace
/// changed, a counter went backwards (an interface left) or no time passed.
pub fn netns_rates(prev: &NetnsSample, cur: &NetnsSample) -> Option<(f64, f64)> {
    let secs = cur.at.saturating_duration_since(prev.at).as_secs_f64();
    if prev.netns != cur.netns || secs <= 0.0 {
        return None;
    }
    Some((
        counter_rate(prev.rx_bytes, cur.rx_bytes, secs)?,
        counter_rate(prev.tx_bytes, cur.tx_bytes, secs)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds `class/net/<name>` with the given files under a tempdir sysfs root.
    fn interface(root: &Path, name: &str, files: &[(&str, &str)]) {
        let dir = root.join(CLASS_NET).join(name);
        fs::create_dir_all(dir.join("statistics")).expect("create fixture dirs");
        for (file, content) in files {
            fs::write(dir.join(file), content).expect("write fixture file");
        }
    }

    fn eth(rx: &str, tx: &str, speed: &str) -> Vec<(&'static str, String)> {
        vec![
            (RX_BYTES, rx.to_string()),
            (TX_BYTES, tx.to_string()),
            (SPEED, speed.to_string()),
            (IFINDEX, "2\n".to_string()),
        ]
    }

    fn write_eth(root: &Path, name: &str, rx: &str, tx: &str, speed: &str) {
        let files = eth(rx, tx, speed);
        let borrowed: Vec<(&str, &str)> = files.iter().map(|(f, c)| (*f, c.as_str())).collect();
        interface(root, name, &borrowed);
    }

    fn sample_at(at: Instant, entries: &[(&str, u64, u64, Option<u64>)]) -> NetSample {
        NetSample {
            at,
            interfaces: entries
                .iter()
                .map(|&(name, rx, tx, ifindex)| {
                    let s = InterfaceSample {
                        rx_bytes: rx,
                        tx_bytes: tx,
                        speed_mbps: Some(10_000),
                        ifindex,
                        physical: true,
                    };
                    (name.to_string(), s)
                })
                .collect(),
        }
    }

    #[test]
    fn reads_counters_speed_and_kind() {
        let tmp = tempfile::tempdir().expect("tempdir");
        write_eth(tmp.path(), "eth0", "1000\n", "2000\n", "25000\n");
        fs::create_dir_all(tmp.path().join("devices/pci0000:00/0000:00:03.0")).expect("device dir");
        std::os::unix::fs::symlink(
            tmp.path().join("devices/pci0000:00/0000:00:03.0"),
            tmp.path().join(CLASS_NET).join("eth0").join(DEVICE_LINK),
        )
        .expect("device link");
        // A virtual device: no speed file content the kernel would give (EINVAL cannot be
        // faked on a plain file), so model it with -1 and no device link.
        interface(
            tmp.path(),
            "veth1",
            &[(RX_BYTES, "5\n"), (TX_BYTES, "6\n"), (SPEED, "-1\n")],
        );
        let s = NetReader::new(tmp.path()).sample().expect("sample");
        let eth0 = &s.interfaces["eth0"];
        assert_eq!((eth0.rx_bytes, eth0.tx_bytes), (1000, 2000));
        assert_eq!(eth0.speed_mbps, Some(25_000));
        assert_eq!(eth0.ifindex, Some(2));
        assert!(eth0.physical);
        let veth = &s.interfaces["veth1"];
        assert_eq!(veth.speed_mbps, None);
        assert_eq!(veth.ifindex, None);
        assert!(!veth.physical);
    }

    #[test]
    fn speed_unknown_values_and_missing_file_are_none() {
        for value in ["-1\n", "0\n", "4294967295\n", "65535\n"] {
            let tmp = tempfile::tempdir().expect("tempdir");
            write_eth(tmp.path(), "eth0", "1", "1", value);
            let s = NetReader::new(tmp.path()).sample().expect("sample");
            assert_eq!(s.interfaces["eth0"].speed_mbps, None, "speed {value:?}");
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        interface(tmp.path(), "lo", &[(RX_BYTES, "1\n"), (TX_BYTES, "1\n")]);
        let s = NetReader::new(tmp.path()).sample().expect("sample");
        assert_eq!(s.interfaces["lo"].speed_mbps, None);
    }

    #[test]
    fn garbage_counter_names_path_and_value() {
        let tmp = tempfile::tempdir().expect("tempdir");
        write_eth(tmp.path(), "eth0", "lots\n", "1\n", "1000\n");
        let err = NetReader::new(tmp.path()).sample().expect_err("garbage");
        let msg = err.to_string();
        assert!(msg.contains("eth0/statistics/rx_bytes"), "{msg}");
        assert!(msg.contains("'lots'"), "{msg}");
    }

    #[test]
    fn empty_counter_file_is_a_parse_error() {
        let tmp = tempfile::tempdir().expect("tempdir");
        write_eth(tmp.path(), "eth0", "1\n", "", "1000\n");
        let err = NetReader::new(tmp.path()).sample().expect_err("empty");
        assert!(matches!(err, NetError::Parse { ref path, .. } if path.ends_with(TX_BYTES)));
    }

    #[test]
    fn garbage_speed_is_a_parse_error() {
        let tmp = tempfile::tempdir().expect("tempdir");
        write_eth(tmp.path(), "eth0", "1\n", "1\n", "fast\n");
        let err = NetReader::new(tmp.path())
            .sample()
            .expect_err("garbage speed");
        assert!(err.to_string().contains("'fast'"), "{err}");
    }

    #[test]
    fn missing_class_net_is_an_error_with_the_path() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let err = NetReader::new(tmp.path())
            .sample()
            .expect_err("no class/net");
        assert!(err.to_string().contains("class/net"), "{err}");
    }

    #[test]
    fn interface_without_counters_is_left_out() {
        // As when an interface is deleted between read_dir and reading its statistics.
        let tmp = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(tmp.path().join(CLASS_NET).join("gone")).expect("dir");
        write_eth(tmp.path(), "eth0", "1\n", "1\n", "1000\n");
        let s = NetReader::new(tmp.path()).sample().expect("sample");
        assert_eq!(s.interfaces.keys().collect::<Vec<_>>(), ["eth0"]);
    }

    #[test]
    fn an_unreadable_interface_is_left_out_once_logged_and_the_others_kept() {
        // A veth being torn down answers EINVAL on its statistics; a directory where the file
        // should be answers EISDIR: an error other than NotFound, as the kernel's.
        let tmp = tempfile::tempdir().expect("tempdir");
        write_eth(tmp.path(), "eth0", "1\n", "2\n", "1000\n");
        interface(tmp.path(), "veth9", &[(TX_BYTES, "6\n")]);
        let broken = tmp.path().join(CLASS_NET).join("veth9").join(RX_BYTES);
        fs::create_dir(&broken).expect("a directory as rx_bytes");
        let mut reader = NetReader::new(tmp.path());
        for pass in 0..2 {
            let s = reader.sample().expect("the other interfaces are read");
            assert_eq!(
                s.interfaces.keys().collect::<Vec<_>>(),
                ["eth0"],
                "pass {pass}"
            );
            assert_eq!(
                reader.unreadable.len(),
                1,
                "one report per interface and error"
            );
        }
        let again = io::Error::from_raw_os_error(libc::EISDIR);
        assert!(!reader.first_report("veth9", &again), "already logged");
        let other = io::Error::from_raw_os_error(libc::ENODEV);
        assert!(
            reader.first_report("veth9", &other),
            "another error is logged"
        );
        // Gone from the listing: forgotten, so the set does not grow with pod churn.
        fs::remove_dir_all(tmp.path().join(CLASS_NET).join("veth9")).expect("remove veth9");
        reader.sample().expect("sample");
        assert!(reader.unreadable.is_empty());
    }

    #[test]
    fn rates_from_two_samples() {
        let t0 = Instant::now();
        let prev = sample_at(t0, &[("eth0", 1_000, 5_000, Some(2))]);
        let cur = sample_at(
            t0 + Duration::from_secs(2),
            &[("eth0", 3_000, 5_000, Some(2))],
        );
        let r = rates(&prev, &cur);
        assert_eq!(r.interval, Duration::from_secs(2));
        let eth0 = &r.interfaces["eth0"];
        assert_eq!(eth0.rx_bytes_per_s, Some(1_000.0));
        assert_eq!(eth0.tx_bytes_per_s, Some(0.0));
        assert_eq!(eth0.line_bytes_per_s, Some(1.25e9));
        assert_eq!(eth0.utilization(), Some(1_000.0 / 1.25e9));
    }

    #[test]
    fn counter_reset_drops_only_that_delta() {
        let t0 = Instant::now();
        let prev = sample_at(t0, &[("eth0", 9_000, 100, Some(2))]);
        let cur = sample_at(t0 + Duration::from_secs(1), &[("eth0", 10, 300, Some(2))]);
        let eth0 = &rates(&prev, &cur).interfaces["eth0"];
        assert_eq!(eth0.rx_bytes_per_s, None);
        assert_eq!(eth0.tx_bytes_per_s, Some(200.0));
    }

    #[test]
    fn recreated_or_new_interface_has_no_rate() {
        let t0 = Instant::now();
        let prev = sample_at(t0, &[("veth0", 10, 10, Some(7))]);
        let cur = sample_at(
            t0 + Duration::from_secs(1),
            &[("veth0", 500, 500, Some(9)), ("veth1", 1, 1, Some(10))],
        );
        let r = rates(&prev, &cur);
        for name in ["veth0", "veth1"] {
            assert_eq!(r.interfaces[name].rx_bytes_per_s, None, "{name}");
            assert_eq!(r.interfaces[name].tx_bytes_per_s, None, "{name}");
        }
    }

    #[test]
    fn zero_interval_yields_no_rates() {
        let t0 = Instant::now();
        let prev = sample_at(t0, &[("eth0", 1, 1, Some(2))]);
        let cur = sample_at(t0, &[("eth0", 2, 2, Some(2))]);
        assert_eq!(rates(&prev, &cur).interfaces["eth0"].rx_bytes_per_s, None);
        // Samples handed over in the wrong order behave the same.
        assert_eq!(rates(&cur, &prev).interfaces["eth0"].rx_bytes_per_s, None);
    }

    #[test]
    fn reads_this_machines_sysfs() {
        // Read-only and unprivileged: every Linux host has class/net with at least lo.
        let root = Path::new(crate::topology::DEFAULT_SYSFS);
        if !root.join(CLASS_NET).join("lo").exists() {
            crate::privileged::skip("reads_this_machines_sysfs", "no /sys/class/net/lo here");
            return;
        }
        let s = NetReader::new(root).sample().expect("sample /sys");
        let lo = &s.interfaces["lo"];
        assert!(!lo.physical);
        assert_eq!(lo.speed_mbps, None, "lo has no link speed");
    }

    const NET_DEV: &str = "\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:  123456     100    0    0    0     0          0         0   123456     100    0    0    0     0       0          0
  eth0: 1000000    2000    0    0    0     0          0         0   500000    1000    0    0    0     0       0          0
  eth1:    2000      20    0    0    0     0          0         0     3000      30    0    0    0     0       0          0
";

    #[test]
    fn net_dev_sums_every_interface_but_lo() {
        assert_eq!(parse_net_dev(NET_DEV), Some((1_002_000, 503_000)));
        assert_eq!(parse_net_dev("garbage"), None);
        assert_eq!(
            parse_net_dev(&NET_DEV.replace("1000000", "x")),
            None,
            "a field that is not a number"
        );
    }

    fn proc_with(netns_self: &str, pid: u32, netns: &str, dev: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(root.path().join("self/ns")).expect("self");
        std::os::unix::fs::symlink(netns_self, root.path().join("self/ns/net")).expect("link");
        let dir = root.path().join(pid.to_string());
        std::fs::create_dir_all(dir.join("ns")).expect("ns");
        std::fs::create_dir_all(dir.join("net")).expect("net");
        std::os::unix::fs::symlink(netns, dir.join("ns/net")).expect("link");
        std::fs::write(dir.join("net/dev"), dev).expect("dev");
        root
    }

    #[test]
    fn a_job_in_its_own_namespace_is_measured_one_in_the_hosts_is_not() {
        let root = proc_with("net:[1]", 42, "net:[7]", NET_DEV);
        let JobNet::Own(a) = job_netns_sample(root.path(), &[41, 42]) else {
            panic!("own namespace");
        };
        assert_eq!((a.rx_bytes, a.tx_bytes), (1_002_000, 503_000));
        let mut b = a.clone();
        b.at = a.at + Duration::from_secs(2);
        b.rx_bytes += 2_000;
        b.tx_bytes += 4_000;
        assert_eq!(netns_rates(&a, &b), Some((1_000.0, 2_000.0)));
        let mut other = b.clone();
        other.netns = "net:[8]".into();
        assert_eq!(netns_rates(&a, &other), None, "another namespace");
        let mut reset = b.clone();
        reset.rx_bytes = 0;
        assert_eq!(netns_rates(&a, &reset), None, "a counter went backwards");

        let shared = proc_with("net:[1]", 42, "net:[1]", NET_DEV);
        assert!(matches!(
            job_netns_sample(shared.path(), &[42]),
            JobNet::NotAttributable { pid: 42, why } if why.contains("host's network namespace")
        ));
        assert_eq!(job_netns_sample(root.path(), &[43]), JobNet::Gone);
    }
}
