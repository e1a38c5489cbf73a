//! Collective completion: an NCCL call returns once the collective is enqueued, so its
//! span waits (in the pending spans, `spans::pending`) until what the host does next on
//! the same stream tells when it finished (docs/collectives.md has the rules), and until
//! the same collective's calls on the other traced ranks have arrived (`stragglers`).
//! This tracker keeps what decides that, by serial; the span itself stays in the store
//! under its key. Once both are known the span ends at the inferred completion.
use std::collections::{BTreeMap, BTreeSet, VecDeque};

// foldhash, seeded per run as std's SipHash is, and several times faster on these small
// integer keys (SipHash was a twelfth of the consumer's time at a million collectives a
// second).
use foldhash::HashMap;
use slab::Slab;

use super::{
    SpanRecord,
    pending::{MAX_HELD_COLLECTIVES, PendingKey, PendingSpans, waited_too_long},
    straggler_cause::PhaseHistory,
    stragglers::{Arrival, MatchKey, Matched, Matcher, OpStragglers},
};
use crate::{
    events::{CollectiveOp, Communicator, SyncKind},
    semconv,
};

/// What told a collective's completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndSource {
    /// The first successful `cudaEventQuery` of the event recorded after it.
    EventQuery,
    /// `cudaEventSynchronize` of that event returned.
    EventSynchronize,
    /// `cudaStreamSynchronize` of its stream returned.
    StreamSynchronize,
    /// `cudaDeviceSynchronize` returned.
    DeviceSynchronize,
    /// Nothing did: the span ends at the enqueue call's return.
    CallReturn,
}

impl EndSource {
    pub const fn name(self) -> &'static str {
        match self {
            EndSource::EventQuery => "event_query",
            EndSource::EventSynchronize => "event_synchronize",
            EndSource::StreamSynchronize => "stream_synchronize",
            EndSource::DeviceSynchronize => "device_synchronize",
            EndSource::CallReturn => "call_return",
        }
    }

    fn from_sync(kind: SyncKind) -> EndSource {
        match kind {
            SyncKind::Stream => EndSource::StreamSynchronize,
            SyncKind::Event => EndSource::EventSynchronize,
            SyncKind::Device => EndSource::DeviceSynchronize,
        }
    }
}

/// A collective whose span waits for its end.
struct Held {
    /// Its span in the pending spans.
    key: PendingKey,
    pid: u32,
    stream: u64,
    /// The enqueue call's return.
    returned_ns: u64,
    /// The completion came after this.
    not_before_ns: u64,
    end: Option<(u64, EndSource)>,
    /// The event recorded after it on its stream, if one was.
    event: Option<u64>,
    /// Waiting for the same collective on other ranks.
    waiting_for_ranks: bool,
}

impl Held {
    fn ready(&self) -> bool {
        self.end.is_some() && !self.waiting_for_ranks
    }

    /// The completion is known no later than `at_ns` (the first bound wins: a later one
    /// can only be looser).
    fn complete_by(&mut self, at_ns: u64, source: EndSource) {
        if self.end.is_none() {
            self.end = Some((at_ns.max(self.returned_ns), source));
        }
    }

    /// Ends its span at the completion, with how that was inferred: the span, when it
    /// waits for nothing else.
    fn finish(self, pending: &mut PendingSpans) -> Option<SpanRecord> {
        let (end_ns, source) = self
            .end
            .unwrap_or((self.returned_ns, EndSource::CallReturn));
        if let Some(record) = pending.record_mut(self.key) {
            record.set_attr(
                semconv::DL_COLLECTIVE_ENQUEUE_DURATION_NS,
                self.returned_ns.saturating_sub(record.start_ns),
            );
            record.set_attr(semconv::DL_COLLECTIVE_END_SOURCE, source.name());
            if source != EndSource::CallReturn {
                record.set_attr(
                    semconv::DL_COLLECTIVE_END_PRECISION_NS,
                    end_ns.saturating_sub(self.not_before_ns),
                );
            }
            record.end_ns = end_ns;
        }
        pending.end_known(self.key)
    }
}

