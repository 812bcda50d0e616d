//! config::error: what can be wrong with a config file, each error naming the file, the line
//! and the dotted key; and how the TOML parser's and serde's messages are turned into those
//! errors (the key path is found by looking the error's span up in the parsed tree). Pure.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::Cx;

/// A place in a config file. `path` is `None` for the built-in defaults; `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub path: Option<PathBuf>,
    pub line: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.path, self.line) {
            (Some(path), Some(line)) => write!(f, "{}:{line}", path.display()),
            (Some(path), None) => write!(f, "{}", path.display()),
            (None, _) => f.write_str("built-in defaults"),
        }
    }
}

/// Everything that can be wrong with a config. Each displays as one line starting with
/// `file:line:`, e.g. `/etc/lodger/lodger.toml:12: training.rt_priority: must be between 1 and
/// 99 (got 0)`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read config file: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Not valid TOML.
    #[error("{at}: invalid TOML: {message}")]
    Syntax { at: Location, message: String },
    /// A key (or table) given twice. `key` is the dotted path.
    #[error("{at}: {key}: duplicate key")]
    DuplicateKey { at: Location, key: String },
    /// A key the schema does not have. `table` is `[agent]`, `[[node.gpu]]`, or empty for the
    /// top level.
    #[error("{at}: unknown key '{key}' {}; expected one of {}", in_table(.table), .expected.join(", "))]
    UnknownKey {
        at: Location,
        table: String,
        key: String,
        expected: Vec<String>,
    },
    /// A value of the wrong type or out of its range. `key` is the dotted path, with array
    /// indices (`node.gpu[1].numa_node`).
    #[error("{at}: {key}: {message}")]
    Invalid {
        at: Location,
        key: String,
        message: String,
    },
}

fn in_table(table: &str) -> String {
    if table.is_empty() {
        "at the top level".to_string()
    } else {
        format!("in {table}")
    }
}

impl ConfigError {
    /// Where the error is, if it is inside a file that was read.
    pub fn location(&self) -> Option<&Location> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Syntax { at, .. }
            | ConfigError::DuplicateKey { at, .. }
            | ConfigError::UnknownKey { at, .. }
            | ConfigError::Invalid { at, .. } => Some(at),
        }
    }

    /// The 1-based line the error points at.
    pub fn line(&self) -> Option<usize> {
        self.location().and_then(|at| at.line)
    }

    /// The dotted path of the offending key, e.g. `agent.intervall`.
    pub fn key(&self) -> Option<String> {
        match self {
            ConfigError::Read { .. } | ConfigError::Syntax { .. } => None,
            ConfigError::DuplicateKey { key, .. } | ConfigError::Invalid { key, .. } => {
                Some(key.clone())
            }
            ConfigError::UnknownKey { table, key, .. } => {
                let table = table.trim_matches(|c| c == '[' || c == ']');
                Some(if table.is_empty() {
                    key.clone()
                } else {
                    format!("{table}.{key}")
                })
            }
        }
    }
}

impl Cx<'_> {
    /// The document is not valid TOML (or repeats a key, which the parser reports).
    pub(super) fn parse_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span();
        let at = self.at(span.clone());
        match span {
            Some(span) if e.message() == "duplicate key" => ConfigError::DuplicateKey {
                at,
                key: self.duplicate_key_path(span),
            },
            _ => ConfigError::Syntax {
                at,
                message: e.message().to_string(),
            },
        }
    }

    /// The parser stops at a repeated key without saying which table it is in, so the table
    /// is recovered from the nearest header above it. Best effort: only the key name is
    /// affected if this guesses wrong, never the line.
    pub(super) fn duplicate_key_path(&self, span: Range<usize>) -> String {
        let key = self
            .text
            .get(span.clone())
            .unwrap_or("")
            .trim()
            .trim_matches(|c| c == '"' || c == '\'')
            .to_string();
        let line_start = self.text[..span.start.min(self.text.len())]
            .rfind('\n')
            .map_or(0, |i| i + 1);
        let here = self.text[line_start..].lines().next().unwrap_or("");
        if let Some(header) = table_header(here) {
            // The repeated thing is a table header: its name is the whole path.
            return header;
        }
        match self.text[..line_start].lines().rev().find_map(table_header) {
            Some(table) => format!("{table}.{key}"),
            None => key,
        }
    }

    /// The document is TOML but does not fit the schema: an unknown key or a value of the
    /// wrong type. Serde reports the span but not the key path, so the path is found by
    /// looking the span up in the parsed tree.
    pub(super) fn serde_error(&self, e: &toml::de::Error, tree: &DeTable<'_>) -> ConfigError {
        let span = e.span();
        let at = self.at(span.clone());
        let path = span.and_then(|s| locate(tree, s.start)).unwrap_or_default();
        let message = e.message();
        if let Some((key, expected)) = unknown_field(message) {
            let table = path.split_last().map_or(&[][..], |(_, t)| t);
            return ConfigError::UnknownKey {
                at,
                table: table_display(table),
                key,
                expected,
            };
        }
        if path.is_empty() {
            return ConfigError::Syntax {
                at,
                message: message.to_string(),
            };
        }
        ConfigError::Invalid {
            at,
            key: key_display(&path),
            message: type_message(message),
        }
    }
}

