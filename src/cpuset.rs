//! `CpuSet`: a set of CPU (or NUMA node) ids and the kernel's cpulist syntax (`0-3,8,10-11`).
//! Pure data; touches nothing.
//!
//! Written by hand: the kernel's list format is small, and the crates that parse it either pull
//! in a whole topology library or use fixed-size bitmaps that cap the CPU count. Held as a
//! bitmap sized to the highest id (192 CPUs: three words), so the set algebra the policy does
//! every tick is word operations and a clone is one small allocation (issue 21: as a `BTreeSet`
//! it was a tenth of a tick at 100 jobs on 192 CPUs).

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Highest id accepted from text. The kernel's NR_CPUS tops out at 8192; refusing larger ids keeps
/// a typo such as `0-4000000000` from allocating gigabytes.
pub const MAX_CPU_ID: u32 = 8191;

/// An ordered set of CPU ids (also used for NUMA node sets, e.g. `cpuset.mems`), at most
/// [`MAX_CPU_ID`]: a larger id is never held.
///
/// Words of 64 ids, lowest first, with no zero word at the end (so equal sets are equal
/// vectors). Ordered as the sorted sequences of their ids compare.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct CpuSet(Vec<u64>);

impl Ord for CpuSet {
    fn cmp(&self, other: &Self) -> Ordering {
        self.iter().cmp(other.iter())
    }
}

impl PartialOrd for CpuSet {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The ids of a [`CpuSet`], in order (either way).
#[derive(Debug, Clone)]
pub struct Iter<'a> {
    words: &'a [u64],
    /// Ids not yet yielded are in `lo..hi`.
    lo: u32,
    hi: u32,
}

impl Iter<'_> {
    /// The bits of word `w` inside `lo..hi`.
    fn window(&self, w: u32) -> u64 {
        let word = self.words.get(w as usize).copied().unwrap_or(0);
        let start = w * 64;
        let off = self.lo.saturating_sub(start);
        let low = if off >= 64 { 0 } else { !0u64 << off };
        let end = self.hi.saturating_sub(start);
        let high = match end {
            0 => 0,
            1..=63 => !0u64 >> (64 - end),
            _ => !0,
        };
        word & low & high
    }
}

impl Iterator for Iter<'_> {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        while self.lo < self.hi {
            let w = self.lo / 64;
            let bits = self.window(w);
            if bits != 0 {
                let id = w * 64 + bits.trailing_zeros();
                self.lo = id + 1;
                return Some(id);
            }
            self.lo = (w + 1) * 64;
        }
        None
    }
}

impl DoubleEndedIterator for Iter<'_> {
    fn next_back(&mut self) -> Option<u32> {
        while self.lo < self.hi {
            let w = (self.hi - 1) / 64;
            let bits = self.window(w);
            if bits != 0 {
                let id = w * 64 + 63 - bits.leading_zeros();
                self.hi = id;
                return Some(id);
            }
            self.hi = w * 64;
        }
        None
    }
}

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
        let mut set = Self::new();
        if trimmed.is_empty() {
            return Ok(set);
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
                    set.insert_range(lo, hi);
                }
                None => {
                    set.insert(num(item)?);
                }
            }
        }
        Ok(set)
    }

    /// Adds `cpu`; false when it was there, or is above [`MAX_CPU_ID`] (never held).
    pub fn insert(&mut self, cpu: u32) -> bool {
        if cpu > MAX_CPU_ID {
            return false;
        }
        let (w, bit) = ((cpu / 64) as usize, 1u64 << (cpu % 64));
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        let new = self.0[w] & bit == 0;
        self.0[w] |= bit;
        new
    }

    /// Adds `lo..=hi` a word at a time: `0-8191` is 128 word writes, not 8,192 inserts. Ids
    /// above [`MAX_CPU_ID`] are left out, as [`CpuSet::insert`] does.
    pub fn insert_range(&mut self, lo: u32, hi: u32) {
        let hi = hi.min(MAX_CPU_ID);
        if lo > hi {
            return;
        }
        let (first, last) = ((lo / 64) as usize, (hi / 64) as usize);
        if self.0.len() <= last {
            self.0.resize(last + 1, 0);
        }
        for w in first..=last {
            // The bits of word `w` within the range: from `lo`'s bit in the first word, up to
            // `hi`'s bit in the last.
            let from = if w == first { lo % 64 } else { 0 };
            let to = if w == last { hi % 64 } else { 63 };
            let mask = (u64::MAX >> (63 - to)) & (u64::MAX << from);
            self.0[w] |= mask;
        }
    }

    pub fn remove(&mut self, cpu: u32) -> bool {
        let (w, bit) = ((cpu / 64) as usize, 1u64 << (cpu % 64));
        let Some(word) = self.0.get_mut(w) else {
            return false;
        };
        let had = *word & bit != 0;
        *word &= !bit;
        self.trim();
        had
    }

    pub fn contains(&self, cpu: u32) -> bool {
        self.0
            .get((cpu / 64) as usize)
            .is_some_and(|w| w & (1u64 << (cpu % 64)) != 0)
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> Iter<'_> {
        Iter {
            words: &self.0,
            lo: 0,
            // At most 8192 ids: 128 words.
            hi: u32::try_from(self.0.len() * 64).unwrap_or(u32::MAX),
        }
    }

    pub fn first(&self) -> Option<u32> {
        self.iter().next()
    }

    pub fn union(&self, other: &CpuSet) -> CpuSet {
        let (long, short) = if self.0.len() >= other.0.len() {
            (self, other)
        } else {
            (other, self)
        };
        let mut words = long.0.clone();
        for (w, o) in words.iter_mut().zip(&short.0) {
            *w |= o;
        }
        Self(words)
    }

    pub fn intersection(&self, other: &CpuSet) -> CpuSet {
        let words = self.0.iter().zip(&other.0).map(|(a, b)| a & b).collect();
        Self::trimmed(words)
    }

    pub fn difference(&self, other: &CpuSet) -> CpuSet {
        let words = self
            .0
            .iter()
            .enumerate()
            .map(|(i, a)| a & !other.0.get(i).copied().unwrap_or(0))
            .collect();
        Self::trimmed(words)
    }

    pub fn is_subset(&self, other: &CpuSet) -> bool {
        self.0
            .iter()
            .enumerate()
            .all(|(i, a)| a & !other.0.get(i).copied().unwrap_or(0) == 0)
    }

    pub fn is_disjoint(&self, other: &CpuSet) -> bool {
        self.0.iter().zip(&other.0).all(|(a, b)| a & b == 0)
    }

    fn trimmed(words: Vec<u64>) -> Self {
        let mut set = Self(words);
        set.trim();
        set
    }

    /// Drops zero words at the end: the one form of each set.
    fn trim(&mut self) {
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
    }

    /// The cpulist form, e.g. `0-3,8`; the empty set is the empty string.
    pub fn to_list(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut iter = self.iter().peekable();
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
        let mut set = Self::new();
        set.extend(iter);
        set
    }
}