/// Held spans by serial. Serials are handed out in order and mostly leave in order, so a
/// window of slots from the oldest held serial: O(1) by serial, no tree to rebalance (a
/// `BTreeMap` of spans was most of the consumer's time at a million collectives a
/// second). The window spans every serial since the oldest held one, released or not
/// (one collective nothing completes keeps it open for up to `MAX_WAIT_NS`), so a slot
/// is a key into a slab of the held spans, which never holds more than are held.
#[derive(Default)]
struct HeldSpans {
    /// The serial of `window[0]`.
    first: u64,
    window: VecDeque<Option<usize>>,
    spans: Slab<Held>,
}

impl HeldSpans {
    fn key(&self, serial: u64) -> Option<usize> {
        let index = usize::try_from(serial.checked_sub(self.first)?).ok()?;
        *self.window.get(index)?
    }

    /// Holds `held` under `serial`, which is newer than every serial held so far.
    fn insert(&mut self, serial: u64, held: Held) {
        if self.window.is_empty() {
            self.first = serial;
        }
        let index = (serial - self.first) as usize;
        if self.window.len() <= index {
            self.window.resize(index + 1, None);
        }
        let key = self.spans.insert(held);
        if let Some(replaced) = self.window[index].replace(key) {
            self.spans.remove(replaced);
        }
    }

    fn get(&self, serial: &u64) -> Option<&Held> {
        self.spans.get(self.key(*serial)?)
    }

    fn get_mut(&mut self, serial: &u64) -> Option<&mut Held> {
        let key = self.key(*serial)?;
        self.spans.get_mut(key)
    }

    fn remove(&mut self, serial: &u64) -> Option<Held> {
        let index = usize::try_from(serial.checked_sub(self.first)?).ok()?;
        let key = self.window.get_mut(index)?.take()?;
        while let Some(None) = self.window.front() {
            self.window.pop_front();
            self.first += 1;
        }
        Some(self.spans.remove(key))
    }

    fn oldest(&self) -> Option<u64> {
        // The front slot is always occupied (emptied ones are popped).
        self.window.front().map(|_| self.first)
    }

    fn len(&self) -> usize {
        self.spans.len()
    }

    fn iter(&self) -> impl Iterator<Item = (u64, &Held)> {
        (self.first..)
            .zip(&self.window)
            .filter_map(|(serial, key)| Some((serial, self.spans.get((*key)?)?)))
    }
}

#[derive(Default)]
pub struct Collectives {
    held: HeldSpans,
    next_serial: u64,
    /// Collectives no event was recorded after yet, by (process, stream).
    unbound: HashMap<(u32, u64), VecDeque<u64>>,
    /// Every held collective, by (process, stream): what a stream synchronize completes.
    by_stream: HashMap<(u32, u64), VecDeque<u64>>,
    /// Collectives by the event recorded after them, by (process, event).
    bound: HashMap<(u32, u64), Vec<u64>>,
    /// Traced processes that initialised each communicator (by id hash).
    members: HashMap<u64, BTreeSet<u32>>,
    /// The next collective number per (process, communicator handle).
    sequence: HashMap<(u32, u64), u64>,
    matcher: Matcher,
}

impl Collectives {
    /// Process `pid` initialised the communicator with this id hash.
    pub fn comm_init(&mut self, pid: u32, handle: u64, id_hash: u64) {
        self.members.entry(id_hash).or_default().insert(pid);
        self.sequence.insert((pid, handle), 0);
    }

