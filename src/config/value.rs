//! config::value: the checks and the enum vocabulary every section shares (integer ranges,
//! absolute paths, one-of-these-names enums). Pure: touches no file.

use std::ops::RangeInclusive;
use std::path::PathBuf;

/// Declares a config enum whose TOML spelling is given per variant, with `NAMES`, `as_str`,
/// `from_name`, `Display` and serde in that spelling.
macro_rules! named_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ::serde::Serialize, ::serde::Deserialize)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every accepted spelling, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text),+
                }
            }

            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($text => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
pub(super) use named_enum;

/// `value` when it is a finite number within `range`, else why not: "must be {what} from
/// {start} to {end} (got {value})".
pub(super) fn within(value: f64, range: RangeInclusive<f64>, what: &str) -> Result<f64, String> {
    if value.is_finite() && range.contains(&value) {
        Ok(value)
    } else {
        Err(format!(
            "must be {what} from {} to {} (got {value})",
            range.start(),
            range.end()
        ))
    }
}

pub(super) fn in_range<T: TryFrom<i64>>(
    value: i64,
    range: &RangeInclusive<i64>,
) -> Result<T, String> {
    let out_of_range = || {
        format!(
            "must be between {} and {} (got {value})",
            range.start(),
            range.end()
        )
    };
    if !range.contains(&value) {
        return Err(out_of_range());
    }
    T::try_from(value).map_err(|_| out_of_range())
}

pub(super) fn absolute(value: String) -> Result<PathBuf, String> {
    let path = PathBuf::from(&value);
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(format!("must be an absolute path (got \"{value}\")"))
    }
}

pub(super) fn one_of<T>(
    value: &str,
    from_name: fn(&str) -> Option<T>,
    names: &[&str],
) -> Result<T, String> {
    from_name(value).ok_or_else(|| format!("must be one of {} (got \"{value}\")", names.join(", ")))
}
