//! Hang detection (`--hang-timeout`): a collective that some traced ranks of a
//! communicator entered and others did not, or that every traced rank entered and that
//! has not finished, for longer than the timeout. Reported at once, while the job still
//! hangs, with where each rank is (`location`), and again when it resolves.
//!
//! Nothing runs in the kernel for it: the calls in flight are the entries the kernel
//! keeps anyway to pair each call with its return (the `INFLIGHT_*` maps), read by the session once
//! a second; the collectives that returned are counted here from the events that build
//! the spans. So it costs a map walk a second and nothing per call (docs/hangs.md).
//!
//! A collective is named across ranks by its communicator and its number on it (`seq`,
//! from 0, as `dl.collective.seq`): NCCL's communicator is the hash of the unique id
//! every rank passed to `ncclCommInitRank`; gloo has no such id in reach, so a process
//! group is named by the job (its launcher's rendezvous variables) and the order in which
//! the process first used its groups (`GlooGroups`).
pub mod location;
mod report;

pub use report::{HangReport, call_name};

use std::collections::{BTreeMap, HashMap};

use lens_common::ProbeId;

use crate::{
    events::{CollectiveOp, GlooComm, ProbeEvent},
    sys::target::ProcessInfo,
};

/// The default `--hang-timeout`: under PyTorch's 10-minute collective timeout, so the
/// report comes before the watchdog aborts the job.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

/// How often the calls in flight are read.
pub const CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    Nccl,
    Gloo,
}

impl Backend {
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Nccl => "nccl",
            Backend::Gloo => "gloo",
        }
    }
}

/// A call a traced thread is in now (an `INFLIGHT_*` entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InflightCall {
    pub pid: u32,
    pub tid: u32,
    pub probe: ProbeId,
    /// `CLOCK_MONOTONIC` ns at entry.
    pub start_ns: u64,
    /// A collective's communicator (NCCL) or process group (gloo) handle, else 0.
    pub handle: u64,
    /// A collective's payload, when its arguments say it.
    pub bytes: Option<u64>,
}

impl InflightCall {
    fn collective(&self) -> Option<(Backend, CollectiveOp)> {
        if let Some(op) = CollectiveOp::from_probe(self.probe) {
            return Some((Backend::Nccl, op));
        }
        CollectiveOp::from_gloo_probe(self.probe).map(|op| (Backend::Gloo, op))
    }
}

/// One process's calls on one communicator.
#[derive(Clone, Debug)]
struct Member {
    comm: u64,
    rank: i32,
    backend: Backend,
    /// Collectives returned: the next one is number `returned`.
    returned: u64,
    /// Entry of the last one that returned, and what it was.
    last_start_ns: u64,
    last_op: Option<CollectiveOp>,
}

/// Why a collective is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HangKind {
    /// Some traced ranks entered it, others did not.
    RanksMissing,
    /// Every traced rank entered it; it has not finished.
    NotCompleted,
}

impl HangKind {
    pub const fn name(self) -> &'static str {
        match self {
            HangKind::RanksMissing => "ranks_missing",
            HangKind::NotCompleted => "not_completed",
        }
    }
}

/// One traced rank of a hung collective's communicator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankState {
    pub pid: u32,
    pub rank: i32,
    /// Collectives it entered on the communicator.
    pub entered: u64,
    /// The probed call it is in (the collective, or a wait after it), if any.
    pub waiting_in: Option<InflightCall>,
}

/// A collective found hung.
#[derive(Clone, Debug)]
pub struct Hang {
    pub kind: HangKind,
    pub backend: Backend,
    pub op: Option<CollectiveOp>,
    pub comm: u64,
    pub seq: u64,
    pub bytes: Option<u64>,
    /// When the first traced rank entered it (or the unfinished call began).
    pub since_ns: u64,
    pub detected_ns: u64,
    pub arrived: Vec<RankState>,
    pub missing: Vec<RankState>,
}

impl Hang {
    pub fn ranks(&self) -> impl Iterator<Item = &RankState> {
        self.arrived.iter().chain(&self.missing)
    }
}

