//! Job ids (`j<N>`): how lodger names a job to callers and in its files, and how maps key jobs.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A job's id: `j<N>`, unique for the life of the state directory. Kept to `[a-z0-9]` so it is a
/// valid D-Bus object path element (`/org/lodger1/job/j7`). Compared, hashed and ordered by its
/// number (j2 before j10), and its text shared, not copied: every tick and sensing pass keys maps
/// by it, and comparing and copying the text was a fifth of an idle lodgerd's tick (issue 21).
#[derive(Clone)]
pub struct JobId {
    seq: u64,
    text: Arc<str>,
}

impl PartialEq for JobId {
    fn eq(&self, other: &Self) -> bool {
        self.seq == other.seq
    }
}

impl Eq for JobId {}

impl std::hash::Hash for JobId {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.seq.hash(h);
    }
}

impl Ord for JobId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.seq.cmp(&other.seq)
    }
}

impl PartialOrd for JobId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("JobId").field(&&*self.text).finish()
    }
}

impl Serialize for JobId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for JobId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| {
            serde::de::Error::custom(format!("`{s}` is not a job id (j followed by its number)"))
        })
    }
}

impl JobId {
    pub fn from_seq(seq: u64) -> Self {
        Self {
            seq,
            text: format!("j{seq}").into(),
        }
    }

    /// Accepts an id given by a caller (D-Bus, CLI), refusing anything that is not `j<N>` as
    /// lodger writes it (no leading zero, at most 19 digits).
    pub fn parse(s: &str) -> Option<Self> {
        let digits = s.strip_prefix('j')?;
        if digits.is_empty()
            || digits.len() > 19
            || (digits.len() > 1 && digits.starts_with('0'))
            || !digits.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        Some(Self {
            seq: digits.parse().ok()?,
            text: s.into(),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Numeric part, used to keep placement order stable (j2 before j10).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_refuse_paths() {
        let id = JobId::from_seq(42);
        assert_eq!(id.as_str(), "j42");
        assert_eq!(JobId::parse("j42"), Some(id.clone()));
        assert_eq!(id.seq(), 42);
        for bad in [
            "",
            "j",
            "42",
            "j4a",
            "j/1",
            "J1",
            "j-1",
            "j123456789012345678901",
            "j07",
            "j00",
        ] {
            assert_eq!(JobId::parse(bad), None, "{bad}");
        }
        assert_eq!(JobId::parse("j0").map(|j| j.seq()), Some(0));
        let longest = JobId::parse("j9999999999999999999").expect("19 digits");
        assert_eq!(longest.seq(), 9_999_999_999_999_999_999);
    }

    /// Ids order by number (j2 before j10), in maps too, and read back only as lodger writes
    /// them.
    #[test]
    fn ids_order_by_number_and_deserialize_strictly() {
        let mut ids: Vec<JobId> = ["j10", "j2", "j1"]
            .iter()
            .filter_map(|s| JobId::parse(s))
            .collect();
        ids.sort();
        let texts: Vec<&str> = ids.iter().map(JobId::as_str).collect();
        assert_eq!(texts, ["j1", "j2", "j10"]);
        let map: std::collections::BTreeMap<JobId, u32> =
            serde_json::from_str(r#"{"j10": 10, "j9": 9}"#).expect("map");
        assert_eq!(map.keys().map(JobId::seq).collect::<Vec<_>>(), [9, 10]);
        assert_eq!(
            serde_json::to_string(&map).expect("json"),
            r#"{"j9":9,"j10":10}"#
        );
        let err = serde_json::from_str::<JobId>(r#""j07""#).expect_err("not an id");
        assert!(err.to_string().contains("`j07` is not a job id"), "{err}");
        assert!(serde_json::from_str::<JobId>(r#""x1""#).is_err());
    }
}
