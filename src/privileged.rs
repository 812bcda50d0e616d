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

/// The environment variable that turns a missing-hardware skip into a failure. Separate from
/// [`REQUIRE_ENV`]: CI can demand root and kernel features, but not a PMU or a GPU its machine
/// does not have.
pub const REQUIRE_HARDWARE_ENV: &str = "LODGER_REQUIRE_HARDWARE";

/// Call when the machine lacks hardware a test needs (a hardware PMU, a GPU). Prints why the
/// test is skipped (`SKIP (hardware)`, so a log shows it plainly), and panics instead when
/// `LODGER_REQUIRE_HARDWARE=1`, for runs on machines that have it.
pub fn skip_hardware(test: &str, reason: &str) {
    if std::env::var(REQUIRE_HARDWARE_ENV).is_ok_and(|v| v == "1") {
        panic!("{test}: cannot run: {reason} ({REQUIRE_HARDWARE_ENV}=1 forbids skipping)");
    }
    eprintln!("SKIP (hardware) {test}: {reason}");
}