/// How a reported hang ended.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub hang: Hang,
    pub at_ns: u64,
    /// `false`: a process it waited on or for ended instead.
    pub every_rank_went_on: bool,
}

#[derive(Clone, Debug)]
pub enum HangChange {
    Found(Hang),
    Resolved(Resolved),
}

/// Gloo process groups by job and first use.
#[derive(Default)]
struct GlooGroups {
    /// Per process: its job's key and rank (from its launcher's environment), when it has
    /// them and was traced from before its first collective.
    jobs: HashMap<u32, (u64, i32)>,
    /// Per process: its groups in the order of their first collective.
    seen: HashMap<u32, Vec<u64>>,
}

/// The launcher variables every rank of one job shares.
const JOB_VARIABLES: [&str; 4] = [
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
];

fn job_key(process: &ProcessInfo) -> Option<u64> {
    let environment = &process.view.environment;
    let values: Vec<&str> = JOB_VARIABLES
        .iter()
        .filter_map(|name| {
            environment
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        })
        .collect();
    if values.is_empty() {
        return None;
    }
    Some(fnv1a(values.join("\0").as_bytes()))
}

/// FNV-1a: a stable hash (the same in every lens-probe instance of a job, unlike std's
/// seeded one), for the gloo communicator ids that other nodes must agree on.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

pub struct HangWatcher {
    /// `None`: collectives are counted (gloo's numbers go on their spans), never checked.
    timeout_ns: Option<u64>,
    /// By (process, communicator or group handle).
    members: HashMap<(u32, u64), Member>,
    gloo: GlooGroups,
    /// Reported and not resolved, by (communicator, seq).
    open: BTreeMap<(u64, u64), Hang>,
    found: u64,
}

