//! The emulator's CPU work: what a data loader does to a sample, in rows of an image, and the
//! calibration that turns a CPU-time target into an amount of it.
//!
//! A unit is one 64x64 image: decode it (generate it, or augment and shrink a 1 MiB sample with
//! `--loader-mib`), normalize it, convolve it with a 3x3 kernel. The work is done a row at a
//! time, so an amount of work can be a fraction of a unit, down to one row (1/64). Calibration
//! needs that: in an emulated guest a debug build takes 18-28 ms per unit, so a load of 2 ms
//! per batch rounded up to whole units would cost ten times its target there.

use std::hint::black_box;
use std::time::{Duration, Instant};

use lodger::rng::Rng;

/// Side of the square "image" one unit of work processes; a unit is this many rows.
pub const IMAGE_SIDE: usize = 64;
/// With `--loader-mib`: bytes of a sample one unit augments and shrinks to one pixel of its
/// image (four cache lines), so a sample is 1 MiB: a decoded 600x600 RGB picture, roughly.
const BYTES_PER_PIXEL: usize = 256;
const ROW_BYTES: usize = IMAGE_SIDE * BYTES_PER_PIXEL;
const SAMPLE_BYTES: usize = IMAGE_SIDE * ROW_BYTES;
const ROWS_PER_UNIT: f64 = IMAGE_SIDE as f64;
/// The most work per batch or per step, in units.
const MAX_UNITS: f64 = 1_000_000.0;

/// An amount of work, in rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    pub rows: u64,
}

impl Work {
    /// Whole or fractional units, to the nearest row.
    pub fn from_units(units: f64) -> Self {
        Self {
            // In range by the parsers and by calibration's clamp; `as` saturates anyway.
            rows: (units.clamp(0.0, MAX_UNITS) * ROWS_PER_UNIT).round() as u64,
        }
    }

    /// In units (exact: a row is 1/64 of one), as `--work-per-batch` takes it back.
    pub fn units(self) -> f64 {
        self.rows as f64 / ROWS_PER_UNIT
    }
}

/// Parses `--work-per-batch`: units, at least one row's worth.
pub fn parse_batch_units(text: &str) -> Result<Work, String> {
    parse_units(text, 1)
}

/// Parses `--dispatch-work`: units, possibly none.
pub fn parse_dispatch_units(text: &str) -> Result<Work, String> {
    parse_units(text, 0)
}

fn parse_units(text: &str, min_rows: u64) -> Result<Work, String> {
    let units: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number of units (e.g. 3 or 0.25)"))?;
    if !units.is_finite() || !(0.0..=MAX_UNITS).contains(&units) {
        return Err(format!("{text} units: must be between 0 and {MAX_UNITS}"));
    }
    let work = Work::from_units(units);
    if work.rows < min_rows {
        return Err(format!(
            "{text} units is less than one row of work (1/{IMAGE_SIDE} = {} units)",
            1.0 / ROWS_PER_UNIT
        ));
    }
    Ok(work)
}

/// With `--loader-mib`: a loader's samples in memory, which it decodes and augments in place.
struct SampleRing {
    bytes: Vec<u8>,
    /// Where the current sample starts.
    start: usize,
    /// The current sample's brightness jitter.
    jitter: u8,
}

impl SampleRing {
    fn new(bytes: usize, rng: &mut Rng) -> Self {
        // Written once here, so every page is real memory before the first batch.
        let mut bytes = vec![0u8; bytes.max(SAMPLE_BYTES)];
        for chunk in bytes.chunks_mut(8) {
            let random = rng.next_u64().to_le_bytes();
            chunk.copy_from_slice(&random[..chunk.len()]);
        }
        // `next_sample` moves to the first sample before the first row.
        let start = bytes.len();
        Self {
            bytes,
            start,
            jitter: 0,
        }
    }

    fn next_sample(&mut self, jitter: u8) {
        self.start += SAMPLE_BYTES;
        if self.start + SAMPLE_BYTES > self.bytes.len() {
            self.start = 0;
        }
        self.jitter = jitter;
    }

