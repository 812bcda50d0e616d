//! Tests of `enforce::quiet` without the kernel: process events from a script (lost ones
//! too), a fake /proc, the pruning of what no sweep needs.

use super::*;
use crate::sys::procevents::Drained;
use crate::testutil::{fake_proc, fake_process};
use std::sync::{Arc, Mutex};

/// Process events from a script: what the next drain reads, and whether it finds the socket
/// overflowed. Overflowing the real one on demand is unreliable.
#[derive(Debug, Clone, Default)]
struct Script(Arc<Mutex<(Vec<Event>, Drained)>>);

impl Script {
    fn next(&self, events: Vec<Event>, lost: bool) {
        self.next_drained(
            events,
            Drained {
                lost,
                ..Drained::default()
            },
        );
    }

    fn next_drained(&self, events: Vec<Event>, drained: Drained) {
        *self.0.lock().expect("script") = (events, drained);
    }
}

impl Source for Script {
    fn drain(&mut self, on: &mut dyn FnMut(Event)) -> std::io::Result<Drained> {
        let (events, drained) = std::mem::take(&mut *self.0.lock().expect("script"));
        let n = events.len() as u64;
        events.into_iter().for_each(on);
        Ok(Drained {
            events: n,
            ..drained
        })
    }
}

fn scripted() -> (Quiet, Script) {
    let script = Script::default();
    (Quiet::with_source(Some(Box::new(script.clone()))), script)
}

/// Events lost (the socket overflowed) may have been any job's fork: the next apply sweeps
/// every job, where an event of one job's process sweeps that job alone. So does the watch
/// loaded again (`procevents::REWATCH_AFTER`): none of the jobs' processes is in its map.
#[test]
fn lost_events_sweep_every_job_at_the_next_apply() {
    let (mut q, script) = scripted();
    let (cpus, mems) = (CpuSet::parse("0").expect("cpus"), CpuSet::new());
    let asked = Asked {
        cpus: &cpus,
        mems: &mems,
        memory_max: None,
    };
    let jobs: Vec<(JobId, Target)> = (1..=3u32)
        .map(|n| (JobId::from_seq(n.into()), Target::Pids(vec![1000 + n])))
        .collect();
    // At the slots' epoch: no safety-net sweep falls due in the ticks below.
    let t0 = q.epoch;
    // What an apply that swept every job leaves.
    let swept = |q: &mut Quiet, at: Instant| {
        for (id, target) in &jobs {
            let Target::Pids(pids) = target else {
                unreachable!()
            };
            let outcome = Outcome {
                pids: pids.clone(),
                alive: true,
                ..Outcome::default()
            };
            q.remember(id, target, &asked, &outcome, Vec::new(), None, at);
        }
    };
    swept(&mut q, t0);
    let mut buf = Vec::new();
    // Which jobs the tick `n` (each one DRAIN_EVERY after the last) skips.
    let mut skipped = |q: &mut Quiet, n: u32| -> Vec<u64> {
        let now = t0 + DRAIN_EVERY * n;
        jobs.iter()
            .filter(|(id, target)| {
                q.settled(id, target, &asked, None, None, &mut buf, now)
                    .is_some()
            })
            .map(|(id, _)| id.seq())
            .collect()
    };
    assert_eq!(skipped(&mut q, 1), vec![1, 2, 3], "nothing happened");
    script.next(vec![Event::Exec { tgid: 1002 }], false);
    assert_eq!(skipped(&mut q, 2), vec![1, 3], "an exec in job 2");
    script.next(Vec::new(), true);
    assert_eq!(skipped(&mut q, 3), Vec::<u64>::new(), "events were lost");
    swept(&mut q, t0 + DRAIN_EVERY * 3);
    assert_eq!(skipped(&mut q, 4), vec![1, 2, 3], "swept at the last tick");
    // The watch loaded again with an empty map: every job is swept, so that its processes
    // are watched (and a pid job's tree walked) as at a first apply.
    script.next_drained(
        Vec::new(),
        Drained {
            rewatched: true,
            ..Drained::default()
        },
    );
    assert_eq!(
        skipped(&mut q, 5),
        Vec::<u64>::new(),
        "the watch loaded again"
    );
    // A datagram cut short by another listener's filter: an event unread, whichever it was.
    swept(&mut q, t0 + DRAIN_EVERY * 5);
    script.next_drained(
        Vec::new(),
        Drained {
            lost: true,
            cut: true,
            ..Drained::default()
        },
    );
    assert_eq!(skipped(&mut q, 6), Vec::<u64>::new(), "an event cut short");
    assert_eq!(
        q.started_over(),
        vec!["events lost", "the watch loaded again", "events cut short"]
    );
    assert!(q.said_cut);
}

/// Events lost may have been any fork or exit: the process table is read from /proc again
/// before it is next used, where a reported fork is added without reading /proc.
#[test]
fn lost_events_read_the_table_from_proc_again() {
    let proc = fake_proc(&[(1, 0, "S"), (100, 1, "S")]);
    let mut reader = ProcReader::new(proc.path());
    let (mut q, script) = scripted();
    let t0 = q.epoch;
    let mut children = |q: &mut Quiet, ms: u64| {
        let mut out = Vec::new();
        q.table(&mut reader, t0 + Duration::from_millis(ms))
            .expect("table")
            .descendants(&[100], &mut out);
        out.sort_unstable();
        out
    };
    assert_eq!(children(&mut q, 0), Vec::<u32>::new());
    assert_eq!(q.rescans(), 1, "the first use reads /proc");
    fake_process(proc.path(), 101, 100, "S");
    script.next(
        vec![Event::Fork {
            parent_tgid: 100,
            child_pid: 101,
            child_tgid: 101,
        }],
        false,
    );
    assert_eq!(children(&mut q, 1), vec![101]);
    assert_eq!(q.rescans(), 1, "a reported fork read /proc");
    // 101 exits and 102 is forked, their events lost.
    std::fs::remove_dir_all(proc.path().join("101")).expect("remove 101");
    fake_process(proc.path(), 102, 100, "S");
    script.next(Vec::new(), true);
    assert_eq!(
        children(&mut q, 2),
        vec![102],
        "the table missed lost events"
    );
    assert_eq!(q.rescans(), 2);
    // The events flow again: the table follows them without reading /proc.
    assert_eq!(children(&mut q, 3), vec![102]);
    assert_eq!(q.rescans(), 2);
}

