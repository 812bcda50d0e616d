//! How lodgerctl shows what lodgerd answers: `a{sv}` values as text for people (control
//! characters escaped) or as JSON, and aligned tables.

use std::collections::HashMap;

use zbus::zvariant::{OwnedValue, Value};

/// Renders an `a{sv}` value for people: strings bare (their control characters escaped, see
/// [`printable`]), lists comma-separated.
pub(crate) fn show_value(v: &Value<'_>) -> String {
    match v {
        Value::F64(x) => format!("{x:.2}"),
        Value::Str(s) => printable(s),
        Value::Array(a) => a.iter().map(show_value).collect::<Vec<_>>().join(","),
        Value::Bool(b) => if *b { "yes" } else { "no" }.to_string(),
        Value::U32(n) => n.to_string(),
        Value::I32(n) => n.to_string(),
        Value::U64(n) => n.to_string(),
        Value::I64(n) => n.to_string(),
        Value::Value(inner) => show_value(inner),
        other => other.to_string(),
    }
}

/// `s` with its control characters escaped as systemctl shows them (`\n`, `\t`, `\x1b`): what
/// lodgerd answers carries text other users chose (an instance's command, a cgroup's path, a
/// message naming them), and written raw to a terminal an escape sequence in it would act on
/// the terminal of whoever runs `lodgerctl show` (root included), and a newline would forge
/// lines of the output.
pub(crate) fn printable(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            // Control characters are all below U+00A0: two hex digits each.
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

pub(crate) fn to_json(v: &Value<'_>) -> serde_json::Value {
    match v {
        Value::F64(x) => serde_json::Number::from_f64(*x)
            .map(serde_json::Value::Number)
            .unwrap_or(serde_json::Value::Null),
        Value::Dict(d) => {
            serde_json::Value::Object(d.iter().map(|(k, v)| (show_value(k), to_json(v))).collect())
        }
        Value::Str(s) => serde_json::Value::from(s.as_str()),
        Value::Array(a) => serde_json::Value::Array(a.iter().map(to_json).collect()),
        Value::Bool(b) => serde_json::Value::from(*b),
        Value::U32(n) => serde_json::Value::from(*n),
        Value::I32(n) => serde_json::Value::from(*n),
        Value::U64(n) => serde_json::Value::from(*n),
        Value::I64(n) => serde_json::Value::from(*n),
        Value::Value(inner) => to_json(inner),
        other => serde_json::Value::from(other.to_string()),
    }
}

pub(crate) fn dict_to_json(d: &HashMap<String, OwnedValue>) -> serde_json::Value {
    serde_json::Value::Object(d.iter().map(|(k, v)| (k.clone(), to_json(v))).collect())
}

pub(crate) fn get(d: &HashMap<String, OwnedValue>, k: &str) -> String {
    match (k, d.get(k).map(|v| &**v)) {
        // A command reads as the shell line it is.
        ("command", Some(Value::Array(a))) => {
            a.iter().map(show_value).collect::<Vec<_>>().join(" ")
        }
        (_, v) => v.map(show_value).unwrap_or_default(),
    }
}

/// A job's field as `lodgerctl show` prints it: as [`get`] renders it, but a `cores` of 0 says
/// what it means (a batch job without --cores: every leftover CPU; a Slurm training job: all of
/// its Slurm cpuset) rather than "0", an empty CPU or GPU list is "-" as in `status`, and an
/// online job's core budget is "N cores".
pub(crate) fn shown_field(d: &HashMap<String, OwnedValue>, key: &str) -> String {
    let v = get(d, key);
    match key {
        "cores" if v == "0" => match get(d, "kind").as_str() {
            "batch" => "no cap (every leftover CPU)".into(),
            _ if d.contains_key("slurm_job") => "all of its Slurm cpuset".into(),
            _ => v,
        },
        "cpus" | "gpus" | "mems" if v.is_empty() => "-".into(),
        // An online job's share of the leftover, what its layout search runs within: logical
        // CPUs (whole cores of them on an SMT host), as its layout counts them.
        "core_budget" if v == "1" => "1 CPU".into(),
        "core_budget" if !v.is_empty() => format!("{v} CPUs"),
        _ => v,
    }
}

/// `lodgerctl list`'s IN CLASS cell: how many of the job's threads run in the class lodger gives
/// its kind, out of all, and that class, e.g. `12/12 RR` for a training job under SCHED_RR,
/// `3/4 BATCH` for a batch job under `batch.policy = "batch"`. The column used to be RR/THREADS,
/// which claimed SCHED_RR threads for batch jobs, where lodger sets no SCHED_RR at all.
pub(crate) fn in_class(d: &HashMap<String, OwnedValue>) -> String {
    let counts = format!("{}/{}", get(d, "rr_threads"), get(d, "threads"));
    // "SCHED_RR/50-51", "SCHED_OTHER/nice 5", "SCHED_BATCH": the class's short name.
    let policy = get(d, "sched_policy");
    let class = policy.strip_prefix("SCHED_").unwrap_or(&policy);
    match class.split('/').next() {
        Some(name) if !name.is_empty() => format!("{counts} {name}"),
        _ => counts,
    }
}

/// `lodgerctl show`'s label for the count of threads in the job's class: "RR threads" only
/// where that class is SCHED_RR. A training job under `training.policy = "other"`, a batch or
/// an inference job, were all shown "RR threads" though none of their threads is SCHED_RR.
pub(crate) fn class_label(d: &HashMap<String, OwnedValue>) -> &'static str {
    if get(d, "sched_policy").starts_with("SCHED_RR") {
        "RR threads"
    } else {
        "In class"
    }
}