impl HangWatcher {
    pub fn new(timeout: Option<std::time::Duration>) -> HangWatcher {
        HangWatcher {
            timeout_ns: timeout.map(|t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)),
            members: HashMap::new(),
            gloo: GlooGroups::default(),
            open: BTreeMap::new(),
            found: 0,
        }
    }

    /// Hangs are looked for.
    pub fn watching(&self) -> bool {
        self.timeout_ns.is_some()
    }

    /// Counts what `event` says of the collectives; a gloo call gets its communicator
    /// and number (`GlooCall::comm`).
    pub fn observe(&mut self, event: &mut ProbeEvent) {
        match event {
            ProbeEvent::CommInit {
                timing,
                comm,
                rank,
                comm_id_hash,
                result: 0,
                ..
            } => self.comm_init(timing.tgid, *comm, *comm_id_hash, *rank),
            ProbeEvent::Collective {
                timing, op, comm, ..
            } => self.nccl_returned(timing.tgid, *comm, *op, timing.start_ns),
            ProbeEvent::GlooCall {
                timing,
                op,
                group,
                comm,
            } => *comm = self.gloo_returned(timing.tgid, *group, *op, timing.start_ns),
            _ => {}
        }
    }

    /// Hangs reported so far.
    pub fn found(&self) -> u64 {
        self.found
    }

    /// A traced process: a gloo job member if its launcher says which job and rank, and
    /// it is seen from before its first collective (numbers counted from a later point
    /// would not agree with the other ranks').
    pub fn process_started(&mut self, process: &ProcessInfo, from_start: bool) {
        if !from_start {
            return;
        }
        if let (Some(job), Some(rank)) = (job_key(process), process.rank.as_ref()) {
            let rank = i32::try_from(rank.rank).unwrap_or(-1);
            self.gloo.jobs.insert(process.pid, (job, rank));
        }
    }

    /// `ncclCommInitRank` returned `handle` in `pid`.
    pub fn comm_init(&mut self, pid: u32, handle: u64, id_hash: u64, rank: i32) {
        self.members.insert(
            (pid, handle),
            Member {
                comm: id_hash,
                rank,
                backend: Backend::Nccl,
                returned: 0,
                last_start_ns: 0,
                last_op: None,
            },
        );
    }

    /// An NCCL collective on `handle` returned.
    pub fn nccl_returned(&mut self, pid: u32, handle: u64, op: CollectiveOp, start_ns: u64) {
        if let Some(member) = self.members.get_mut(&(pid, handle)) {
            member.returned += 1;
            member.last_start_ns = start_ns;
            member.last_op = Some(op);
        }
    }

    /// A gloo collective on process group `group` returned: its communicator and number,
    /// when the process is a known job member.
    pub fn gloo_returned(
        &mut self,
        pid: u32,
        group: u64,
        op: CollectiveOp,
        start_ns: u64,
    ) -> Option<GlooComm> {
        self.gloo_member(pid, group)?;
        let member = self.members.get_mut(&(pid, group))?;
        let seq = member.returned;
        member.returned += 1;
        member.last_start_ns = start_ns;
        member.last_op = Some(op);
        Some(GlooComm {
            id: member.comm,
            rank: member.rank,
            seq,
        })
    }

    /// Makes `group` of `pid` a member (numbered in first-use order), if `pid` is a job
    /// member.
    fn gloo_member(&mut self, pid: u32, group: u64) -> Option<()> {
        if group == 0 {
            return None;
        }
        let (job, rank) = *self.gloo.jobs.get(&pid)?;
        if !self.members.contains_key(&(pid, group)) {
            let seen = self.gloo.seen.entry(pid).or_default();
            let ordinal = seen.len() as u64;
            seen.push(group);
            let mut id = Vec::with_capacity(16);
            id.extend_from_slice(&job.to_le_bytes());
            id.extend_from_slice(&ordinal.to_le_bytes());
            self.members.insert(
                (pid, group),
                Member {
                    comm: fnv1a(&id),
                    rank,
                    backend: Backend::Gloo,
                    returned: 0,
                    last_start_ns: 0,
                    last_op: None,
                },
            );
        }
        Some(())
    }

    /// `pid` ended: it is no longer waited on or for. Returns the hangs that ended with
    /// it.
    pub fn process_ended(&mut self, pid: u32, now_ns: u64) -> Vec<HangChange> {
        let ended: Vec<(u64, u64)> = self
            .open
            .iter()
            .filter(|(_, hang)| hang.ranks().any(|r| r.pid == pid))
            .map(|(key, _)| *key)
            .collect();
        let hangs: Vec<Hang> = ended
            .into_iter()
            .filter_map(|key| self.open.remove(&key))
            .collect();
        let changes = hangs
            .into_iter()
            .map(|hang| {
                HangChange::Resolved(Resolved {
                    every_rank_went_on: self.went_on(&hang),
                    hang,
                    at_ns: now_ns,
                })
            })
            .collect();
        self.members.retain(|(p, _), _| *p != pid);
        self.gloo.jobs.remove(&pid);
        self.gloo.seen.remove(&pid);
        changes
    }

    /// Every rank of `hang` returned from its collective (a rank that ended before the
    /// next look may have done so first).
    fn went_on(&self, hang: &Hang) -> bool {
        hang.ranks().all(|rank| {
            self.members.iter().any(|((pid, _), m)| {
                *pid == rank.pid && m.comm == hang.comm && m.returned > hang.seq
            })
        })
    }

    /// One look at the calls in flight now: hangs found and hangs resolved since the last.
    pub fn check(&mut self, now_ns: u64, inflight: &[InflightCall]) -> Vec<HangChange> {
        let Some(timeout_ns) = self.timeout_ns else {
            return Vec::new();
        };
        // A gloo group first seen in flight (its first collective hangs) is a member too.
        for call in inflight {
            if matches!(call.collective(), Some((Backend::Gloo, _))) {
                self.gloo_member(call.pid, call.handle);
            }
        }
        let mut by_comm: BTreeMap<u64, Vec<(u32, u64)>> = BTreeMap::new();
        for key in self.members.keys() {
            by_comm
                .entry(self.members[key].comm)
                .or_default()
                .push(*key);
        }
        let mut changes = Vec::new();
        let mut still_hung = Vec::new();
        for (comm, mut keys) in by_comm {
            keys.sort_unstable();
            if let Some(hang) = self.hang_of(comm, &keys, now_ns, timeout_ns, inflight) {
                let key = (comm, hang.seq);
                still_hung.push(key);
                if !self.open.contains_key(&key) {
                    self.found += 1;
                    self.open.insert(key, hang.clone());
                    changes.push(HangChange::Found(hang));
                }
            }
        }
        let resolved: Vec<(u64, u64)> = self
            .open
            .keys()
            .filter(|key| !still_hung.contains(key))
            .copied()
            .collect();
        for key in resolved {
            if let Some(hang) = self.open.remove(&key) {
                changes.push(HangChange::Resolved(Resolved {
                    every_rank_went_on: self.went_on(&hang),
                    hang,
                    at_ns: now_ns,
                }));
            }
        }
        changes
    }

    /// The communicator's newest collective, if it is hung now.
    fn hang_of(
        &self,
        comm: u64,
        keys: &[(u32, u64)],
        now_ns: u64,
        timeout_ns: u64,
        inflight: &[InflightCall],
    ) -> Option<Hang> {
        let in_collective = |pid: u32, handle: u64| {
            inflight
                .iter()
                .filter(|c| c.pid == pid && c.handle == handle && c.collective().is_some())
                .min_by_key(|c| c.start_ns)
        };
        // Any other probed call a rank has been in since before the timeout (a stream or
        // event synchronize after an NCCL collective that never completes).
        let old_call = |pid: u32| {
            inflight
                .iter()
                .filter(|c| c.pid == pid && now_ns.saturating_sub(c.start_ns) >= timeout_ns)
                .min_by_key(|c| c.start_ns)
        };
        let states: Vec<(RankState, u64, Option<CollectiveOp>, Backend)> = keys
            .iter()
            .map(|key| {
                let member = &self.members[key];
                let current = in_collective(key.0, key.1);
                let entered = member.returned + u64::from(current.is_some());
                let (arrived_ns, op) = match current {
                    Some(call) => (call.start_ns, call.collective().map(|(_, op)| op)),
                    None => (member.last_start_ns, member.last_op),
                };
                let waiting_in = current.or_else(|| old_call(key.0)).cloned();
                (
                    RankState {
                        pid: key.0,
                        rank: member.rank,
                        entered,
                        waiting_in,
                    },
                    arrived_ns,
                    op,
                    member.backend,
                )
            })
            .collect();
        let frontier = states.iter().map(|(s, ..)| s.entered).max()?;
        if frontier == 0 {
            return None;
        }
        let seq = frontier - 1;
        let (arrived, missing): (Vec<_>, Vec<_>) = states
            .into_iter()
            .partition(|(s, ..)| s.entered == frontier);
        let (kind, since_ns) = if missing.is_empty() {
            // Every traced rank entered: hung if one is still in a call begun before the
            // timeout (the collective itself, or a wait for its completion).
            let since = arrived
                .iter()
                .filter_map(|(s, arrived_ns, ..)| {
                    let call = s.waiting_in.as_ref()?;
                    (call.start_ns >= *arrived_ns || call.collective().is_some())
                        .then_some(call.start_ns)
                })
                .min()?;
            (HangKind::NotCompleted, since)
        } else {
            let since = arrived.iter().map(|(_, at, ..)| *at).min()?;
            (HangKind::RanksMissing, since)
        };
        if now_ns.saturating_sub(since_ns) < timeout_ns {
            return None;
        }
        let op = arrived.iter().find_map(|(_, _, op, _)| *op);
        let backend = arrived[0].3;
        let bytes = arrived
            .iter()
            .find_map(|(s, ..)| s.waiting_in.as_ref().and_then(|c| c.bytes));
        Some(Hang {
            kind,
            backend,
            op,
            comm,
            seq,
            bytes,
            since_ns,
            detected_ns: now_ns,
            arrived: arrived.into_iter().map(|(s, ..)| s).collect(),
            missing: missing.into_iter().map(|(s, ..)| s).collect(),
        })
    }
}

#[cfg(test)]
mod tests;
