//! Job specs as they arrive over D-Bus: an `a{sv}` dictionary goes through `spec_from_dict`,
//! `owner_from_dict` and `JobSpec::validate`. Every refusal must be an error with a message,
//! never a panic.
//!
//! The input is either busctl's own text for the dictionary (what follows `'a{sv}'` on a
//! `busctl call ... RegisterJob` line, e.g. `2 kind s offline command as 1 /bin/w`: the seeds
//! in `corpus/spec_dict` are the examples of docs/dbus-api.md), or, when it is not, bytes that
//! `arbitrary` turns into a dictionary (keys mostly the documented ones, values of every D-Bus
//! type a caller can send, nested in variants).
#![no_main]

use std::collections::HashMap;

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use lodger::api::spec::{owner_from_dict, spec_from_dict, SPEC_KEYS};
use zbus::zvariant::{OwnedValue, Value};

#[derive(Debug, Arbitrary)]
enum Key {
    Known(u8),
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum FuzzValue {
    Bool(bool),
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
    I16(i16),
    I32(i32),
    I64(i64),
    F64(f64),
    Str(String),
    Strs(Vec<String>),
    U32s(Vec<u32>),
    I64s(Vec<i64>),
    F64s(Vec<f64>),
    Bools(Vec<bool>),
    /// A value wrapped in a variant (`v` inside the `v` of `a{sv}`).
    Variant(Box<FuzzValue>),
}

/// The D-Bus specification limits a message to 64 nested containers (zbus enforces it when it
/// decodes one): deeper variants never reach lodger, so the harness builds none.
const MAX_DEPTH: usize = 64;

impl FuzzValue {
    fn into_value(self, depth: usize) -> Value<'static> {
        match self {
            FuzzValue::Bool(b) => Value::from(b),
            FuzzValue::U8(n) => Value::from(n),
            FuzzValue::U16(n) => Value::from(n),
            FuzzValue::U32(n) => Value::from(n),
            FuzzValue::U64(n) => Value::from(n),
            FuzzValue::I16(n) => Value::from(n),
            FuzzValue::I32(n) => Value::from(n),
            FuzzValue::I64(n) => Value::from(n),
            FuzzValue::F64(x) => Value::from(x),
            FuzzValue::Str(s) => Value::from(s),
            FuzzValue::Strs(v) => Value::from(v),
            FuzzValue::U32s(v) => Value::from(v),
            FuzzValue::I64s(v) => Value::from(v),
            FuzzValue::F64s(v) => Value::from(v),
            FuzzValue::Bools(v) => Value::from(v),
            FuzzValue::Variant(_) if depth >= MAX_DEPTH => Value::from(0u32),
            FuzzValue::Variant(inner) => Value::Value(Box::new(inner.into_value(depth + 1))),
        }
    }
}

/// Longest array built from busctl text (its count is the fuzzer's).
const MAX_ARRAY: usize = 4096;

/// One value of signature `sig` in busctl's argument syntax.
fn busctl_value<'a>(
    sig: &str,
    tokens: &mut impl Iterator<Item = &'a str>,
    depth: usize,
) -> Option<Value<'static>> {
    fn array<'a, T>(
        n: usize,
        tokens: &mut impl Iterator<Item = &'a str>,
        parse: impl Fn(&str) -> Option<T>,
    ) -> Option<Vec<T>> {
        (0..n).map(|_| tokens.next().and_then(&parse)).collect()
    }
    let value = match sig {
        "s" => Value::from(tokens.next()?.to_string()),
        "b" => Value::from(busctl_bool(tokens.next()?)?),
        "y" => Value::from(tokens.next()?.parse::<u8>().ok()?),
        "q" => Value::from(tokens.next()?.parse::<u16>().ok()?),
        "n" => Value::from(tokens.next()?.parse::<i16>().ok()?),
        "u" => Value::from(tokens.next()?.parse::<u32>().ok()?),
        "i" => Value::from(tokens.next()?.parse::<i32>().ok()?),
        "t" => Value::from(tokens.next()?.parse::<u64>().ok()?),
        "x" => Value::from(tokens.next()?.parse::<i64>().ok()?),
        "d" => Value::from(tokens.next()?.parse::<f64>().ok()?),
        "v" if depth >= MAX_DEPTH => return None,
        "v" => {
            let inner = tokens.next()?;
            Value::Value(Box::new(busctl_value(inner, tokens, depth + 1)?))
        }
        _ => {
            let elem = sig.strip_prefix('a')?;
            let n = tokens.next()?.parse::<usize>().ok()?.min(MAX_ARRAY);
            match elem {
                "s" => Value::from(array(n, tokens, |t| Some(t.to_string()))?),
                "b" => Value::from(array(n, tokens, busctl_bool)?),
                "u" => Value::from(array(n, tokens, |t| t.parse::<u32>().ok())?),
                "i" => Value::from(array(n, tokens, |t| t.parse::<i32>().ok())?),
                "t" => Value::from(array(n, tokens, |t| t.parse::<u64>().ok())?),
                "x" => Value::from(array(n, tokens, |t| t.parse::<i64>().ok())?),
                "d" => Value::from(array(n, tokens, |t| t.parse::<f64>().ok())?),
                _ => return None,
            }
        }
    };
    Some(value)
}

fn busctl_bool(t: &str) -> Option<bool> {
    match t {
        "true" | "yes" | "1" => Some(true),
        "false" | "no" | "0" => Some(false),
        _ => None,
    }
}

/// busctl's text for an `a{sv}`: the entry count, then `key signature value...` per entry.
fn busctl_dict(text: &str) -> Option<Vec<(String, Value<'static>)>> {
    let mut tokens = text.split_ascii_whitespace();
    let n = tokens.next()?.parse::<usize>().ok()?;
    let mut entries = Vec::new();
    for _ in 0..n {
        let key = tokens.next()?.to_string();
        let sig = tokens.next()?;
        entries.push((key, busctl_value(sig, &mut tokens, 1)?));
    }
    tokens.next().is_none().then_some(entries)
}

fn arbitrary_dict(data: &[u8]) -> Option<Vec<(String, Value<'static>)>> {
    let entries = Vec::<(Key, FuzzValue)>::arbitrary_take_rest(Unstructured::new(data)).ok()?;
    Some(
        entries
            .into_iter()
            .map(|(key, value)| {
                let key = match key {
                    Key::Known(i) => SPEC_KEYS[usize::from(i) % SPEC_KEYS.len()].to_string(),
                    Key::Other(s) => s,
                };
                (key, value.into_value(1))
            })
            .collect(),
    )
}

fuzz_target!(|data: &[u8]| {
    let entries = std::str::from_utf8(data)
        .ok()
        .and_then(busctl_dict)
        .or_else(|| arbitrary_dict(data));
    let Some(entries) = entries else {
        return;
    };
    let mut dict = HashMap::new();
    for (key, value) in entries {
        // Values without file descriptors always convert.
        let Ok(value) = OwnedValue::try_from(value) else {
            return;
        };
        dict.insert(key, value);
    }
    if let Err(e) = owner_from_dict(&dict) {
        assert!(!e.is_empty());
    }
    match spec_from_dict(&dict) {
        Ok(spec) => {
            if let Err(e) = spec.validate() {
                assert!(!e.to_string().is_empty());
            }
        }
        Err(e) => assert!(!e.is_empty()),
    }
});
