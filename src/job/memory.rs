//! Memory sizes as operators and job owners write them (`512M`, `8G`, `10%`, `none`) and as
//! lodger shows them (`512 MiB`). Pure; touches nothing.
//!
//! Hand-written rather than a size crate's: the suffixes mean what systemd's `MemoryMax=` means
//! (K, M, G, T are powers of 1024, an optional `iB`/`B` after them), which the operators who
//! write lodger's config already write in unit files; the crates read `M` as 10^6.

use serde::{Serialize, Serializer};

/// The kernel keeps memory limits in whole pages.
const PAGE: u64 = 4096;

const UNITS: [(char, u32); 5] = [('K', 10), ('M', 20), ('G', 30), ('T', 40), ('P', 50)];

/// Bytes from `"4096"`, `"512M"`, `"512MiB"`, `"1.5G"`, `"8 GiB"` (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = || {
        format!("'{text}' is not a size: give bytes or a number with K, M, G or T (e.g. 512M, 8G)")
    };
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (number, shift) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let up = c.to_ascii_uppercase();
            let shift = UNITS
                .iter()
                .find(|(u, _)| *u == up)
                .map(|(_, s)| *s)
                .ok_or_else(bad)?;
            (t[..t.len() - 1].trim_end(), shift)
        }
        _ => (t, 0),
    };
    if number.is_empty()
        || !number.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        || number.bytes().filter(|&b| b == b'.').count() > 1
    {
        return Err(bad());
    }
    let value: f64 = number.parse().map_err(|_| bad())?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("'{text}' is too large"));
    }
    // Whole bytes: a fraction of a byte is meaningless to the kernel.
    Ok(bytes as u64)
}

/// `"512 MiB"`, `"2.5 GiB"`, `"100 B"`: the largest unit the size has at least one of.
pub fn show_size(bytes: u64) -> String {
    for &(unit, shift) in UNITS.iter().rev() {
        let one = 1u64 << shift;
        if bytes >= one {
            let v = bytes as f64 / one as f64;
            return if bytes % one == 0 {
                format!("{} {unit}iB", bytes / one)
            } else {
                format!("{v:.1} {unit}iB")
            };
        }
    }
    format!("{bytes} B")
}

/// A memory bound as the config gives it: a size, a share of the node's memory, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryBound {
    Bytes(u64),
    /// Percent of the node's memory (`MemTotal`), 1 to 100.
    Percent(u8),
    None,
}

impl MemoryBound {
    /// `"8G"`, `"10%"`, `"none"` (or `"max"`, as cgroup v2 writes it).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("none") || t.eq_ignore_ascii_case("max") {
            return Ok(MemoryBound::None);
        }
        if let Some(p) = t.strip_suffix('%') {
            return match p.trim().parse::<u8>() {
                Ok(n) if (1..=100).contains(&n) => Ok(MemoryBound::Percent(n)),
                _ => Err(format!(
                    "'{text}' is not a share of the node's memory: give 1% to 100%"
                )),
            };
        }
        match parse_size(t)? {
            0 => Err(format!(
                "'{text}' is no memory at all: give a size, a share or none"
            )),
            n => Ok(MemoryBound::Bytes(n)),
        }
    }

    /// Bytes on a node with `total` bytes of memory (a share down to a whole page); `None` for
    /// no bound.
    pub fn resolve(self, total: u64) -> Option<u64> {
        match self {
            MemoryBound::Bytes(n) => Some(n),
            MemoryBound::Percent(p) => Some(total / 100 * u64::from(p) / PAGE * PAGE),
            MemoryBound::None => None,
        }
    }
}

impl MemoryBound {
    /// As the config writes it, so that it reads back the same: `"8G"`, `"10%"`, `"none"`.
    pub fn spelling(self) -> String {
        match self {
            MemoryBound::Bytes(n) => {
                for &(unit, shift) in UNITS.iter().rev() {
                    if n % (1u64 << shift) == 0 {
                        return format!("{}{unit}", n >> shift);
                    }
                }
                n.to_string()
            }
            MemoryBound::Percent(p) => format!("{p}%"),
            MemoryBound::None => "none".to_string(),
        }
    }
}

impl Serialize for MemoryBound {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.spelling())
    }
}

impl std::fmt::Display for MemoryBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryBound::Bytes(n) => f.write_str(&show_size(*n)),
            MemoryBound::Percent(p) => write!(f, "{p}% of the node's memory"),
            MemoryBound::None => f.write_str("none"),
        }
    }
}

/// `memory.high` (v2) or the soft limit (v1) for a limit of `max`: `high_percent` of it, so
/// the kernel reclaims the instance's memory before its limit's OOM killer takes it; down to a
/// whole 4 KiB page, as the kernel keeps it (the value written reads back the same).
/// A batch job's `memory.high` as a share of its `memory.max`, in percent.
pub const BATCH_MEMORY_HIGH_PERCENT: u8 = 90;

pub fn high_of(max: u64, high_percent: u8) -> u64 {
    if high_percent >= 100 {
        return max;
    }
    max / 100 * u64::from(high_percent) / PAGE * PAGE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_systemd_reads_them() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("512 MB"), Ok(512 << 20));
        assert_eq!(parse_size("8g"), Ok(8 << 30));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        for bad in ["", "M", "12Q", "1.2.3G", "-1G", "ten", "1e9"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(parse_size("99999999P").is_err());
    }

    #[test]
    fn sizes_show_in_the_largest_whole_unit() {
        assert_eq!(show_size(512 << 20), "512 MiB");
        assert_eq!(show_size(3 << 29), "1.5 GiB");
        assert_eq!(show_size(100), "100 B");
    }

    #[test]
    fn bounds_are_sizes_shares_or_none() {
        assert_eq!(MemoryBound::parse("8G"), Ok(MemoryBound::Bytes(8 << 30)));
        assert_eq!(MemoryBound::parse("10%"), Ok(MemoryBound::Percent(10)));
        assert_eq!(MemoryBound::parse("none"), Ok(MemoryBound::None));
        assert_eq!(MemoryBound::parse("max"), Ok(MemoryBound::None));
        for bad in ["0", "0%", "101%", "x%"] {
            assert!(MemoryBound::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(MemoryBound::Percent(10).resolve(100 << 20), Some(10 << 20));
        assert_eq!(
            MemoryBound::Percent(10).resolve(1 << 34),
            Some(1_717_985_280)
        );
        assert_eq!(MemoryBound::None.resolve(1000), None);
        for text in ["8G", "1536M", "4097", "10%", "none"] {
            let b = MemoryBound::parse(text).unwrap();
            assert_eq!(b.spelling(), text);
        }
        assert_eq!(high_of(100 << 20, 90), 90 << 20);
        assert_eq!(high_of(96 << 20, 90), 90_595_328, "a whole page");
        assert_eq!(high_of(1000, 100), 1000);
    }
}
