//! `lodgerctl top`: live measurements per job, once or refreshed like top.

use std::collections::HashMap;

use zbus::zvariant::{OwnedValue, Value};

use super::{from_zbus, Failure};
use crate::render::{dict_to_json, get, render_table, show_value, to_json};
use lodger::api::proxy::ManagerProxy;
use lodger::cli::lodgerctl::TopArgs;

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "-".into())
}

fn fmt_bytes_per_s(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(b) if b >= 1e9 => format!("{:.1}G/s", b / 1e9),
        Some(b) if b >= 1e6 => format!("{:.1}M/s", b / 1e6),
        Some(b) if b >= 1e3 => format!("{:.1}k/s", b / 1e3),
        Some(b) => format!("{b:.0}B/s"),
    }
}

fn num(d: &HashMap<String, OwnedValue>, k: &str) -> Option<f64> {
    match d.get(k).map(|v| &**v) {
        Some(Value::F64(x)) => Some(*x),
        _ => None,
    }
}

/// A field as lodgerd sent it, for `--json` (the table's text escapes control characters;
/// JSON carries them as they are, escaped by JSON itself). Missing: "".
fn raw(d: &HashMap<String, OwnedValue>, k: &str) -> serde_json::Value {
    d.get(k).map_or_else(|| "".into(), |v| to_json(v))
}

/// One job in `top --json`: its id, name, state, CPUs and threads, its measurements, and the
/// throttles and shaping in force on it.
fn job_json(
    d: &HashMap<String, OwnedValue>,
    metrics: Option<&HashMap<String, OwnedValue>>,
) -> serde_json::Value {
    let mut v = serde_json::json!({
        "id": raw(d, "id"),
        "name": raw(d, "name"),
        "state": raw(d, "state"),
        "cpus": raw(d, "cpus"),
        "threads": d.get("threads").map(|v| to_json(v)),
    });
    if let serde_json::Value::Object(o) = &mut v {
        if let Some(m) = metrics {
            o.insert("metrics".into(), dict_to_json(m));
        }
        // Contention throttles and network shaping in force on the job.
        for key in ["throttle", "network", "rt"] {
            if d.contains_key(key) {
                o.insert(key.into(), raw(d, key));
            }
        }
    }
    v
}

