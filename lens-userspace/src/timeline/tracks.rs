//! Which track a slice goes on, and the ids that make tracks and flows unique.
//!
//! Perfetto draws the slices of one track as a stack: a slice's end closes the slice
//! opened last. Spans reach the timeline as they end, children before their parents, so
//! their begin and end packets are not in time order, and Perfetto's trace processor
//! orders packets by timestamp, then by their place in the file. Two rules keep every
//! track a proper stack whatever the order spans arrive in:
//! - parents and children are never on one track: each thread has one track per
//!   [`Level`] (steps and the other phases; forward/backward and optimizer; calls);
//! - on one track, slices never overlap, and a slice never ends where one written before
//!   it begins (at one timestamp, the earlier-written begin would come first). A slice that
//!   cannot go on a track goes on the next of the same level (a *lane*), made when needed.
use std::collections::BTreeMap;

use md5::{Digest, Md5};

use crate::{names, spans::SpanRecord};

/// How deep in the span tree a span sits, by what it is: each level of a thread is drawn
/// on tracks of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Level {
    /// `train.job`: on the process's track.
    Job,
    /// Steps, evaluations, checkpoints, model initialisation, checkpoint loads.
    Phase,
    /// `train.forward_backward` and `train.optimizer`, inside a step.
    StepPart,
    /// Everything else: collectives, syncs, configured functions, hang reports.
    Call,
}

impl Level {
    pub fn of(span: &SpanRecord) -> Level {
        match span.name {
            names::JOB => Level::Job,
            names::MODEL_INIT
            | names::LOAD_CHECKPOINT
            | names::STEP
            | names::EVALUATE
            | names::CHECKPOINT => Level::Phase,
            names::FORWARD_BACKWARD | names::OPTIMIZER => Level::StepPart,
            _ => Level::Call,
        }
    }

    /// The name of its tracks (the first lane's; more lanes are numbered).
    pub fn track_name(self) -> &'static str {
        match self {
            Level::Job => "job",
            Level::Phase => "phases",
            Level::StepPart => "forward_backward · optimizer",
            Level::Call => "calls",
        }
    }
}

/// Intervals a lane keeps to check new slices against; older ones are forgotten and
/// only their latest end is kept ([`Lane::horizon`]).
const LANE_MEMORY: usize = 1024;

/// One track's slices, as far as new ones must be checked against them.
#[derive(Debug)]
pub struct Lane {
    pub uuid: u64,
    /// Start → end of the slices written, the latest [`LANE_MEMORY`].
    slices: BTreeMap<u64, u64>,
    /// The latest end of the forgotten slices: nothing may start before it.
    horizon: u64,
}

impl Lane {
    pub fn new(uuid: u64) -> Lane {
        Lane {
            uuid,
            slices: BTreeMap::new(),
            horizon: 0,
        }
    }

    /// Whether a slice from `start` to `end`, written now, keeps this track a stack.
    pub fn fits(&self, start: u64, end: u64) -> bool {
        if start < self.horizon || self.slices.contains_key(&start) {
            return false;
        }
        // The slices are disjoint and sorted: the last one starting before `end` is the
        // only one that can reach into this one.
        if let Some((_, &before_end)) = self.slices.range(..end).next_back()
            && before_end > start
        {
            return false;
        }
        // One written earlier beginning where this one ends would be opened first.
        end == start || !self.slices.contains_key(&end)
    }

    pub fn take(&mut self, start: u64, end: u64) {
        self.slices.insert(start, end);
        if self.slices.len() > LANE_MEMORY
            && let Some((_, oldest_end)) = self.slices.pop_first()
        {
            self.horizon = self.horizon.max(oldest_end);
        }
    }
}

/// Makes the ids of one writer's tracks and the run's flows: 64-bit, from MD5, so that
/// files of several nodes, each with its own writer, concatenate into one trace.
#[derive(Clone, Debug)]
pub struct Ids {
    /// What tells this writer apart: host, boot, lens-probe's pid and start.
    writer: [u8; 16],
}