    /// Augments row `y` of the current sample in place (a brightness jitter: every byte is read
    /// and written back) and shrinks it into `row`, one pixel per 256 bytes. The sample comes
    /// through the memory system in both directions, sequentially (the prefetchers help, as
    /// they do for a real loader), and dominates the row's cost.
    fn augment_row(&mut self, y: usize, row: &mut [u8]) {
        let at = self.start + y * ROW_BYTES;
        let block = &mut self.bytes[at..at + ROW_BYTES];
        for (pixel, bytes) in row.iter_mut().zip(block.chunks_exact_mut(BYTES_PER_PIXEL)) {
            let mut sum = 0u8;
            for b in bytes.iter_mut() {
                *b = b.wrapping_add(self.jitter);
                sum = sum.wrapping_add(*b);
            }
            *pixel = sum;
        }
    }
}

/// One loader's buffers, reused across batches as a real loader reuses its pinned buffers.
pub struct Preprocessor {
    rng: Rng,
    samples: Option<SampleRing>,
    raw: Vec<u8>,
    normalized: Vec<f32>,
    convolved: Vec<f32>,
    /// The next row of the current image.
    row: usize,
}

impl Preprocessor {
    /// `sample_bytes`: the size of its sample ring (`--loader-mib`), if it has one.
    pub fn new(seed: u64, sample_bytes: Option<usize>) -> Self {
        let pixels = IMAGE_SIDE * IMAGE_SIDE;
        let mut rng = Rng::scrambled(seed);
        Self {
            samples: sample_bytes.map(|bytes| SampleRing::new(bytes, &mut rng)),
            rng,
            raw: vec![0; pixels],
            normalized: vec![0.0; pixels],
            convolved: vec![0.0; pixels],
            row: 0,
        }
    }

    /// Does `work`, carrying on from where the last call stopped, and returns a checksum the
    /// consumer uses.
    pub fn work(&mut self, work: Work) -> f32 {
        (0..work.rows).map(|_| self.next_row()).sum()
    }

    /// One row: decode it, normalize it, and convolve the row above it (whose neighbours are
    /// then all of this image), so an image's 64 rows do what one whole-image pass did.
    fn next_row(&mut self) -> f32 {
        let n = IMAGE_SIDE;
        let y = self.row;
        self.row = (y + 1) % n;
        let row = y * n..(y + 1) * n;
        // Decode (here: generate, or augment and shrink from the sample ring).
        match &mut self.samples {
            Some(ring) => {
                if y == 0 {
                    ring.next_sample(self.rng.next_u64().to_le_bytes()[0]);
                }
                ring.augment_row(y, &mut self.raw[row.clone()]);
            }
            None => {
                for chunk in self.raw[row.clone()].chunks_mut(8) {
                    let bytes = self.rng.next_u64().to_le_bytes();
                    chunk.copy_from_slice(&bytes[..chunk.len()]);
                }
            }
        }
        // ImageNet-style normalization: (x / 255 - mean) / std.
        const MEAN: f32 = 0.449;
        const STD: f32 = 0.226;
        for (out, &byte) in self.normalized[row.clone()].iter_mut().zip(&self.raw[row]) {
            *out = (f32::from(byte) / 255.0 - MEAN) / STD;
        }
        if y < 2 {
            return 0.0;
        }
        // A sharpening kernel over the interior of row y - 1.
        const KERNEL: [[f32; 3]; 3] = [[0.0, -1.0, 0.0], [-1.0, 5.0, -1.0], [0.0, -1.0, 0.0]];
        let cy = y - 1;
        let mut sum = 0.0f32;
        for x in 1..n - 1 {
            let mut acc = 0.0f32;
            for (ky, kernel_row) in KERNEL.iter().enumerate() {
                let base = (cy + ky - 1) * n + x - 1;
                for (kx, &k) in kernel_row.iter().enumerate() {
                    acc += k * self.normalized[base + kx];
                }
            }
            // ReLU, as the first layer of a network would apply.
            let v = acc.max(0.0);
            self.convolved[cy * n + x] = v;
            sum += v;
        }
        black_box(&self.convolved);
        sum / (n * n) as f32
    }
}

/// CPU time this thread has used. Calibration measures CPU time, not wall time, so that a
/// busy node at start does not change how much work a row is taken to be.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u32::try_from(ts.tv_nsec).unwrap_or(0);
    Duration::new(secs, nanos)
}