    /// A collective call returned: its span (under `key`, waiting for its end, ending at
    /// the call's return) waits until its completion and the other ranks' calls are
    /// known. Returns spans now ready to go out.
    pub fn add(
        &mut self,
        key: PendingKey,
        op: CollectiveOp,
        stream: u64,
        comm: Option<Communicator>,
        history: &PhaseHistory,
        pending: &mut PendingSpans,
    ) -> Vec<SpanRecord> {
        let Some(record) = pending.record_mut(key) else {
            return Vec::new();
        };
        let serial = self.next_serial;
        self.next_serial += 1;
        let pid = record.pid;
        let mut matched = None;
        let mut waiting_for_ranks = false;
        if let Some(comm) = comm
            && let Some(next) = self.sequence.get_mut(&(pid, comm.handle))
        {
            let seq = *next;
            *next += 1;
            record.set_attr(semconv::DL_COLLECTIVE_SEQ, seq);
            let members: Vec<u32> = self.members[&comm.id_hash].iter().copied().collect();
            if members.len() >= 2 {
                let key: MatchKey = (comm.id_hash, seq);
                let arrival = Arrival {
                    serial,
                    pid,
                    rank: comm.rank,
                    at_ns: record.start_ns,
                };
                matched = self.matcher.arrive(key, op, &members, arrival);
                waiting_for_ranks = matched.is_none();
            }
        }
        let returned_ns = record.end_ns;
        self.held.insert(
            serial,
            Held {
                key,
                pid,
                not_before_ns: record.start_ns,
                stream,
                returned_ns,
                end: None,
                event: None,
                waiting_for_ranks,
            },
        );
        // Serials in order, oldest first: each list stays sorted by pushing at the back.
        self.unbound
            .entry((pid, stream))
            .or_default()
            .push_back(serial);
        self.by_stream
            .entry((pid, stream))
            .or_default()
            .push_back(serial);
        let mut ready = Vec::new();
        if let Some(matched) = matched {
            self.apply_match(&matched, &mut ready, history, pending);
        }
        while self.held.len() > MAX_HELD_COLLECTIVES {
            let Some(oldest) = self.held.oldest() else {
                break;
            };
            ready.extend(self.take(oldest).and_then(|held| held.finish(pending)));
        }
        ready
    }

    /// Stops holding `serial`: out of every index.
    fn take(&mut self, serial: u64) -> Option<Held> {
        let held = self.held.remove(&serial)?;
        let key = (held.pid, held.stream);
        for index in [&mut self.unbound, &mut self.by_stream] {
            if let Some(serials) = index.get_mut(&key) {
                // Mostly the oldest: collectives on a stream complete in order.
                if serials.front() == Some(&serial) {
                    serials.pop_front();
                } else if let Ok(at) = serials.binary_search(&serial) {
                    serials.remove(at);
                }
                if serials.is_empty() {
                    index.remove(&key);
                }
            }
        }
        Some(held)
    }

    /// `cudaEventRecord(event, stream)` in `pid`: the event now stands for the
    /// collectives enqueued on `stream` since the last such record, and no longer for
    /// what it stood for before.
    pub fn event_recorded(&mut self, pid: u32, event: u64, stream: u64) {
        for serial in self.bound.remove(&(pid, event)).unwrap_or_default() {
            if let Some(held) = self.held.get_mut(&serial) {
                held.event = None;
            }
        }
        let serials: Vec<u64> = self
            .unbound
            .remove(&(pid, stream))
            .unwrap_or_default()
            .into_iter()
            .filter(|serial| self.held.get(serial).is_some_and(|held| held.end.is_none()))
            .collect();
        for serial in &serials {
            if let Some(held) = self.held.get_mut(serial) {
                held.event = Some(event);
            }
        }
        if !serials.is_empty() {
            self.bound.insert((pid, event), serials);
        }
    }

    /// The first successful query of `event` in `pid` returned at `at_ns`; the last that
    /// found it not ready began at `not_ready_ns`.
    pub fn event_complete(
        &mut self,
        pid: u32,
        event: u64,
        at_ns: u64,
        not_ready_ns: Option<u64>,
        pending: &mut PendingSpans,
    ) -> Vec<SpanRecord> {
        let serials = self.bound.remove(&(pid, event)).unwrap_or_default();
        // Not ready means the stream had not reached the event: the last collective
        // before it had not completed. Earlier ones may have.
        if let Some(not_ready_ns) = not_ready_ns
            && let Some(last) = serials.iter().max()
            && let Some(held) = self.held.get_mut(last)
        {
            held.not_before_ns = held.not_before_ns.max(not_ready_ns);
        }
        for serial in &serials {
            if let Some(held) = self.held.get_mut(serial) {
                held.event = None;
                held.complete_by(at_ns, EndSource::EventQuery);
            }
        }
        self.release(serials, pending)
    }