/// One `top` screen (or JSON document).
async fn top_once(proxy: &ManagerProxy<'_>, json: bool) -> Result<String, Failure> {
    let (node, metrics, sources) = proxy
        .get_observations()
        .await
        .map_err(|e| from_zbus("top", e))?;
    let jobs = proxy.list_jobs().await.map_err(|e| from_zbus("top", e))?;
    let status = proxy.get_status().await.map_err(|e| from_zbus("top", e))?;
    let mut details = Vec::new();
    for (id, ..) in &jobs {
        if let Ok(d) = proxy.get_job(id).await {
            details.push(d);
        }
    }
    if json {
        let jobs: Vec<serde_json::Value> = details
            .iter()
            .map(|d| job_json(d, metrics.get(&get(d, "id"))))
            .collect();
        let v = serde_json::json!({
            "node": dict_to_json(&node),
            "sources": sources,
            "contention": raw(&status, "contention"),
            "network": raw(&status, "network"),
            "sensing": raw(&status, "sensing"),
            "jobs": jobs,
        });
        return Ok(v.to_string());
    }
    let mut out = String::new();
    let src = |k: &str| sources.get(k).cloned().unwrap_or_else(|| "-".into());
    out.push_str(&format!(
        "node: cpu {}%  pressure {}%  membw {}\n",
        fmt_opt(num(&node, "cpu_percent"), 1),
        fmt_opt(num(&node, "cpu_pressure_percent"), 1),
        fmt_bytes_per_s(num(&node, "membw_bytes_per_s")),
    ));
    for k in ["gpu", "perf", "membw"] {
        out.push_str(&format!("{k:>5}: {}\n", src(k)));
    }
    out.push_str(&format!("contention: {}\n", get(&status, "contention")));
    out.push_str(&format!("   network: {}\n", get(&status, "network")));
    out.push_str(&format!("sample age: {}\n", get(&status, "sensing")));
    out.push('\n');
    let header = [
        "ID", "NAME", "STATE", "CPUS", "CPU%", "IPC", "MISS%", "GPU%", "MEMBW", "NET",
    ];
    let rows: Vec<Vec<String>> = details
        .iter()
        .map(|d| {
            let id = get(d, "id");
            let empty = HashMap::new();
            let m = metrics.get(&id).unwrap_or(&empty);
            let gpu = match (
                num(m, "gpu_percent"),
                m.get("gpu_source").map(|v| show_value(v)),
            ) {
                (Some(g), Some(s)) if s == "emulated" => format!("{g:.1} (emulated)"),
                (g, _) => fmt_opt(g, 1),
            };
            vec![
                id,
                get(d, "name"),
                get(d, "state"),
                get(d, "cpus"),
                fmt_opt(num(m, "cpu_percent"), 1),
                fmt_opt(num(m, "ipc"), 2),
                fmt_opt(num(m, "cache_miss_percent"), 1),
                gpu,
                if m.contains_key("membw_unavailable") {
                    "n/a".to_string()
                } else {
                    fmt_bytes_per_s(num(m, "membw_bytes_per_s"))
                },
                // Received + sent in the job's own network namespace.
                match (num(m, "net_rx_bytes_per_s"), num(m, "net_tx_bytes_per_s")) {
                    (Some(rx), Some(tx)) => fmt_bytes_per_s(Some(rx + tx)),
                    _ => "-".to_string(),
                },
            ]
        })
        .collect();
    out.push_str(&render_table(&header, &rows));
    if rows.is_empty() {
        out.push_str("No jobs registered.\n");
    }
    // Throttles and network shaping in force, with their evidence.
    for d in &details {
        let id = get(d, "id");
        if d.contains_key("throttle") {
            out.push_str(&format!("{id}: throttled: {}\n", get(d, "throttle")));
        }
        if d.contains_key("network") {
            out.push_str(&format!("{id}: network: {}\n", get(d, "network")));
        }
        if d.contains_key("rt") {
            out.push_str(&format!("{id}: RT limit: {}\n", get(d, "rt")));
        }
    }
    // Why a job's bandwidth is not measured while the node's is (no free RMID).
    for d in &details {
        let id = get(d, "id");
        if let Some(why) = metrics.get(&id).map(|m| get(m, "membw_unavailable")) {
            if !why.is_empty() {
                out.push_str(&format!("{id}: memory bandwidth unavailable: {why}\n"));
            }
        }
    }
    Ok(out)
}

pub(crate) async fn top(
    proxy: &ManagerProxy<'_>,
    json: bool,
    args: TopArgs,
) -> Result<(), Failure> {
    use std::io::IsTerminal;
    if args.once || json {
        out!("{}", top_once(proxy, json).await?);
        if json {
            outln!();
        }
        return Ok(());
    }
    let clear = std::io::stdout().is_terminal();
    loop {
        let screen = top_once(proxy, false).await?;
        if clear {
            // Home the cursor and clear the screen, like top(1).
            out!("\x1b[H\x1b[2J");
        }
        out!("{screen}");
        if !clear {
            outln!();
        }
        tokio::time::sleep(std::time::Duration::from_secs_f64(args.refresh)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dict(pairs: &[(&str, &str)]) -> HashMap<String, OwnedValue> {
        pairs
            .iter()
            .map(|(k, v)| {
                let v = OwnedValue::try_from(Value::from(*v)).expect("a string value");
                (k.to_string(), v)
            })
            .collect()
    }

    /// `--json` carries lodgerd's text as it is (JSON escapes it itself); the table escapes
    /// control characters. It carried the table's text: a name's ESC came out as the four
    /// characters `\x1b`.
    #[test]
    fn json_keeps_the_text_as_lodgerd_sent_it() {
        let d = dict(&[
            ("id", "j1"),
            ("name", "a\x1b[31mred\nname"),
            ("state", "running"),
            ("network", "held\tto 25 %"),
        ]);
        let v = job_json(&d, None);
        assert_eq!(v["name"], "a\x1b[31mred\nname");
        assert_eq!(v["network"], "held\tto 25 %");
        assert_eq!(v["cpus"], "", "missing: empty, as before");
        assert_eq!(
            get(&d, "name"),
            "a\\x1b[31mred\\nname",
            "the table's text is escaped"
        );
    }
}