/// What one row of work costs on this machine and build, in CPU time, measured over about
/// 50 ms of CPU (and at least three images' worth of rows).
pub fn row_cost(sample_bytes: Option<usize>) -> Duration {
    let mut pre = Preprocessor::new(u64::MAX, sample_bytes);
    let budget = Duration::from_millis(50);
    let start = thread_cpu_time();
    let wall = Instant::now();
    let mut rows: u32 = 0;
    // Wall-clock guard: if the CPU clock is unavailable (reads zero), stop anyway.
    while (thread_cpu_time() - start < budget && wall.elapsed() < 4 * budget)
        || rows < 3 * IMAGE_SIDE as u32
    {
        black_box(pre.next_row());
        rows += 1;
    }
    let spent = (thread_cpu_time() - start).max(wall.elapsed().min(budget / 10));
    spent / rows
}

/// The work that costs about `target` of CPU at `per_row`, to the nearest row and at least
/// `min_rows`.
pub fn work_for(target: Duration, per_row: Duration, min_rows: u64) -> Work {
    let rows = (target.as_secs_f64() / per_row.as_secs_f64().max(1e-9)).round();
    Work {
        rows: (rows.min(MAX_UNITS * ROWS_PER_UNIT) as u64).max(min_rows),
    }
}

/// `given`, or else the work that costs about `target` of CPU here (at least `min_rows`),
/// measured now and said on stdout as `calibrated NAME=UNITS (...)` (the benches read
/// `work_per_batch=` back).
pub fn given_or_calibrated(
    given: Option<Work>,
    name: &str,
    target: Duration,
    sample_bytes: Option<usize>,
    min_rows: u64,
) -> Work {
    if let Some(work) = given {
        return work;
    }
    let per_row = row_cost(sample_bytes);
    let work = work_for(target, per_row, min_rows);
    println!(
        "calibrated {name}={} ({} rows; {:.1} us per row, ~{} us of CPU)",
        work.units(),
        work.rows,
        per_row.as_secs_f64() * 1e6,
        target.as_micros()
    );
    work
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_parse_to_rows_and_back() {
        assert_eq!(parse_batch_units("1").map(|w| w.rows), Ok(64));
        assert_eq!(parse_batch_units("0.25").map(|w| w.rows), Ok(16));
        assert_eq!(
            parse_batch_units("0.015625").map(|w| w.units()),
            Ok(0.015625)
        );
        assert!(parse_batch_units("0").is_err());
        assert!(parse_batch_units("0.001").is_err());
        assert_eq!(parse_dispatch_units("0").map(|w| w.rows), Ok(0));
        for bad in ["", "x", "-1", "NaN", "inf", "2000000"] {
            assert!(parse_batch_units(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn work_for_rounds_to_rows_with_a_floor() {
        let per_row = Duration::from_micros(400);
        assert_eq!(work_for(Duration::from_millis(2), per_row, 1).rows, 5);
        assert_eq!(work_for(Duration::from_micros(150), per_row, 0).rows, 0);
        assert_eq!(work_for(Duration::from_micros(150), per_row, 1).rows, 1);
    }

    #[test]
    fn sixty_four_rows_convolve_one_image_interior() {
        // Rows 1..=62 are convolved once per image, as the whole-image pass did.
        let mut pre = Preprocessor::new(7, None);
        pre.convolved.fill(-1.0);
        pre.work(Work { rows: 64 });
        let n = IMAGE_SIDE;
        let written = pre.convolved.iter().filter(|&&v| v != -1.0).count();
        assert_eq!(written, (n - 2) * (n - 2));
        assert_eq!(pre.row, 0);
    }

    #[test]
    fn the_sample_ring_advances_once_per_image() {
        let mut pre = Preprocessor::new(3, Some(3 * SAMPLE_BYTES));
        pre.work(Work { rows: 1 });
        assert_eq!(pre.samples.as_ref().map(|r| r.start), Some(0));
        pre.work(Work { rows: 64 });
        assert_eq!(pre.samples.as_ref().map(|r| r.start), Some(SAMPLE_BYTES));
        pre.work(Work { rows: 128 });
        assert_eq!(pre.samples.as_ref().map(|r| r.start), Some(0));
    }
}
