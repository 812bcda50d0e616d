//! The report protocol of `docs/instance-protocol.md`: parsing one line, joining partial reads
//! into lines, and the rates and latency percentiles of a window. Touches nothing.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tracing::warn;

use super::{InstanceKey, MAX_RECENT_REPORTS, MAX_REPORT_LINE};

// ---------------------------------------------------------------------------------------------
// Reports

/// One report line: what one batch served.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Report {
    pub items: u64,
    /// The batch's latency (its slowest request, or a percentile inside the batch).
    pub latency_ms: f64,
    /// How long the batch's requests waited before it started.
    #[serde(default)]
    pub queue_ms: Option<f64>,
}

/// Parses one report line (`{"items":N,"latency_ms":X}`, optional `"queue_ms"`; unknown fields
/// are ignored, so the protocol can grow).
pub fn parse_report(line: &[u8]) -> Result<Report, String> {
    let r: Report = serde_json::from_slice(line).map_err(|e| e.to_string())?;
    let bad = |x: f64| !x.is_finite() || x < 0.0;
    if bad(r.latency_ms) || r.queue_ms.is_some_and(bad) {
        return Err("latency_ms and queue_ms must be finite and not negative".to_string());
    }
    Ok(r)
}

/// An instance's reports: the recent ones (for rates and percentiles) and totals.
#[derive(Debug, Default)]
pub(super) struct ReportLog {
    pub(super) recent: VecDeque<(Instant, Report)>,
    pub(super) items_total: u64,
    pub(super) reports_total: u64,
    pub(super) bad_total: u64,
    /// The start of a line whose end has not arrived.
    pub(super) partial: Vec<u8>,
    /// The current line grew past [`MAX_REPORT_LINE`]: skip to its end.
    pub(super) discarding: bool,
    /// A bad line was logged (once per instance run: a broken client would flood the log).
    pub(super) warned: bool,
}

impl ReportLog {
    /// Takes bytes read from the pipe; returns the number of good lines.
    pub(super) fn feed(&mut self, key: &InstanceKey, bytes: &[u8], now: Instant) -> u64 {
        let mut good = 0;
        let mut rest = bytes;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(nl);
            rest = tail.get(1..).unwrap_or_default();
            if self.discarding {
                self.discarding = false;
                self.partial.clear();
                continue;
            }
            let line: &[u8] = if self.partial.is_empty() {
                head
            } else {
                self.partial.extend_from_slice(head);
                &self.partial
            };
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.iter().all(u8::is_ascii_whitespace) {
                self.partial.clear();
                continue;
            }
            match parse_report(line) {
                Ok(r) => {
                    if self.recent.len() >= MAX_RECENT_REPORTS {
                        self.recent.pop_front();
                    }
                    self.recent.push_back((now, r));
                    self.items_total = self.items_total.saturating_add(r.items);
                    self.reports_total += 1;
                    good += 1;
                }
                Err(e) => {
                    self.bad_total += 1;
                    if !self.warned {
                        self.warned = true;
                        warn!(
                            instance = %key,
                            "bad report line '{}': {e} (see docs/instance-protocol.md; further \
                             bad lines are only counted)",
                            String::from_utf8_lossy(line)
                        );
                    }
                }
            }
            self.partial.clear();
        }
        if !self.discarding {
            self.partial.extend_from_slice(rest);
            if self.partial.len() > MAX_REPORT_LINE {
                self.partial.clear();
                self.discarding = true;
                self.bad_total += 1;
            }
        }
        good
    }

    pub(super) fn trim(&mut self, now: Instant, window: Duration) {
        while let Some((at, _)) = self.recent.front() {
            if now.saturating_duration_since(*at) > window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
    }

    /// A new process: its measurements start afresh (totals are kept).
    pub(super) fn restart(&mut self) {
        self.recent.clear();
        self.partial.clear();
        self.discarding = false;
        self.warned = false;
    }

    /// The reports of the window ending `now` (or since `since`, for a younger process), and
    /// the span that is.
    fn in_window(
        &self,
        now: Instant,
        window: Duration,
        since: Option<Instant>,
    ) -> (Duration, impl Iterator<Item = &Report>) {
        let from = now.checked_sub(window).unwrap_or(now);
        let from = since.map_or(from, |s| s.max(from));
        let reports = self
            .recent
            .iter()
            .filter(move |(at, _)| *at >= from)
            .map(|(_, r)| r);
        (now.saturating_duration_since(from), reports)
    }

    pub(super) fn summary(
        &self,
        now: Instant,
        window: Duration,
        since: Option<Instant>,
    ) -> WindowSummary {
        let (span, reports) = self.in_window(now, window, since);
        let mut items = 0u64;
        let mut latency = Vec::new();
        let mut queue = Vec::new();
        for r in reports {
            items = items.saturating_add(r.items);
            latency.push((r.latency_ms, r.items));
            if let Some(q) = r.queue_ms {
                queue.push((q, r.items));
            }
        }
        let secs = span.as_secs_f64();
        WindowSummary {
            span,
            reports: u64::try_from(latency.len()).unwrap_or(u64::MAX),
            items_per_s: if secs > 0.0 { items as f64 / secs } else { 0.0 },
            p50: weighted_percentile(&mut latency, 500),
            p99: weighted_percentile(&mut latency, 990),
            queue_p99: weighted_percentile(&mut queue, 990),
        }
    }
}

/// Batch latency percentiles over several instances' windows pooled: every batch of every
/// instance counts once, weighted by its items, as the job's requests see them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PooledLatency {
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Batches pooled: the samples the percentiles come from.
    pub batches: u64,
}

/// [`PooledLatency`] over `logs`' windows ending `now` (each log with its process's start, for
/// one younger than the window). None when no batch was reported in them.
pub(super) fn pooled<'a>(
    logs: impl IntoIterator<Item = (&'a ReportLog, Option<Instant>)>,
    now: Instant,
    window: Duration,
) -> Option<PooledLatency> {
    let mut latency = Vec::new();
    for (log, since) in logs {
        let (_, reports) = log.in_window(now, window, since);
        latency.extend(reports.map(|r| (r.latency_ms, r.items)));
    }
    let batches = u64::try_from(latency.len()).unwrap_or(u64::MAX);
    Some(PooledLatency {
        p50_ms: weighted_percentile(&mut latency, 500)?,
        p99_ms: weighted_percentile(&mut latency, 990)?,
        batches,
    })
}

pub(super) struct WindowSummary {
    pub(super) span: Duration,
    /// Report lines (batches) in the window: the samples `p50` and `p99` come from.
    pub(super) reports: u64,
    pub(super) items_per_s: f64,
    pub(super) p50: Option<f64>,
    pub(super) p99: Option<f64>,
    pub(super) queue_p99: Option<f64>,
}

/// The per-mille percentile of values each standing for `weight` items (a batch's latency is
/// the latency of each of its items).
pub(super) fn weighted_percentile(samples: &mut [(f64, u64)], permille: u64) -> Option<f64> {
    let total: u128 = samples.iter().map(|&(_, w)| u128::from(w)).sum();
    if total == 0 {
        return None;
    }
    samples.sort_by(|a, b| a.0.total_cmp(&b.0));
    let rank = (total * u128::from(permille)).div_ceil(1000).max(1);
    let mut seen = 0u128;
    for &(v, w) in samples.iter() {
        seen += u128::from(w);
        if seen >= rank {
            return Some(v);
        }
    }
    samples.last().map(|&(v, _)| v)
}
