//! Straggler detection: the same collective on every traced rank of a communicator
//! (communicator id hash + the collective's number on it), its arrival skew (last
//! enqueue − first) and the rank that came last. Ranks on one node share
//! `CLOCK_MONOTONIC`, so their enqueue times compare directly (docs/collectives.md).
use std::collections::BTreeMap;

use foldhash::HashMap;

use serde::Serialize;

use super::straggler_cause::StragglerCause;
use crate::events::CollectiveOp;

/// One collective across ranks: the communicator's id hash and the collective's number.
pub type MatchKey = (u64, u64);

/// One rank's call of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// The caller's handle for the pending span (`collectives::Collectives`).
    pub serial: u64,
    pub pid: u32,
    /// Communicator rank.
    pub rank: i32,
    /// Enqueue call entry, `CLOCK_MONOTONIC` ns.
    pub at_ns: u64,
}

/// Every expected rank arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matched {
    pub op: CollectiveOp,
    pub arrivals: Vec<Arrival>,
    pub last_rank: i32,
    pub last_at_ns: u64,
    pub skew_ns: u64,
}

struct Waiting {
    op: CollectiveOp,
    /// The traced processes of the communicator when the first rank arrived.
    expected: Vec<u32>,
    arrivals: Vec<Arrival>,
}

impl Waiting {
    fn all_arrived(&self) -> bool {
        self.expected
            .iter()
            .all(|pid| self.arrivals.iter().any(|a| a.pid == *pid))
    }
}

/// Per operation, who came last how often.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OpStragglers {
    /// Collectives matched across ranks.
    pub matched: u64,
    /// Times each communicator rank arrived last.
    pub last_by_rank: BTreeMap<i32, u64>,
    /// Sum and maximum of the arrival skews.
    pub skew_total_ns: u64,
    pub skew_max_ns: u64,
    /// Per rank that arrived last, why, as often as it was told
    /// (`straggler_cause`: needs whole steps of every rank compared).
    pub causes_of_last: BTreeMap<i32, BTreeMap<StragglerCause, u64>>,
}

#[derive(Default)]
pub struct Matcher {
    waiting: HashMap<MatchKey, Waiting>,
    stats: BTreeMap<CollectiveOp, OpStragglers>,
}

impl Matcher {
    /// `arrival` called collective `key`, which the traced processes `members` take part
    /// in. Returns the match once the last of them arrived.
    pub fn arrive(
        &mut self,
        key: MatchKey,
        op: CollectiveOp,
        members: &[u32],
        arrival: Arrival,
    ) -> Option<Matched> {
        let waiting = self.waiting.entry(key).or_insert_with(|| Waiting {
            op,
            expected: members.to_vec(),
            arrivals: Vec::new(),
        });
        waiting.arrivals.push(arrival);
        if !waiting.all_arrived() {
            return None;
        }
        let waiting = self.waiting.remove(&key)?;
        Some(self.complete(waiting))
    }

    fn complete(&mut self, waiting: Waiting) -> Matched {
        let first = waiting.arrivals.iter().map(|a| a.at_ns).min().unwrap_or(0);
        let last = waiting
            .arrivals
            .iter()
            .max_by_key(|a| (a.at_ns, a.rank))
            .copied()
            .expect("a match has arrivals");
        let skew_ns = last.at_ns - first;
        let stats = self.stats.entry(waiting.op).or_default();
        stats.matched += 1;
        *stats.last_by_rank.entry(last.rank).or_default() += 1;
        stats.skew_total_ns += skew_ns;
        stats.skew_max_ns = stats.skew_max_ns.max(skew_ns);
        Matched {
            op: waiting.op,
            arrivals: waiting.arrivals,
            last_rank: last.rank,
            last_at_ns: last.at_ns,
            skew_ns,
        }
    }

    /// Gives up the collectives some rank never called (it exited, or was traced from a
    /// later point): returns the serials that waited for them.
    pub fn give_up(&mut self, keep: impl Fn(&MatchKey, &[Arrival]) -> bool) -> Vec<u64> {
        let mut given_up = Vec::new();
        self.waiting.retain(|key, waiting| {
            let kept = keep(key, &waiting.arrivals);
            if !kept {
                given_up.extend(waiting.arrivals.iter().map(|a| a.serial));
            }
            kept
        });
        given_up
    }

    /// `pid` is gone: collectives waiting for it no longer do. Returns those that now
    /// have every remaining rank (`Matched` when at least two compared, else the lone
    /// arrival's serials to release unmatched).
    pub fn rank_gone(&mut self, pid: u32) -> (Vec<Matched>, Vec<u64>) {
        let mut done = Vec::new();
        let mut alone = Vec::new();
        let keys: Vec<MatchKey> = self.waiting.keys().copied().collect();
        for key in keys {
            let Some(waiting) = self.waiting.get_mut(&key) else {
                continue;
            };
            if !waiting.expected.contains(&pid) || waiting.arrivals.iter().any(|a| a.pid == pid) {
                continue;
            }
            waiting.expected.retain(|p| *p != pid);
            if waiting.all_arrived() {
                let waiting = self.waiting.remove(&key).expect("present");
                if waiting.arrivals.len() >= 2 {
                    done.push(self.complete(waiting));
                } else {
                    alone.extend(waiting.arrivals.iter().map(|a| a.serial));
                }
            }
        }
        (done, alone)
    }

