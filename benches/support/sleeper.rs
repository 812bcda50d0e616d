//! A process of sleeping threads for the scale benchmarks: the bench binary runs itself as
//! `<bench> sleeper N`, which starts N threads (the main one included) that park until killed.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Call first in a benchmark's `main`: when this run is a sleeper, it never returns.
pub fn serve_if_asked() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("sleeper") {
        sleeper_main(args.get(2).and_then(|n| n.parse().ok()).unwrap_or(1));
    }
}

/// A process with `n` threads that sleep until it is killed.
pub struct Sleeper(Child);

impl Sleeper {
    pub fn start(n: usize) -> Sleeper {
        let me = std::env::current_exe().expect("current exe");
        let mut child = Command::new(me)
            .args(["sleeper", &n.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn sleeper");
        let mut line = String::new();
        let out = child.stdout.take().expect("stdout");
        BufReader::new(out).read_line(&mut line).expect("ready");
        assert_eq!(line.trim(), "ready", "sleeper did not start");
        Sleeper(child)
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sleeper_main(n: usize) -> ! {
    for _ in 1..n {
        std::thread::spawn(|| loop {
            std::thread::park();
        });
    }
    println!("ready");
    loop {
        std::thread::park();
    }
}