impl Extend<u32> for CpuSet {
    fn extend<T: IntoIterator<Item = u32>>(&mut self, iter: T) {
        for cpu in iter {
            self.insert(cpu);
        }
    }
}

impl<'a> IntoIterator for &'a CpuSet {
    type Item = u32;
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
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
    fn ids_above_the_kernel_maximum_are_never_held() {
        let mut s = CpuSet::new();
        assert!(!s.insert(MAX_CPU_ID + 1));
        assert!(!s.insert(u32::MAX));
        assert!(s.is_empty());
        assert!(s.insert(MAX_CPU_ID));
        assert_eq!(s.to_string(), "8191");
        assert!(!s.remove(u32::MAX));
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
        /// The bitmap against `BTreeSet` as the model: every operation, both iteration
        /// directions, the order.
        #[test]
        fn behaves_as_a_sorted_set(
            a in proptest::collection::btree_set(0u32..300, 0..80),
            b in proptest::collection::btree_set(0u32..300, 0..80),
        ) {
            let (x, y): (CpuSet, CpuSet) = (a.iter().copied().collect(), b.iter().copied().collect());
            let ids = |s: &CpuSet| s.iter().collect::<Vec<u32>>();
            prop_assert_eq!(ids(&x), a.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(
                x.iter().rev().collect::<Vec<_>>(),
                a.iter().rev().copied().collect::<Vec<_>>()
            );
            prop_assert_eq!(ids(&x.union(&y)), a.union(&b).copied().collect::<Vec<_>>());
            prop_assert_eq!(ids(&x.intersection(&y)), a.intersection(&b).copied().collect::<Vec<_>>());
            prop_assert_eq!(ids(&x.difference(&y)), a.difference(&b).copied().collect::<Vec<_>>());
            prop_assert_eq!(x.is_subset(&y), a.is_subset(&b));
            prop_assert_eq!(x.is_disjoint(&y), a.is_disjoint(&b));
            prop_assert_eq!(x.len(), a.len());
            prop_assert_eq!(x.first(), a.first().copied());
            prop_assert_eq!(x.cmp(&y), a.cmp(&b));
            prop_assert_eq!(x == y, a == b);
            // Mixed ends meet without repeating or losing an id.
            let mut it = x.iter();
            let mut seen = Vec::new();
            loop {
                match (it.next(), it.next_back()) {
                    (None, None) => break,
                    (f, bk) => seen.extend(f.into_iter().chain(bk)),
                }
            }
            seen.sort_unstable();
            prop_assert_eq!(seen, a.iter().copied().collect::<Vec<_>>());
            let mut z = x.clone();
            for id in &b {
                prop_assert_eq!(z.remove(*id), a.contains(id));
            }
            prop_assert_eq!(ids(&z), a.difference(&b).copied().collect::<Vec<_>>());
            prop_assert_eq!(z.is_empty(), a.difference(&b).next().is_none());
        }

        /// A range inserted a word at a time holds exactly the ids inserted one at a time,
        /// whatever the ends (within a word, across words, at the word edges, past the maximum)
        /// and whatever the set held before.
        #[test]
        fn a_range_is_its_ids_inserted_one_by_one(
            before in proptest::collection::btree_set(0u32..400, 0..20),
            lo in prop_oneof![0u32..400, Just(63u32), Just(64u32), Just(MAX_CPU_ID)],
            len in prop_oneof![0u32..300, Just(0u32), Just(1u32), Just(64u32), Just(u32::MAX - 400)],
        ) {
            let hi = lo.saturating_add(len);
            let mut ranged: CpuSet = before.iter().copied().collect();
            let mut single = ranged.clone();
            ranged.insert_range(lo, hi);
            for id in lo..=hi.min(MAX_CPU_ID + 1) {
                single.insert(id);
            }
            prop_assert_eq!(&ranged, &single);
            prop_assert_eq!(ranged.to_list(), single.to_list());
        }

        #[test]
        fn display_parse_round_trip(ids in proptest::collection::btree_set(0u32..512, 0..64)) {
            let set: CpuSet = ids.iter().copied().collect();
            let back = CpuSet::parse(&set.to_string()).unwrap();
            prop_assert_eq!(back, set);
        }
    }
}
