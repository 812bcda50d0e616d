//! lodger's nftables table (`inet lodger`): the rules that mark CPU jobs' packets or set their
//! priority, matched by cgroup; read with `nft -j list table` and replaced only when they differ.
//! Touches nftables through a [`TcRunner`].

use super::{
    argv, show_argv, ClassId, TcError, TcRunner, NFT, NFT_CHAIN, NFT_CHAIN_PRIO, NFT_FAMILY,
};

/// Which cgroup marks a CPU job's socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuJobMatch {
    /// cgroup v1: the socket's `net_cls.classid`.
    NetClsClassid(u32),
    /// cgroup v2: the socket's cgroup is this one or below it (path relative to the cgroup2
    /// root, e.g. `lodger/j3`). nft resolves the path when the rule is added, under
    /// `/sys/fs/cgroup`: add the rule after the cgroup exists, and again if it is recreated.
    CgroupV2(String),
}

impl CpuJobMatch {
    /// The match in nft's language.
    pub fn expression(&self) -> String {
        match self {
            CpuJobMatch::NetClsClassid(id) => format!("meta cgroup {id}"),
            CpuJobMatch::CgroupV2(path) => {
                let level = path.split('/').filter(|p| !p.is_empty()).count();
                format!("socket cgroupv2 level {level} \"{path}\"")
            }
        }
    }
}

/// What a matching packet gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NftAction {
    /// A mark, for a `fw` filter.
    Mark(u32),
    /// `skb->priority` = the class, which HTB takes directly.
    Priority(ClassId),
}

/// One rule of lodger's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRule {
    pub matches: CpuJobMatch,
    pub action: NftAction,
}

impl NftRule {
    /// The rule in nft's language, without its comment.
    pub fn statement(&self) -> String {
        let m = self.matches.expression();
        let a = match self.action {
            NftAction::Mark(mark) => format!("meta mark set {mark:#010x}"),
            NftAction::Priority(class) => format!("meta priority set {class}"),
        };
        format!("{m} {a}")
    }

    /// The comment lodger tags the rule with: a digest of the statement, so an existing rule is
    /// recognised without parsing nft's rendering of it (rule comments are at most 128 bytes;
    /// cgroup paths can be longer).
    pub fn fingerprint(&self) -> String {
        format!("lodger:{:016x}", fnv1a(self.statement().as_bytes()))
    }
}

/// FNV-1a, 64 bit: stable across builds, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// lodger's nftables table (`inet <table>`, one `output` chain): rules that mark or classify
/// CPU jobs' packets. One per network namespace, shared by every shaped interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftSteering {
    table: String,
}

/// lodger's table as `nft -j list table` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedTable {
    /// The `output` chain exists with lodger's type, hook and priority.
    pub chain_ok: bool,
    /// The rules' comments, in order.
    pub comments: Vec<String>,
}

impl NftSteering {
    pub fn new(table: &str) -> Self {
        Self {
            table: table.to_string(),
        }
    }

    /// `nft` and `line` split at whitespace (the table name, cgroup paths and comments are
    /// validated to have none).
    fn nft(&self, line: &str) -> Vec<String> {
        argv(NFT, line)
    }