    /// Why the last rank of `matched` was late.
    pub fn note_cause(&mut self, matched: &Matched, cause: StragglerCause) {
        let stats = self.stats.entry(matched.op).or_default();
        *stats
            .causes_of_last
            .entry(matched.last_rank)
            .or_default()
            .entry(cause)
            .or_default() += 1;
    }

    pub fn stats(&self) -> &BTreeMap<CollectiveOp, OpStragglers> {
        &self.stats
    }
}

/// The exit summary's straggler lines: per operation, the rank that arrived last most
/// often, e.g. `rank 3 arrived last in 87% of all_reduce (870 of 1000 matched; skew mean
/// 4.1 ms, max 12.0 ms)`.
pub fn render(stats: &BTreeMap<CollectiveOp, OpStragglers>) -> String {
    let mut out = String::new();
    for (op, stats) in stats {
        let Some((rank, times)) = stats
            .last_by_rank
            .iter()
            .max_by_key(|(rank, times)| (**times, -**rank))
        else {
            continue;
        };
        let percent = *times as f64 * 100.0 / stats.matched as f64;
        let mean_ms = stats.skew_total_ns as f64 / stats.matched as f64 / 1e6;
        // Its most frequent cause, of the times one was told.
        let cause = stats.causes_of_last.get(rank).and_then(|causes| {
            let told: u64 = causes.values().sum();
            let (cause, n) = causes
                .iter()
                .max_by_key(|(c, n)| (**n, std::cmp::Reverse(**c)))?;
            Some(format!(
                "; cause: {} ({:.0}% of {told} told)",
                cause.name(),
                *n as f64 * 100.0 / told as f64
            ))
        });
        out += &format!(
            "  stragglers: rank {rank} arrived last in {percent:.0}% of {} ({times} of {} matched across ranks; skew mean {mean_ms:.2} ms, max {:.2} ms){}\n",
            op.name(),
            stats.matched,
            stats.skew_max_ns as f64 / 1e6,
            cause.unwrap_or_default(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival(serial: u64, rank: i32, at_ns: u64) -> Arrival {
        Arrival {
            serial,
            pid: 100 + rank as u32,
            rank,
            at_ns,
        }
    }

    #[test]
    fn the_last_of_the_expected_ranks_completes_the_match() {
        let mut matcher = Matcher::default();
        let key = (0xabc, 0);
        let op = CollectiveOp::AllReduce;
        let members = [100, 101];
        assert_eq!(
            matcher.arrive(key, op, &members, arrival(1, 0, 1_000)),
            None
        );
        let matched = matcher
            .arrive(key, op, &members, arrival(2, 1, 6_000))
            .unwrap();
        assert_eq!(matched.last_rank, 1);
        assert_eq!(matched.skew_ns, 5_000);
        assert_eq!(matched.arrivals.len(), 2);
        // The next collective on the communicator is another match.
        assert_eq!(
            matcher.arrive((0xabc, 1), op, &members, arrival(3, 1, 7_000)),
            None
        );
        let matched = matcher
            .arrive((0xabc, 1), op, &members, arrival(4, 0, 7_500))
            .unwrap();
        assert_eq!((matched.last_rank, matched.skew_ns), (0, 500));
        let stats = &matcher.stats()[&op];
        assert_eq!(stats.matched, 2);
        assert_eq!(stats.last_by_rank, BTreeMap::from([(0, 1), (1, 1)]));
        assert_eq!(stats.skew_max_ns, 5_000);
    }

    #[test]
    fn a_rank_that_exits_no_longer_holds_the_others() {
        let mut matcher = Matcher::default();
        let op = CollectiveOp::AllReduce;
        let members = [100, 101, 102];
        assert_eq!(
            matcher.arrive((1, 0), op, &members, arrival(1, 0, 10)),
            None
        );
        assert_eq!(
            matcher.arrive((1, 0), op, &members, arrival(2, 1, 30)),
            None
        );
        // A process of another communicator exiting changes nothing.
        assert_eq!(matcher.rank_gone(555), (vec![], vec![]));
        // Rank 2 (pid 102) exits without calling it.
        let (done, alone) = matcher.rank_gone(102);
        assert!(alone.is_empty());
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].last_rank, done[0].skew_ns), (1, 20));
    }

    #[test]
    fn the_summary_names_the_usual_straggler() {
        let mut matcher = Matcher::default();
        let op = CollectiveOp::AllReduce;
        for seq in 0..10u64 {
            let late = if seq < 8 { 3 } else { 0 };
            for rank in 0..4 {
                let at = seq * 1_000_000 + if rank == late { 2_000_000 } else { 0 };
                let members = [100, 101, 102, 103];
                matcher.arrive(
                    (7, seq),
                    op,
                    &members,
                    arrival(seq * 4 + rank as u64, rank, at),
                );
            }
        }
        let text = render(matcher.stats());
        assert!(
            text.contains("rank 3 arrived last in 80% of all_reduce (8 of 10 matched"),
            "{text}"
        );
        assert!(text.contains("skew mean 2.00 ms, max 2.00 ms"), "{text}");
    }
}
