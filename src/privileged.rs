//! Test support for tests that need root or a kernel feature: they skip with a printed reason on a
//! laptop and fail when `LODGER_REQUIRE_PRIVILEGED=1` (as `.ci/run` sets). Touches nothing.

/// The environment variable that turns a skip into a failure.
pub const REQUIRE_ENV: &str = "LODGER_REQUIRE_PRIVILEGED";

/// True when skips must fail.
pub fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// Call when a precondition for a privileged test is missing. Returns (so the test can `return`)
/// after printing why it is skipped; panics instead when skips are not allowed.
pub fn skip(test: &str, reason: &str) {
    if required() {
        panic!("{test}: cannot run: {reason} ({REQUIRE_ENV}=1 forbids skipping)");
    }
    eprintln!("SKIP {test}: {reason}");
}

/// True when this process runs as root (euid 0).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Returns true when the test may go on: the process is root. Otherwise skips (or fails under
/// `LODGER_REQUIRE_PRIVILEGED=1`) and returns false.
pub fn need_root(test: &str) -> bool {
    if is_root() {
        return true;
    }
    skip(test, "needs root");
    false
}
