//! `CpuSet`: a set of CPU (or NUMA node) ids and the kernel's cpulist syntax (`0-3,8,10-11`).
//! Pure data; touches nothing.
//!
//! Written by hand: the kernel's list format is small, and the crates that parse it either pull
//! in a whole topology library or use fixed-size bitmaps that cap the CPU count.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Highest id accepted from text. The kernel's NR_CPUS tops out at 8192; refusing larger ids keeps
/// a typo such as `0-4000000000` from allocating gigabytes.
pub const MAX_CPU_ID: u32 = 8191;

/// An ordered set of CPU ids (also used for NUMA node sets, e.g. `cpuset.mems`).
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CpuSet(BTreeSet<u32>);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuListError {
    #[error("'{item}' in cpu list '{list}' is not a number or a range such as 2-5")]
    BadItem { list: String, item: String },
    #[error("range '{item}' in cpu list '{list}' runs backwards")]
    Backwards { list: String, item: String },
    #[error("cpu id {id} in cpu list '{list}' is larger than {MAX_CPU_ID}")]
    TooLarge { list: String, id: u32 },
}

impl CpuSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses the kernel's cpulist format. Whitespace and a trailing newline are ignored; an
    /// empty string is the empty set (as in an unset `cpuset.cpus`).
    pub fn parse(list: &str) -> Result<Self, CpuListError> {
        let trimmed = list.trim();
        let mut set = BTreeSet::new();
        if trimmed.is_empty() {
            return Ok(Self(set));
        }
        for raw in trimmed.split(',') {
            let item = raw.trim();
            let bad = || CpuListError::BadItem {
                list: trimmed.to_string(),
                item: item.to_string(),
            };
            let num = |s: &str| -> Result<u32, CpuListError> {
                let id: u32 = s.trim().parse().map_err(|_| bad())?;
                if id > MAX_CPU_ID {
                    return Err(CpuListError::TooLarge {
                        list: trimmed.to_string(),
                        id,
                    });
                }
                Ok(id)
            };
            match item.split_once('-') {
                Some((lo, hi)) => {
                    let (lo, hi) = (num(lo)?, num(hi)?);
                    if lo > hi {
                        return Err(CpuListError::Backwards {
                            list: trimmed.to_string(),
                            item: item.to_string(),
                        });
                    }
                    set.extend(lo..=hi);
                }
                None => {
                    set.insert(num(item)?);
                }
            }
        }
        Ok(Self(set))
    }

    pub fn insert(&mut self, cpu: u32) -> bool {
        self.0.insert(cpu)
    }

    pub fn remove(&mut self, cpu: u32) -> bool {
        self.0.remove(&cpu)
    }

    pub fn contains(&self, cpu: u32) -> bool {
        self.0.contains(&cpu)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    pub fn first(&self) -> Option<u32> {
        self.0.first().copied()
    }

    pub fn union(&self, other: &CpuSet) -> CpuSet {
        Self(self.0.union(&other.0).copied().collect())
    }

    pub fn intersection(&self, other: &CpuSet) -> CpuSet {
        Self(self.0.intersection(&other.0).copied().collect())
    }

    pub fn difference(&self, other: &CpuSet) -> CpuSet {
        Self(self.0.difference(&other.0).copied().collect())
    }

    pub fn is_subset(&self, other: &CpuSet) -> bool {
        self.0.is_subset(&other.0)
    }

    pub fn is_disjoint(&self, other: &CpuSet) -> bool {
        self.0.is_disjoint(&other.0)
    }

    /// The cpulist form, e.g. `0-3,8`; the empty set is the empty string.
    pub fn to_list(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut iter = self.0.iter().copied().peekable();
        let mut first = true;
        while let Some(lo) = iter.next() {
            let mut hi = lo;
            while iter.peek() == Some(&(hi + 1)) {
                hi += 1;
                iter.next();
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if lo == hi {
                write!(f, "{lo}")?;
            } else {
                write!(f, "{lo}-{hi}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuSet({self})")
    }
}

impl FromStr for CpuSet {
    type Err = CpuListError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl FromIterator<u32> for CpuSet {
    fn from_iter<T: IntoIterator<Item = u32>>(iter: T) -> Self {
        Self(iter.into_iter().collect())
    }
}

impl Extend<u32> for CpuSet {
    fn extend<T: IntoIterator<Item = u32>>(&mut self, iter: T) {
        self.0.extend(iter)
    }
}

impl<'a> IntoIterator for &'a CpuSet {
    type Item = u32;
    type IntoIter = std::iter::Copied<std::collections::btree_set::Iter<'a, u32>>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().copied()
    }
}

/// Serialized as the cpulist string, so state files and JSON output read like the kernel's files.
impl Serialize for CpuSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for CpuSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        CpuSet::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_kernel_forms() {
        let cases = [
            ("", ""),
            ("\n", ""),
            ("0", "0"),
            ("0-3\n", "0-3"),
            ("0-3,8,10-11", "0-3,8,10-11"),
            ("3,1,2", "1-3"),
            ("0,0,0-1", "0-1"),
            (" 4 - 5 , 7 ", "4-5,7"),
        ];
        for (input, want) in cases {
            let set = CpuSet::parse(input).expect(input);
            assert_eq!(set.to_string(), want, "input {input:?}");
        }
    }

    #[test]
    fn refuses_garbage() {
        assert!(matches!(
            CpuSet::parse("a"),
            Err(CpuListError::BadItem { .. })
        ));
        assert!(matches!(
            CpuSet::parse("1,,2"),
            Err(CpuListError::BadItem { .. })
        ));
        assert!(matches!(
            CpuSet::parse("5-2"),
            Err(CpuListError::Backwards { .. })
        ));
        assert!(matches!(
            CpuSet::parse("0-4000000000"),
            Err(CpuListError::TooLarge { .. })
        ));
        assert!(matches!(
            CpuSet::parse("-1"),
            Err(CpuListError::BadItem { .. })
        ));
    }

    #[test]
    fn set_algebra() {
        let a = CpuSet::parse("0-5").unwrap();
        let b = CpuSet::parse("4-7").unwrap();
        assert_eq!(a.union(&b).to_string(), "0-7");
        assert_eq!(a.intersection(&b).to_string(), "4-5");
        assert_eq!(a.difference(&b).to_string(), "0-3");
        assert!(CpuSet::parse("1-2").unwrap().is_subset(&a));
        assert!(CpuSet::parse("6").unwrap().is_disjoint(&a));
    }

    #[test]
    fn serde_round_trip_as_string() {
        let a = CpuSet::parse("0-3,9").unwrap();
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, "\"0-3,9\"");
        let back: CpuSet = serde_json::from_str(&json).unwrap();
        assert_eq!(back, a);
    }

    proptest! {
        #[test]
        fn display_parse_round_trip(ids in proptest::collection::btree_set(0u32..512, 0..64)) {
            let set: CpuSet = ids.iter().copied().collect();
            let back = CpuSet::parse(&set.to_string()).unwrap();
            prop_assert_eq!(back, set);
        }
    }
}
