//! Generates the shell completions (bash, zsh, fish) and man pages of `lodgerd` and `lodgerctl`
//! from their clap definitions in `lodger::cli`, for the packages (`scripts/package`).
//!
//! ```sh
//! cargo run --example gen_docs -- target/assets
//! ```
//!
//! writes `OUT/man/lodgerd.8`, `OUT/man/lodgerctl.1`, one `lodgerctl-<subcommand>.1` per
//! subcommand, and `OUT/completions/{bash,zsh,fish}/` for both programs. An example rather than a
//! `lodgerctl completion` subcommand: the packages ship the files ready-made, so the installed
//! binaries need neither the generators nor a command that nobody on a node would run.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::CommandFactory;
use clap_complete::Shell;
use clap_mangen::Man;

use lodger::cli::{lodgerctl, lodgerd};

/// Where each shell looks for a completion file named after the program.
const SHELLS: [(Shell, &str); 3] = [
    (Shell::Bash, "bash"),
    (Shell::Zsh, "zsh"),
    (Shell::Fish, "fish"),
];

fn main() -> ExitCode {
    let Some(out) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: gen_docs OUT_DIR");
        return ExitCode::from(2);
    };
    match generate(&out) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gen_docs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn generate(out: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let man = out.join("man");
    fs::create_dir_all(&man)?;
    let see_also_d = "lodgerctl(1), systemctl(1), busctl(1)";
    let see_also_ctl = "lodgerd(8), busctl(1)";
    files.extend(man_pages(lodgerd::Cli::command(), "8", see_also_d, &man)?);
    files.extend(man_pages(
        lodgerctl::Cli::command(),
        "1",
        see_also_ctl,
        &man,
    )?);

    for (shell, dir) in SHELLS {
        let dir = out.join("completions").join(dir);
        fs::create_dir_all(&dir)?;
        for mut cmd in [lodgerd::Cli::command(), lodgerctl::Cli::command()] {
            let name = cmd.get_name().to_string();
            files.push(clap_complete::generate_to(shell, &mut cmd, name, &dir)?);
        }
    }
    Ok(files)
}

/// The page of `cmd` and one per (non-hidden) subcommand, recursively, named like git's
/// (`lodgerctl-register-training.1`), each ending with a SEE ALSO section.
fn man_pages(
    cmd: clap::Command,
    section: &str,
    see_also: &str,
    dir: &Path,
) -> std::io::Result<Vec<PathBuf>> {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let top = cmd.get_name().to_string();
    let date = page_date();
    let mut files = Vec::new();
    let mut pending = vec![cmd];
    while let Some(cmd) = pending.pop() {
        pending.extend(cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
        let also = if cmd.get_name() == top {
            see_also.to_string()
        } else {
            format!("{top}({section}), {see_also}")
        };
        let page = Man::new(cmd)
            .section(section)
            .date(date.as_str())
            .manual("lodger")
            .source(format!("lodger {}", env!("CARGO_PKG_VERSION")));
        let path = dir.join(page.get_filename());
        let mut text = Vec::new();
        page.render(&mut text)?;
        writeln!(text, ".SH \"SEE ALSO\"\n{also}")?;
        fs::write(&path, text)?;
        files.push(path);
    }
    Ok(files)
}

/// The pages' date: `SOURCE_DATE_EPOCH` (reproducible builds; `scripts/package` sets it to the
/// last commit's time) or now, as YYYY-MM-DD in UTC.
fn page_date() -> String {
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        });
    let (y, m, d) = civil_from_days(secs / 86_400);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day): Howard Hinnant's
/// `civil_from_days`, for non-negative day counts.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}
