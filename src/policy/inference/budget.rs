//! Online jobs' core budgets: how many of the CPUs left for online inference each online job's
//! layout search may use. Pure: touches nothing.

use std::collections::BTreeMap;

use super::place::{fair_shares, in_id_order};
use crate::job::JobId;

/// Splits `cpus`, the CPUs online inference may use once fixed-size online containers took
/// theirs, into the budgets of the online `jobs` that search for their layout: equal shares, an
/// indivisible remainder to the lowest ids (`JobId::seq`). A job listed twice counts once.
///
/// A budget depends only on `cpus` and on which online jobs there are, never on another job's
/// probe or layout: one job's search cannot restart another's (each searches over its own
/// budget, and a search restarts only when that changes), and every job gets a share however
/// greedy the first one's layout would be. A job alone gets every CPU, as before budgets.
///
/// Equal rather than weighted, because nothing an online job registers says how many cores it
/// needs: `max_instances` counts instances whose size its own search finds, `rate_per_s` is
/// optional and counts requests of the job's own model (one model's request may cost a hundred
/// times another's), and only containers register `cores` (they are not split: their cores come
/// off the top). The CPUs a job's layout leaves of its budget go to offline and batch jobs, not
/// to another online job: that would make its budget depend on its neighbour's layout again.
pub fn online_budgets(cpus: u32, jobs: &[JobId]) -> BTreeMap<JobId, u32> {
    let ordered = in_id_order(jobs, |id| id);
    let total = usize::try_from(cpus).unwrap_or(usize::MAX);
    let shares = fair_shares(total, &vec![usize::MAX; ordered.len()]);
    ordered
        .into_iter()
        .zip(shares)
        .map(|(id, share)| (id.clone(), u32::try_from(share).unwrap_or(u32::MAX)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(seqs: &[u64]) -> Vec<JobId> {
        seqs.iter().map(|&s| JobId::from_seq(s)).collect()
    }

    fn budgets(cpus: u32, seqs: &[u64]) -> Vec<(u64, u32)> {
        online_budgets(cpus, &ids(seqs))
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
}