/// A process lists its threads, then exits; past 4,096 events its exit's record is pruned
/// (over FULL_SWEEP_EVERY old) while its listing would still stand (under two periods): a
/// process reusing its pid with as many threads must not get the dead one's thread ids. Its
/// listing goes with its event; another process's listing with no event since stays.
#[test]
fn a_pruned_exit_leaves_no_listing_for_a_reused_pid() {
    let mut q = Quiet::new(false, false);
    let t0 = Instant::now();
    let (dead, calm) = (100_000u32, 100_001u32);
    q.listed.insert(dead, (vec![dead, dead + 7], t0));
    q.listed.insert(calm, (vec![calm], t0));
    for pid in 0..70 {
        q.listed.insert(200_000 + pid, (vec![200_000 + pid], t0));
    }
    let exit = t0 + Duration::from_secs(1);
    touch(&mut q.touched, &mut q.listed, dead, exit);
    for pid in 0..5000 {
        touch(&mut q.touched, &mut q.listed, 300_000 + pid, exit);
    }
    q.prune(exit + FULL_SWEEP_EVERY + Duration::from_secs(1));
    assert!(
        !q.touched.contains_key(&dead),
        "the exit's record was not pruned"
    );
    assert!(
        q.listing(dead).is_none(),
        "a reused pid would get the dead process's threads"
    );
    assert_eq!(q.listing(calm).map(|(t, _)| t.clone()), Some(vec![calm]));
}

/// Wherever a sweep falls, the next is in the job's slot and at most one period later; a
/// job swept in its slot is next swept exactly one period later.
#[test]
fn a_sweep_is_due_in_its_slot_within_one_period() {
    let epoch = Instant::now();
    let width = FULL_SWEEP_EVERY / SWEEP_SLOTS;
    for slot in 0..SWEEP_SLOTS {
        for ms in [0u64, 1, 999, 1000, 4321, 9999, 10_000, 10_001, 123_456] {
            let at = epoch + Duration::from_millis(ms);
            let due = next_sweep(epoch, slot, at);
            assert!(due > at, "slot {slot}, swept at {ms} ms: due before it");
            assert!(
                due <= at + FULL_SWEEP_EVERY,
                "slot {slot}, swept at {ms} ms: due {:?} after",
                due - at
            );
            let phase = due.duration_since(epoch).as_nanos() % FULL_SWEEP_EVERY.as_nanos();
            assert_eq!(phase, (width * slot).as_nanos(), "slot {slot}, {ms} ms");
            assert_eq!(next_sweep(epoch, slot, due), due + FULL_SWEEP_EVERY);
        }
    }
}

/// A hundred jobs swept at the same instant (lodgerd starting) take the slots in turn, and
/// fall due a tenth at a time, each within one period.
#[test]
fn jobs_swept_together_fall_due_apart() {
    let epoch = Instant::now();
    let at = epoch + Duration::from_millis(2500);
    let mut slots = Vec::new();
    for _ in 0..100 {
        let slot = least_used(slots.iter());
        slots.push(slot);
    }
    let width = FULL_SWEEP_EVERY / SWEEP_SLOTS;
    let mut per_window = [0usize; SWEEP_SLOTS as usize];
    for &slot in &slots {
        let ahead = next_sweep(epoch, slot, at) - at;
        assert!(ahead <= FULL_SWEEP_EVERY);
        per_window[(ahead.as_nanos() / width.as_nanos()) as usize % SWEEP_SLOTS as usize] += 1;
    }
    assert_eq!(per_window, [10; SWEEP_SLOTS as usize], "{slots:?}");
    // One leaves: the next job takes its slot.
    slots.remove(37);
    assert_eq!(least_used(slots.iter()), 37 % SWEEP_SLOTS);
}

/// A process table older than FULL_SWEEP_EVERY is read in full at its next use: it is no
/// longer kept in step meanwhile, or one nobody uses (no pid job looks for descendants) would
/// gather the processes to read again for ever.
#[test]
fn a_table_left_unused_is_not_kept_in_step() {
    let proc = fake_proc(&[(1, 0, "S"), (100, 1, "S")]);
    let mut reader = ProcReader::new(proc.path());
    let (mut q, script) = scripted();
    let t0 = q.epoch;
    q.table(&mut reader, t0).expect("table");
    // Execs of processes the table does not know: each waits to be read again.
    let execs =
        |from: u32| -> Vec<Event> { (from..from + 10).map(|tgid| Event::Exec { tgid }).collect() };
    script.next(execs(5000), false);
    q.drain(t0 + Duration::from_secs(1));
    assert_eq!(q.table.unsettled(), 10, "kept in step while fresh");
    script.next(execs(6000), false);
    let stale = t0 + FULL_SWEEP_EVERY + Duration::from_secs(1);
    q.drain(stale);
    assert_eq!(q.table.unsettled(), 10, "kept in step once stale");
    q.table(&mut reader, stale + Duration::from_secs(1))
        .expect("table");
    assert_eq!(q.rescans(), 2, "a stale table is read in full");
    assert_eq!(q.table.unsettled(), 0);
}