/// One step of a key path: a table key or an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

fn key_display(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

/// `[agent]`, or `[[node.gpu]]` for a table inside an array of tables; empty for the top.
fn table_display(table: &[Seg]) -> String {
    if table.is_empty() {
        return String::new();
    }
    let keys: Vec<&str> = table
        .iter()
        .filter_map(|s| match s {
            Seg::Key(k) => Some(k.as_str()),
            Seg::Index(_) => None,
        })
        .collect();
    if matches!(table.last(), Some(Seg::Index(_))) {
        format!("[[{}]]", keys.join("."))
    } else {
        format!("[{}]", keys.join("."))
    }
}

fn span_holds(span: &Range<usize>, offset: usize) -> bool {
    span.contains(&offset) || (span.is_empty() && span.start == offset)
}

/// The path of the innermost key whose key or value span holds `offset`.
fn locate(table: &DeTable<'_>, offset: usize) -> Option<Vec<Seg>> {
    for (key, value) in table.iter() {
        let here = Seg::Key(key.get_ref().to_string());
        if let Some(mut inner) = locate_in(value, offset) {
            inner.insert(0, here);
            return Some(inner);
        }
        if span_holds(&key.span(), offset) || span_holds(&value.span(), offset) {
            return Some(vec![here]);
        }
    }
    None
}

fn locate_in(value: &Spanned<DeValue<'_>>, offset: usize) -> Option<Vec<Seg>> {
    match value.get_ref() {
        DeValue::Table(table) => locate(table, offset),
        DeValue::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            if let Some(mut inner) = locate_in(item, offset) {
                inner.insert(0, Seg::Index(i));
                Some(inner)
            } else if span_holds(&item.span(), offset) {
                Some(vec![Seg::Index(i)])
            } else {
                None
            }
        }),
        _ => None,
    }
}

/// `[a.b]` or `[[a.b]]` (with an optional trailing comment) → `a.b`.
fn table_header(line: &str) -> Option<String> {
    let line = line.trim();
    let inner = line.strip_prefix('[')?;
    let inner = inner.strip_prefix('[').unwrap_or(inner);
    let end = inner.find(']')?;
    let name: String = inner[..end]
        .split('.')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(".");
    (!name.is_empty()).then_some(name)
}

/// Serde's "unknown field `x`, expected one of `a`, `b`" → (x, [a, b]).
fn unknown_field(message: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    Some((key.to_string(), expected))
}

/// Serde's "invalid type: string \"x\", expected i64" → "expected an integer, got string \"x\"".
fn type_message(message: &str) -> String {
    let Some(rest) = message.strip_prefix("invalid type: ") else {
        return message.to_string();
    };
    let Some((got, expected)) = rest.rsplit_once(", expected ") else {
        return message.to_string();
    };
    let expected = match expected {
        "i64" => "an integer",
        "a sequence" => "an array",
        other => other,
    };
    if expected == "an integer" && got.starts_with("integer") {
        // An integer beyond i64 (toml reports it as i128).
        let digits = got.split('`').nth(1).unwrap_or(got);
        return format!("integer {digits} is out of range");
    }
    let got = match got {
        "sequence" => "an array",
        "map" => "a table",
        other => other,
    };
    format!("expected {expected}, got {got}")
}
