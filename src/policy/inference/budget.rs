//! Online jobs' core budgets: how many of the CPUs left for online inference each online job's
//! layout search may use. Pure: touches nothing.

use std::collections::BTreeMap;

use super::place::{fair_shares, in_id_order};
use crate::job::JobId;

/// Splits `cpus`, the CPUs online inference may use once fixed-size online containers took
/// theirs, into the budgets of the online `jobs` that search for their layout: equal shares in
/// whole cores of `core_width` CPUs (SMT siblings: 2 on most hosts, 1 without SMT), cores
/// that do not divide to the lowest ids (`JobId::seq`), then the CPUs of no whole core one at a
/// time to the smallest budget. A job listed twice counts once.
///
/// A budget depends only on `cpus` and on which online jobs there are, never on another job's
/// probe or layout: one job's search cannot restart another's (each searches over its own
/// budget, and a search restarts only when that changes), and every job gets a share however
/// greedy the first one's layout would be. A job alone gets every CPU, as before budgets.
/// Shares in whole cores, so that two jobs' budgets do not meet on the two threads of one core
/// (Cloud Reamer §III-A: an online job's cores are its own; SMT siblings share a core's
/// execution units and caches).
///
/// Equal rather than weighted, because nothing an online job registers says how many cores it
/// needs: `max_instances` counts instances whose size its own search finds, `rate_per_s` is
/// optional and counts requests of the job's own model (one model's request may cost a hundred
/// times another's), and only containers register `cores` (they are not split: their cores come
/// off the top). The CPUs a job's layout leaves of its budget go to offline and batch jobs, not
/// to another online job: that would make its budget depend on its neighbour's layout again.
pub fn online_budgets(cpus: u32, core_width: u32, jobs: &[JobId]) -> BTreeMap<JobId, u32> {
    let ordered = in_id_order(jobs, |id| id);
    let width = core_width.max(1);
    let cores = usize::try_from(cpus / width).unwrap_or(usize::MAX);
    let shares = fair_shares(cores, &vec![usize::MAX; ordered.len()]);
    let mut budgets: Vec<u32> = shares
        .into_iter()
        .map(|share| {
            u32::try_from(share)
                .unwrap_or(u32::MAX)
                .saturating_mul(width)
        })
        .collect();
    // The CPUs of no whole core, one at a time to the smallest budget (the lowest id of those).
    for _ in 0..cpus % width {
        let smallest = (0..budgets.len()).min_by_key(|&i| budgets[i]);
        if let Some(i) = smallest {
            budgets[i] = budgets[i].saturating_add(1);
        }
    }
    ordered.into_iter().cloned().zip(budgets).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(seqs: &[u64]) -> Vec<JobId> {
        seqs.iter().map(|&s| JobId::from_seq(s)).collect()
    }

    fn budgets(cpus: u32, seqs: &[u64]) -> Vec<(u64, u32)> {
        budgets_in_cores(cpus, 1, seqs)
    }

    fn budgets_in_cores(cpus: u32, width: u32, seqs: &[u64]) -> Vec<(u64, u32)> {
        online_budgets(cpus, width, &ids(seqs))
            .into_iter()
            .map(|(id, b)| (id.seq(), b))
            .collect()
    }

    #[test]
    fn online_budgets_split_the_cpus_equally_the_remainder_to_the_lowest_ids() {
        // Alone: every CPU, as before budgets.
        assert_eq!(budgets(16, &[3]), vec![(3, 16)]);
        assert_eq!(budgets(16, &[1, 2]), vec![(1, 8), (2, 8)]);
        // Listed out of order, and once more: ids order the remainder, a job counts once.
        assert_eq!(budgets(7, &[10, 2, 10]), vec![(2, 4), (10, 3)]);
        assert_eq!(budgets(11, &[4, 1, 9]), vec![(1, 4), (4, 4), (9, 3)]);
        // More jobs than CPUs: the lowest ids get one, the others none.
        assert_eq!(budgets(2, &[1, 2, 3]), vec![(1, 1), (2, 1), (3, 0)]);
        assert_eq!(budgets(0, &[1]), vec![(1, 0)]);
        assert!(budgets(8, &[]).is_empty());
    }

    #[test]
    fn online_budgets_with_smt_are_whole_cores_a_lone_cpu_to_the_smallest() {
        // 14 CPUs, 7 two-thread cores: 4 and 3 cores, not 7 and 7 CPUs (a core split in two).
        assert_eq!(budgets_in_cores(14, 2, &[1, 2]), vec![(1, 8), (2, 6)]);
        assert_eq!(budgets_in_cores(16, 2, &[1, 2]), vec![(1, 8), (2, 8)]);
        // One CPU of no whole core: to the smallest budget, the lowest id of equal ones.
        assert_eq!(budgets_in_cores(15, 2, &[1, 2]), vec![(1, 8), (2, 7)]);
        assert_eq!(budgets_in_cores(13, 2, &[5, 9]), vec![(5, 7), (9, 6)]);
        // Alone: every CPU; a width of 0 is taken as 1.
        assert_eq!(budgets_in_cores(15, 2, &[3]), vec![(3, 15)]);
        assert_eq!(budgets_in_cores(5, 0, &[1, 2]), vec![(1, 3), (2, 2)]);
        assert_eq!(budgets_in_cores(1, 2, &[1, 2]), vec![(1, 1), (2, 0)]);
    }
}