    /// A synchronisation call of `pid` on `handle` returned at `at_ns`: every collective
    /// it waited for has completed.
    pub fn sync_returned(
        &mut self,
        pid: u32,
        kind: SyncKind,
        handle: u64,
        at_ns: u64,
        pending: &mut PendingSpans,
    ) -> Vec<SpanRecord> {
        let source = EndSource::from_sync(kind);
        let serials: Vec<u64> = match kind {
            SyncKind::Event => self.bound.remove(&(pid, handle)).unwrap_or_default(),
            SyncKind::Stream | SyncKind::Device => self
                .by_stream
                .iter()
                .filter(|((p, stream), _)| {
                    *p == pid && (kind == SyncKind::Device || *stream == handle)
                })
                .flat_map(|(_, serials)| serials.iter().copied())
                .filter(|serial| self.held.get(serial).is_some_and(|h| h.end.is_none()))
                .collect(),
        };
        for serial in &serials {
            if let Some(held) = self.held.get_mut(serial) {
                held.complete_by(at_ns, source);
            }
        }
        self.release(serials, pending)
    }

    /// Spans that have waited too long for their end at `now_ns` (the pending spans'
    /// rule) go out with what is known.
    pub fn expire(&mut self, now_ns: u64, pending: &mut PendingSpans) -> Vec<SpanRecord> {
        let old: BTreeSet<u64> = self
            .held
            .iter()
            .filter(|(_, held)| waited_too_long(held.returned_ns, now_ns))
            .map(|(serial, _)| serial)
            .collect();
        if old.is_empty() {
            return Vec::new();
        }
        let given_up = self
            .matcher
            .give_up(|_, arrivals| !arrivals.iter().any(|a| old.contains(&a.serial)));
        for serial in given_up.iter().chain(&old) {
            if let Some(held) = self.held.get_mut(serial) {
                held.waiting_for_ranks = false;
                if old.contains(serial) && held.end.is_none() {
                    held.end = Some((held.returned_ns, EndSource::CallReturn));
                }
            }
        }
        self.release(given_up.into_iter().chain(old).collect(), pending)
    }