    /// lodger's table, or `None` when there is none.
    pub fn observe(&self, runner: &mut dyn TcRunner) -> Result<Option<ObservedTable>, TcError> {
        let argv = self.nft(&format!("-j list table {NFT_FAMILY} {}", self.table));
        let out = match runner.run(&argv) {
            Ok(out) => out,
            Err(TcError::Failed { stderr, .. }) if stderr.contains("No such file or directory") => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let bad = |reason: String| TcError::Unparsed {
            argv: show_argv(&argv),
            line: out.chars().take(200).collect(),
            reason,
        };
        let json: serde_json::Value =
            serde_json::from_str(&out).map_err(|e| bad(format!("not JSON: {e}")))?;
        let items = json
            .get("nftables")
            .and_then(|v| v.as_array())
            .ok_or_else(|| bad("no \"nftables\" array".to_string()))?;
        let mut table = ObservedTable {
            chain_ok: false,
            comments: Vec::new(),
        };
        for item in items {
            if let Some(chain) = item.get("chain") {
                let is =
                    |key: &str, want: &str| chain.get(key).and_then(|v| v.as_str()) == Some(want);
                if is("name", NFT_CHAIN) {
                    table.chain_ok = is("type", "filter")
                        && is("hook", "output")
                        && chain.get("prio").and_then(|v| v.as_i64()) == Some(NFT_CHAIN_PRIO);
                }
            }
            if let Some(rule) = item.get("rule") {
                if rule.get("chain").and_then(|v| v.as_str()) == Some(NFT_CHAIN) {
                    let comment = rule.get("comment").and_then(|v| v.as_str()).unwrap_or("");
                    table.comments.push(comment.to_string());
                }
            }
        }
        Ok(Some(table))
    }

    /// The one nft invocation that (re)creates the table with `rules`, atomically: nft applies a
    /// command line as one transaction.
    pub fn build_argv(&self, rules: &[NftRule]) -> Vec<String> {
        let t = format!("{NFT_FAMILY} {}", self.table);
        // add-then-delete empties a table that exists and is harmless when it does not.
        let mut script = format!(
            "add table {t} ; delete table {t} ; add table {t} ; \
             add chain {t} {NFT_CHAIN} {{ type filter hook output priority mangle ; policy accept ; }}"
        );
        for rule in rules {
            script.push_str(&format!(
                " ; add rule {t} {NFT_CHAIN} {} comment \"{}\"",
                rule.statement(),
                rule.fingerprint()
            ));
        }
        self.nft(&script)
    }

    /// Makes lodger's table hold exactly `rules` (none: no table). Returns whether it changed.
    pub fn apply(&self, runner: &mut dyn TcRunner, rules: &[NftRule]) -> Result<bool, TcError> {
        for rule in rules {
            if let CpuJobMatch::CgroupV2(path) = &rule.matches {
                check_cgroup_path(path)?;
            }
        }
        if rules.is_empty() {
            return self.remove(runner);
        }
        let wanted: Vec<String> = rules.iter().map(NftRule::fingerprint).collect();
        if let Some(table) = self.observe(runner)? {
            if table.chain_ok && table.comments == wanted {
                return Ok(false);
            }
        }
        runner.run(&self.build_argv(rules))?;
        Ok(true)
    }

    /// Deletes lodger's table; `Ok(false)` when there was none.
    pub fn remove(&self, runner: &mut dyn TcRunner) -> Result<bool, TcError> {
        if self.observe(runner)?.is_none() {
            return Ok(false);
        }
        runner.run(&self.nft(&format!("delete table {NFT_FAMILY} {}", self.table)))?;
        Ok(true)
    }
}

/// A cgroup path nft takes inside a quoted string: relative, no empty, `.` or `..` component,
/// printable ASCII without `"` or `;`, and a backslash only in systemd's `\xNN` escapes (the
/// slices of lodgerds whose cgroup parent has a `-`, see `unit::Slices`), which nft reads as
/// they are.
pub(crate) fn check_cgroup_path(path: &str) -> Result<(), TcError> {
    let bytes = path.as_bytes();
    let escape_at = |i: usize| {
        bytes.get(i + 1) == Some(&b'x')
            && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit)
            && bytes.get(i + 3).is_some_and(u8::is_ascii_hexdigit)
    };
    let ok = !path.is_empty()
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != "..")
        && bytes.iter().enumerate().all(|(i, &b)| {
            b.is_ascii_graphic() && b != b'"' && b != b';' && (b != b'\\' || escape_at(i))
        });
    if ok {
        Ok(())
    } else {
        Err(TcError::config(
            "cgroup",
            format!("'{path}' is not a relative cgroup2 path nft can take"),
        ))
    }
}
