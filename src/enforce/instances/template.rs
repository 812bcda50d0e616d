//! Command templates: parsing `{threads}`, `{batch}`, `{cpus}`, `{instance}` and `{job}`
//! placeholders, expanding them for one instance, showing an argv quoted, and finding the program
//! as execvp would. Touches the filesystem only to look the program up on `PATH`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::error::{InstanceError, TemplateProblem};
use super::InstanceSpec;
use crate::job::JobId;

// ---------------------------------------------------------------------------------------------
// Templates

/// A template placeholder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholder {
    Threads,
    Batch,
    Cpus,
    Instance,
    Job,
}

impl Placeholder {
    pub const ALL: [Placeholder; 5] = [
        Placeholder::Threads,
        Placeholder::Batch,
        Placeholder::Cpus,
        Placeholder::Instance,
        Placeholder::Job,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Placeholder::Threads => "threads",
            Placeholder::Batch => "batch",
            Placeholder::Cpus => "cpus",
            Placeholder::Instance => "instance",
            Placeholder::Job => "job",
        }
    }

    pub(super) fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Piece {
    Text(String),
    Value(Placeholder),
}

/// A parsed command template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    pub(super) args: Vec<Vec<Piece>>,
}

impl Template {
    /// Parses `argv`, refusing an empty one, unknown placeholders and unmatched braces.
    pub fn parse(job: &JobId, argv: &[String]) -> Result<Template, InstanceError> {
        let fail = |problem| InstanceError::Template {
            job: job.clone(),
            template: show_argv(argv),
            problem,
        };
        if argv.is_empty() || argv.iter().all(|a| a.trim().is_empty()) {
            return Err(fail(TemplateProblem::Empty));
        }
        let mut args = Vec::with_capacity(argv.len());
        for (i, arg) in argv.iter().enumerate() {
            args.push(parse_arg(arg).map_err(|p| fail(p.at(i, arg)))?);
        }
        Ok(Template { args })
    }

    pub fn uses(&self, p: Placeholder) -> bool {
        self.args
            .iter()
            .flatten()
            .any(|piece| *piece == Piece::Value(p))
    }

    /// The argv for one instance.
    pub fn expand(&self, spec: &InstanceSpec) -> Vec<String> {
        self.args
            .iter()
            .map(|pieces| {
                let mut out = String::new();
                for piece in pieces {
                    match piece {
                        Piece::Text(t) => out.push_str(t),
                        Piece::Value(p) => out.push_str(&placeholder_value(*p, spec)),
                    }
                }
                out
            })
            .collect()
    }
}

pub(super) fn placeholder_value(p: Placeholder, spec: &InstanceSpec) -> String {
    match p {
        Placeholder::Threads => spec.threads.to_string(),
        Placeholder::Batch => spec.batch.to_string(),
        Placeholder::Cpus => spec.cpus.to_string(),
        Placeholder::Instance => spec.index.to_string(),
        Placeholder::Job => spec.job.to_string(),
    }
}

/// A problem in one argument, before it knows which.
pub(super) enum ArgProblem {
    Unknown(String),
    Unmatched(char),
}

impl ArgProblem {
    pub(super) fn at(self, arg: usize, text: &str) -> TemplateProblem {
        match self {
            ArgProblem::Unknown(name) => TemplateProblem::UnknownPlaceholder {
                arg,
                text: text.to_string(),
                name,
            },
            ArgProblem::Unmatched(brace) => TemplateProblem::UnmatchedBrace {
                arg,
                text: text.to_string(),
                brace,
            },
        }
    }
}

pub(super) fn parse_arg(arg: &str) -> Result<Vec<Piece>, ArgProblem> {
    let bytes = arg.as_bytes();
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut lit = 0;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'{' | b'}' if bytes.get(i + 1) == Some(&b) => {
                text.push_str(&arg[lit..i]);
                text.push(char::from(b));
                i += 2;
                lit = i;
            }
            b'{' => {
                text.push_str(&arg[lit..i]);
                let rest = &arg[i + 1..];
                let close = rest.find('}').ok_or(ArgProblem::Unmatched('{'))?;
                let name = &rest[..close];
                let p = Placeholder::from_name(name)
                    .ok_or_else(|| ArgProblem::Unknown(name.to_string()))?;
                if !text.is_empty() {
                    pieces.push(Piece::Text(std::mem::take(&mut text)));
                }
                pieces.push(Piece::Value(p));
                i += close + 2;
                lit = i;
            }
            b'}' => return Err(ArgProblem::Unmatched('}')),
            _ => i += 1,
        }
    }
    text.push_str(&arg[lit..]);
    if !text.is_empty() || pieces.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

/// The template as a shell would show it, for messages.
pub fn show_argv(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,{}+@%".contains(&b))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The PATH lodgerd searches, as its children's `execvp` will.
pub(super) fn search_path() -> String {
    std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".to_string())
}

pub(super) fn executable(path: &Path) -> Result<(), String> {
    // On the agent's loop (registration, reconcile): a program on a hung mount must not stop it.
    crate::sys::stall::answers_within(&[path], crate::sys::stall::PATH_PATIENCE)?;
    let meta = fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_string());
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err("no execute permission".to_string());
    }
    Ok(())
}

/// Finds the program an instance would run, as `execvp` does: a name with a `/` is a path, any
/// other name is searched in PATH.
pub fn find_program(program: &str) -> Result<PathBuf, TemplateProblem> {
    if program.contains('/') {
        let path = PathBuf::from(program);
        return match executable(&path) {
            Ok(()) => Ok(path),
            Err(reason) => Err(TemplateProblem::NotExecutable {
                program: path,
                reason,
            }),
        };
    }
    let path = search_path();
    if !program.is_empty() {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(program);
            if executable(&candidate).is_ok() {
                return Ok(candidate);
            }
        }
    }
    Err(TemplateProblem::ProgramNotFound {
        program: program.to_string(),
        path,
    })
}

/// Checks a job's template before any instance is planned (the API calls this at registration):
/// it parses, and its program exists (when the program is not itself a placeholder).
pub fn validate_template(job: &JobId, argv: &[String]) -> Result<Template, InstanceError> {
    let template = Template::parse(job, argv)?;
    if let Some([Piece::Text(program)]) = template.args.first().map(Vec::as_slice) {
        find_program(program).map_err(|problem| InstanceError::Template {
            job: job.clone(),
            template: show_argv(argv),
            problem,
        })?;
    }
    Ok(template)
}