    /// `pid` ended: its held spans go out with what is known, and the other ranks no
    /// longer wait for it.
    pub fn process_ended(
        &mut self,
        pid: u32,
        history: &PhaseHistory,
        pending: &mut PendingSpans,
    ) -> Vec<SpanRecord> {
        for members in self.members.values_mut() {
            members.remove(&pid);
        }
        self.members.retain(|_, members| !members.is_empty());
        self.sequence.retain(|(p, _), _| *p != pid);
        self.bound.retain(|(p, _), _| *p != pid);
        let (matched, alone) = self.matcher.rank_gone(pid);
        let mut ready = Vec::new();
        for matched in &matched {
            self.apply_match(matched, &mut ready, history, pending);
        }
        for serial in &alone {
            if let Some(held) = self.held.get_mut(serial) {
                held.waiting_for_ranks = false;
            }
        }
        ready.extend(self.release(alone, pending));
        let own: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, held)| held.pid == pid)
            .map(|(serial, _)| serial)
            .collect();
        // Matches still waiting that this process had arrived in: its span goes now,
        // theirs when the match completes or expires.
        for serial in own {
            ready.extend(self.take(serial).and_then(|held| held.finish(pending)));
        }
        ready
    }

    pub fn stragglers(&self) -> &BTreeMap<CollectiveOp, OpStragglers> {
        self.matcher.stats()
    }

    fn apply_match(
        &mut self,
        matched: &Matched,
        ready: &mut Vec<SpanRecord>,
        history: &PhaseHistory,
        pending: &mut PendingSpans,
    ) {
        let last_pid = matched
            .arrivals
            .iter()
            .find(|a| a.rank == matched.last_rank && a.at_ns == matched.last_at_ns)
            .map(|a| a.pid);
        let pids: Vec<u32> = matched.arrivals.iter().map(|a| a.pid).collect();
        let cause = last_pid.and_then(|late| history.cause(late, &pids, matched.skew_ns));
        if let Some(cause) = cause {
            self.matcher.note_cause(matched, cause);
        }
        for arrival in &matched.arrivals {
            if let Some(held) = self.held.get_mut(&arrival.serial) {
                held.waiting_for_ranks = false;
                let Some(record) = pending.record_mut(held.key) else {
                    continue;
                };
                record.set_attr(semconv::DL_COLLECTIVE_LAST_RANK, matched.last_rank);
                record.set_attr(semconv::DL_COLLECTIVE_ARRIVAL_SKEW_NS, matched.skew_ns);
                record.set_attr(
                    semconv::DL_COLLECTIVE_WAIT_NS,
                    matched.last_at_ns.saturating_sub(arrival.at_ns),
                );
                record.set_attr(
                    semconv::DL_COLLECTIVE_RANKS_COMPARED,
                    matched.arrivals.len() as u64,
                );
                if let Some(cause) = cause {
                    record.set_attr(semconv::DL_COLLECTIVE_STRAGGLER_CAUSE, cause.name());
                }
            }
        }
        ready.extend(self.release(matched.arrivals.iter().map(|a| a.serial).collect(), pending));
    }

    /// Ends the spans of those of `serials` whose end is known: the spans that wait
    /// for nothing else.
    fn release(&mut self, serials: Vec<u64>, pending: &mut PendingSpans) -> Vec<SpanRecord> {
        let mut ready = Vec::new();
        for serial in serials {
            if self.held.get(&serial).is_some_and(Held::ready)
                && let Some(held) = self.take(serial)
            {
                ready.extend(held.finish(pending));
            }
        }
        ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        settings::groups::SpanGroup,
        spans::pending::{MAX_WAIT_NS, Waits},
        spans::{AttrValue, SpanId, SpanStatus},
    };

    const S: u64 = 0x5000;
    const E: u64 = 0x7000;

    fn call(pid: u32, id: u64, start_ns: u64, end_ns: u64) -> SpanRecord {
        SpanRecord {
            id: SpanId(id),
            parent: None,
            name: CollectiveOp::AllReduce.span_name(),
            group: SpanGroup::Step,
            pid,
            tid: pid,
            start_ns,
            end_ns,
            attributes: Vec::new(),
            events: Vec::new(),
            status: SpanStatus::Unset,
        }
    }

    /// The tracker with the store its spans wait in.
    #[derive(Default)]
    struct Tracked {
        collectives: Collectives,
        pending: PendingSpans,
    }

    impl Tracked {
        fn add(
            &mut self,
            record: SpanRecord,
            op: CollectiveOp,
            stream: u64,
            comm: Option<Communicator>,
            history: &PhaseHistory,
        ) -> Vec<SpanRecord> {
            let waits = Waits {
                end: true,
                placement: None,
            };
            let key = self.pending.hold(record, waits);
            self.collectives
                .add(key, op, stream, comm, history, &mut self.pending)
        }

        fn comm_init(&mut self, pid: u32, handle: u64, id_hash: u64) {
            self.collectives.comm_init(pid, handle, id_hash);
        }

        fn event_recorded(&mut self, pid: u32, event: u64, stream: u64) {
            self.collectives.event_recorded(pid, event, stream);
        }

        fn event_complete(
            &mut self,
            pid: u32,
            event: u64,
            at_ns: u64,
            not_ready_ns: Option<u64>,
        ) -> Vec<SpanRecord> {
            self.collectives
                .event_complete(pid, event, at_ns, not_ready_ns, &mut self.pending)
        }

        fn sync_returned(
            &mut self,
            pid: u32,
            kind: SyncKind,
            handle: u64,
            at_ns: u64,
        ) -> Vec<SpanRecord> {
            self.collectives
                .sync_returned(pid, kind, handle, at_ns, &mut self.pending)
        }

        fn expire(&mut self, now_ns: u64) -> Vec<SpanRecord> {
            self.collectives.expire(now_ns, &mut self.pending)
        }

        fn process_ended(&mut self, pid: u32, history: &PhaseHistory) -> Vec<SpanRecord> {
            self.collectives
                .process_ended(pid, history, &mut self.pending)
        }

        fn stragglers(&self) -> &BTreeMap<CollectiveOp, OpStragglers> {
            self.collectives.stragglers()
        }
    }

    fn source(span: &SpanRecord) -> Option<&AttrValue> {
        span.attr(semconv::DL_COLLECTIVE_END_SOURCE)
    }

    #[test]
    fn the_first_successful_query_of_the_event_after_it_ends_the_collective() {
        let mut collectives = Tracked::default();
        let op = CollectiveOp::AllReduce;
        assert!(
            collectives
                .add(call(1, 1, 10, 12), op, S, None, &PhaseHistory::default())
                .is_empty()
        );
        collectives.event_recorded(1, E, S);
        // A query of another process's event of the same value tells nothing.
        assert!(collectives.event_complete(2, E, 20, None).is_empty());
        let done = collectives.event_complete(1, E, 50, Some(40));
        assert_eq!(done.len(), 1);
        let span = &done[0];
        assert_eq!((span.start_ns, span.end_ns), (10, 50));
        assert_eq!(source(span), Some(&"event_query".into()));
        assert_eq!(
            span.int_attr(semconv::DL_COLLECTIVE_END_PRECISION_NS),
            Some(10)
        );
        assert_eq!(
            span.int_attr(semconv::DL_COLLECTIVE_ENQUEUE_DURATION_NS),
            Some(2)
        );
    }

    #[test]
    fn syncs_bound_the_end_of_what_they_waited_for_only() {
        let mut collectives = Tracked::default();
        let op = CollectiveOp::AllReduce;
        collectives.add(call(1, 1, 10, 12), op, S, None, &PhaseHistory::default());
        collectives.add(
            call(1, 2, 14, 15),
            op,
            S + 1,
            None,
            &PhaseHistory::default(),
        );
        // Another stream's sync: nothing.
        assert!(
            collectives
                .sync_returned(1, SyncKind::Stream, S + 2, 20)
                .is_empty()
        );
        let done = collectives.sync_returned(1, SyncKind::Stream, S, 30);
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].id, done[0].end_ns), (SpanId(1), 30));
        assert_eq!(source(&done[0]), Some(&"stream_synchronize".into()));
        // The bound is what is known: not before its enqueue.
        assert_eq!(
            done[0].int_attr(semconv::DL_COLLECTIVE_END_PRECISION_NS),
            Some(20)
        );
        let done = collectives.sync_returned(1, SyncKind::Device, 0, 40);
        assert_eq!((done[0].id, done[0].end_ns), (SpanId(2), 40));
        assert_eq!(source(&done[0]), Some(&"device_synchronize".into()));
    }

    #[test]
    fn a_re_recorded_event_stands_for_the_later_collective_only() {
        let mut collectives = Tracked::default();
        let op = CollectiveOp::AllReduce;
        collectives.add(call(1, 1, 10, 12), op, S, None, &PhaseHistory::default());
        collectives.event_recorded(1, E, S);
        // PyTorch reuses its events: the same one recorded after a collective elsewhere.
        collectives.add(
            call(1, 2, 20, 22),
            op,
            S + 1,
            None,
            &PhaseHistory::default(),
        );
        collectives.event_recorded(1, E, S + 1);
        let done = collectives.event_complete(1, E, 60, None);
        assert_eq!(done.iter().map(|s| s.id).collect::<Vec<_>>(), [SpanId(2)]);
        // The first is still held, and an event sync of E says nothing of it now.
        assert!(
            collectives
                .sync_returned(1, SyncKind::Event, E, 70)
                .is_empty()
        );
        let done = collectives.process_ended(1, &PhaseHistory::default());
        assert_eq!((done[0].id, done[0].end_ns), (SpanId(1), 12));
        assert_eq!(source(&done[0]), Some(&"call_return".into()));
        assert_eq!(
            done[0].attr(semconv::DL_COLLECTIVE_END_PRECISION_NS),
            None,
            "no bound when nothing told"
        );
    }

    #[test]
    fn two_ranks_are_compared_and_held_until_both_called() {
        let mut collectives = Tracked::default();
        let op = CollectiveOp::AllReduce;
        let comm = |rank: i32| Communicator {
            handle: 0xc0 + rank as u64,
            id_hash: 0xfeed,
            rank,
            nranks: 2,
        };
        collectives.comm_init(100, 0xc0, 0xfeed);
        collectives.comm_init(101, 0xc1, 0xfeed);
        collectives.add(
            call(100, 1, 1_000, 1_100),
            op,
            S,
            Some(comm(0)),
            &PhaseHistory::default(),
        );
        // Rank 0's collective completed, but rank 1 has not called it yet: held.
        assert!(
            collectives
                .sync_returned(100, SyncKind::Stream, S, 9_000)
                .is_empty()
        );
        let done = collectives.add(
            call(101, 2, 6_000, 6_100),
            op,
            S,
            Some(comm(1)),
            &PhaseHistory::default(),
        );
        assert_eq!(done.len(), 1, "rank 0's span goes once rank 1 arrived");
        assert_eq!(done[0].int_attr(semconv::DL_COLLECTIVE_LAST_RANK), Some(1));
        assert_eq!(
            done[0].int_attr(semconv::DL_COLLECTIVE_ARRIVAL_SKEW_NS),
            Some(5_000)
        );
        assert_eq!(
            done[0].int_attr(semconv::DL_COLLECTIVE_WAIT_NS),
            Some(5_000)
        );
        assert_eq!(done[0].int_attr(semconv::DL_COLLECTIVE_SEQ), Some(0));
        let done = collectives.sync_returned(101, SyncKind::Stream, S, 9_100);
        assert_eq!(done[0].int_attr(semconv::DL_COLLECTIVE_WAIT_NS), Some(0));
        assert_eq!(
            done[0].int_attr(semconv::DL_COLLECTIVE_RANKS_COMPARED),
            Some(2)
        );
        let stats = &collectives.stragglers()[&op];
        assert_eq!(stats.last_by_rank, BTreeMap::from([(1, 1)]));
    }

    #[test]
    fn one_stuck_span_keeps_only_itself_held_while_later_ones_leave() {
        let mut collectives = Tracked::default();
        // Serial 0 on a stream nothing completes; 1000 more on another, each synced.
        collectives.add(
            call(7, 0, 10, 20),
            CollectiveOp::AllReduce,
            S,
            None,
            &PhaseHistory::default(),
        );
        for i in 1..=1000u64 {
            collectives.add(
                call(7, i, 10 * i, 10 * i + 5),
                CollectiveOp::AllReduce,
                E,
                None,
                &PhaseHistory::default(),
            );
            let done = collectives.sync_returned(7, SyncKind::Stream, E, 10 * i + 8);
            assert_eq!(done.len(), 1);
        }
        assert_eq!(collectives.collectives.held.len(), 1);
        assert_eq!(collectives.collectives.held.oldest(), Some(0));
        assert!(
            collectives.collectives.held.spans.capacity() <= 4,
            "the slab holds what is held, not the window"
        );
        let done = collectives.sync_returned(7, SyncKind::Stream, S, 20_000);
        assert_eq!(done.len(), 1);
        assert_eq!(collectives.collectives.held.len(), 0);
        assert!(
            collectives.collectives.held.window.is_empty(),
            "the window closes behind it"
        );
    }

    #[test]
    fn a_collective_nothing_completes_goes_out_after_the_hold_limit() {
        let mut collectives = Tracked::default();
        collectives.add(
            call(1, 1, 10, 12),
            CollectiveOp::Broadcast,
            S,
            None,
            &PhaseHistory::default(),
        );
        assert!(collectives.expire(MAX_WAIT_NS).is_empty());
        let done = collectives.expire(MAX_WAIT_NS + 13);
        assert_eq!(
            (done[0].end_ns, source(&done[0])),
            (12, Some(&"call_return".into()))
        );
    }
}