/// Rows as aligned columns, one line each, the header first.
pub(crate) fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        format!("{}\n", out.trim_end())
    };
    let mut text = line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        text.push_str(&line(row.clone()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(fields: &[(&str, Value<'static>)]) -> HashMap<String, OwnedValue> {
        fields
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    OwnedValue::try_from(v.clone()).expect("owned"),
                )
            })
            .collect()
    }

    /// A batch job registered without --cores showed "Most cores: 0", as if it might use none;
    /// a job with no GPU an empty "GPUs:".
    #[test]
    fn show_says_what_a_zero_or_empty_field_means() {
        let batch = job(&[("kind", Value::from("batch")), ("cores", Value::from(0u32))]);
        assert_eq!(shown_field(&batch, "cores"), "no cap (every leftover CPU)");
        let capped = job(&[("kind", Value::from("batch")), ("cores", Value::from(4u32))]);
        assert_eq!(shown_field(&capped, "cores"), "4");
        let slurm = job(&[
            ("kind", Value::from("training")),
            ("cores", Value::from(0u32)),
            ("slurm_job", Value::from(42u64)),
        ]);
        assert_eq!(shown_field(&slurm, "cores"), "all of its Slurm cpuset");
        let training = job(&[
            ("kind", Value::from("training")),
            ("cores", Value::from(8u32)),
            ("gpus", Value::from(Vec::<u32>::new())),
            ("cpus", Value::from("2-9")),
        ]);
        assert_eq!(shown_field(&training, "cores"), "8");
        assert_eq!(shown_field(&training, "gpus"), "-");
        assert_eq!(shown_field(&training, "cpus"), "2-9");
        assert_eq!(shown_field(&training, "last_error"), "");
        let online = job(&[
            ("kind", Value::from("online")),
            ("core_budget", Value::from(7u32)),
        ]);
        assert_eq!(shown_field(&online, "core_budget"), "7 CPUs");
        assert_eq!(shown_field(&training, "core_budget"), "");
    }

    #[test]
    fn show_says_rr_threads_only_where_the_class_is_rr() {
        let policy = |p: &str| job(&[("sched_policy", Value::from(p.to_string()))]);
        assert_eq!(class_label(&policy("SCHED_RR/50")), "RR threads");
        assert_eq!(class_label(&policy("SCHED_OTHER/nice 5")), "In class");
        assert_eq!(class_label(&policy("SCHED_BATCH")), "In class");
        assert_eq!(
            class_label(&job(&[])),
            "In class",
            "no policy said: no claim"
        );
    }

    /// `lodgerctl list` headed the count RR/THREADS for every job, batch jobs included, whose
    /// threads lodger runs SCHED_OTHER or SCHED_BATCH: the cell names the class it counts.
    #[test]
    fn list_names_the_class_its_thread_count_is_in() {
        let counts = |kind: &str, policy: &str| {
            job(&[
                ("kind", Value::from(kind.to_string())),
                ("sched_policy", Value::from(policy.to_string())),
                ("rr_threads", Value::from(3u32)),
                ("threads", Value::from(4u32)),
            ])
        };
        assert_eq!(in_class(&counts("batch", "SCHED_BATCH")), "3/4 BATCH");
        assert_eq!(in_class(&counts("batch", "SCHED_OTHER")), "3/4 OTHER");
        assert_eq!(in_class(&counts("training", "SCHED_RR/50")), "3/4 RR");
        assert_eq!(in_class(&counts("training", "SCHED_RR/50-51")), "3/4 RR");
        assert_eq!(
            in_class(&counts("training", "SCHED_OTHER/nice 5")),
            "3/4 OTHER"
        );
        assert_eq!(in_class(&counts("offline", "SCHED_IDLE")), "3/4 IDLE");
        // A lodgerd that does not say its class: the counts alone.
        let bare = job(&[
            ("rr_threads", Value::from(3u32)),
            ("threads", Value::from(4u32)),
        ]);
        assert_eq!(in_class(&bare), "3/4");
        let table = render_table(
            &["IN CLASS"],
            &[vec![in_class(&counts("batch", "SCHED_BATCH"))]],
        );
        assert!(!table.contains("RR"), "{table}");
    }

    /// A string lodgerd answers is shown with its control characters escaped: an escape
    /// sequence in another user's command or cgroup path reached the terminal of whoever ran
    /// `lodgerctl show`, and a newline forged a line of the output.
    #[test]
    fn control_characters_are_escaped() {
        let shown = |s: &str| show_value(&Value::from(s));
        assert_eq!(shown("bert-large_v2.1"), "bert-large_v2.1");
        assert_eq!(
            shown("python3 train.py --lr=1e-3"),
            "python3 train.py --lr=1e-3"
        );
        assert_eq!(shown("ünïcode ok"), "ünïcode ok");
        assert_eq!(
            shown("\x1b]0;pwned\x07\x1b[2J"),
            "\\x1b]0;pwned\\x07\\x1b[2J"
        );
        assert_eq!(shown("a\nState: running"), "a\\nState: running");
        assert_eq!(shown("tab\there\r"), "tab\\there\\r");
        assert_eq!(shown("c1\u{9b}31m"), "c1\\x9b31m");
        assert_eq!(shown("del\u{7f}"), "del\\x7f");
        // Inside lists too (an instance's command), and through `get`'s command line.
        let cmd = Value::from(vec!["/bin/echo", "\x1b[31mred"]);
        assert_eq!(show_value(&cmd), "/bin/echo,\\x1b[31mred");
        let mut d: HashMap<String, OwnedValue> = HashMap::new();
        d.insert("command".into(), OwnedValue::try_from(cmd).expect("owned"));
        assert_eq!(get(&d, "command"), "/bin/echo \\x1b[31mred");
        // JSON keeps the text as it is (serde_json escapes it).
        assert_eq!(
            to_json(&Value::from("\x1b[2J")).to_string(),
            "\"\\u001b[2J\""
        );
        // No escape sequence survives into a table.
        let table = render_table(&["NAME"], &[vec![shown("x\x1b[2Jy")]]);
        assert!(!table.contains('\x1b'), "{table:?}");
    }
}