impl Ids {
    pub fn new(writer_key: &str) -> Ids {
        Ids {
            writer: Md5::digest(writer_key.as_bytes()).into(),
        }
    }

    /// The packet sequence of this writer: never 0 (Perfetto's "no sequence").
    pub fn sequence(&self) -> u32 {
        u32::from_le_bytes([
            self.writer[0],
            self.writer[1],
            self.writer[2],
            self.writer[3],
        ]) | 1
    }

    /// A track of this writer, named by `parts` (pid, tid, level, lane…).
    pub fn track(&self, parts: &[u64]) -> u64 {
        let mut hash = Md5::new();
        hash.update(self.writer);
        for part in parts {
            hash.update(part.to_le_bytes());
        }
        first_u64(hash.finalize().into())
    }
}

/// The flow of one collective: the same on every rank and every node (communicator id
/// and sequence number, as the spans carry them), so Perfetto joins its slices into one
/// chain of arrows, in the order the ranks arrived.
pub fn collective_flow(comm_id: &str, seq: i64) -> u64 {
    let mut hash = Md5::new();
    hash.update(b"collective\0");
    hash.update(comm_id.as_bytes());
    hash.update(seq.to_le_bytes());
    first_u64(hash.finalize().into())
}

fn first_u64(digest: [u8; 16]) -> u64 {
    let mut bytes = [0; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_takes_slices_that_follow_or_touch_the_ones_before() {
        let mut lane = Lane::new(1);
        assert!(lane.fits(10, 20));
        lane.take(10, 20);
        assert!(
            lane.fits(20, 30),
            "begins where the last ended: its begin is written after that end"
        );
        lane.take(20, 30);
        assert!(
            lane.fits(40, 40),
            "a zero-length slice apart from the others"
        );
        assert!(lane.fits(0, 5));
    }

    #[test]
    fn a_lane_refuses_what_would_unbalance_its_stack() {
        let mut lane = Lane::new(1);
        lane.take(10, 20);
        assert!(!lane.fits(15, 25), "overlap");
        assert!(!lane.fits(5, 15), "overlap from before");
        assert!(
            !lane.fits(12, 18),
            "inside: a child belongs to another level"
        );
        assert!(!lane.fits(5, 25), "around");
        assert!(!lane.fits(10, 12), "same start");
        assert!(!lane.fits(5, 10), "ends where one written before begins");
        assert!(!lane.fits(10, 10), "zero-length at a written begin");
    }

    #[test]
    fn a_lane_forgets_old_slices_but_refuses_anything_before_them() {
        let mut lane = Lane::new(1);
        for i in 0..(LANE_MEMORY as u64 + 10) {
            lane.take(i * 10, i * 10 + 5);
        }
        assert_eq!(lane.slices.len(), LANE_MEMORY);
        assert!(
            !lane.fits(6, 7),
            "before the horizon, between forgotten slices"
        );
        let last = LANE_MEMORY as u64 + 10;
        assert!(lane.fits(last * 10, last * 10 + 1));
    }

    #[test]
    fn ids_differ_by_writer_and_part_and_flows_do_not_depend_on_the_writer() {
        let a = Ids::new("host-a boot-1 pid-10 t-1");
        let b = Ids::new("host-b boot-2 pid-10 t-1");
        assert_ne!(a.track(&[42, 42]), b.track(&[42, 42]));
        assert_ne!(a.track(&[42, 42]), a.track(&[42, 43]));
        assert_eq!(a.track(&[7]), a.track(&[7]));
        assert_ne!(a.sequence(), 0);
        assert_ne!(a.sequence(), b.sequence());
        assert_eq!(collective_flow("abc", 3), collective_flow("abc", 3));
        assert_ne!(collective_flow("abc", 3), collective_flow("abc", 4));
    }
}
