//! Which processes the sampler follows at its full rate, and which it only watches
//! (`sampler::SampleRate`). A clock tick costs the thread it interrupts (docs/performance.md:
//! a 1 kHz clock alone was ~7 % of a small torch step on this VM), so a process is ticked
//! at 1 kHz only while a rule's function can be running or about to begin:
//! - with rules of the user's or a profile's (any module, `__main__` too): always;
//! - with only the built-in framework rules: while a thread's stack holds a frame of a
//!   framework package they name (a transformers or Lightning `Trainer`'s loop, Fabric's or
//!   Accelerate's `backward`, DCP's functions), and [`FOLLOW_FOR`] after the last one;
//!   otherwise it is watched every 10 ms, which finds a framework running within a few
//!   ticks. A save's first line (`_log_api_usage_once`: torch, DCP) is sampled at once, so
//!   a save in a plain loop is followed from its start;
//! - in a process that maps safetensors' extension: always, from then on. Its save and
//!   load functions run in plain loops, briefly (a few ms), and nothing samples their
//!   first line: a 10 ms tick would bound their start 10 ms early.
use std::collections::{HashMap, HashSet};

use super::sampler::SampleRate;
use crate::{settings::probe_rules::PythonRule, sys::library::LibraryKind};

/// How long a process stays followed after its stacks last showed a framework package: a
/// loop that calls into one each step (Fabric's `backward`) is not switched per step.
pub const FOLLOW_FOR_NS: u64 = 2_000_000_000;

/// What the rules say about following: which files are a framework's.
#[derive(Debug)]
pub struct FollowPolicy {
    /// Rules of the user's: every process is followed.
    always: bool,
    /// The packages the framework rules' modules are in, as path pieces (`/transformers/`,
    /// `/torch/distributed/checkpoint/`).
    packages: Vec<String>,
}

/// safetensors' package, whose extension (`LibraryKind::Safetensors`) says it is loaded.
const SAFETENSORS: &str = "/safetensors/";

impl FollowPolicy {
    pub fn new(rules: &[PythonRule]) -> FollowPolicy {
        let mut packages: Vec<String> = Vec::new();
        let mut always = false;
        for rule in rules {
            match rule.module.rsplit_once('.') {
                Some((package, _)) if rule.framework => {
                    let piece = format!("/{}/", package.replace('.', "/"));
                    if !packages.contains(&piece) {
                        packages.push(piece);
                    }
                }
                _ => always = true,
            }
        }
        FollowPolicy { always, packages }
    }

    /// The rate a process starts at.
    pub fn initial(&self) -> SampleRate {
        if self.always {
            SampleRate::Follow
        } else {
            SampleRate::Watch
        }
    }

    /// Whether a process that maps a library of `kind` is followed for good: one of a
    /// framework whose rules' calls nothing samples at their first line.
    pub fn follows_library(&self, kind: LibraryKind) -> bool {
        kind == LibraryKind::Safetensors && self.packages.iter().any(|p| p == SAFETENSORS)
    }

    /// Whether a function of file `filename` is a framework's whose rules may run.
    pub fn in_framework(&self, filename: &str) -> bool {
        self.packages
            .iter()
            .any(|piece| filename.contains(piece.as_str()))
    }
}

/// One process's following: which of its threads are in a framework, since when not.
#[derive(Debug)]
pub struct ProcessFollow {
    rate: SampleRate,
    /// Followed for good (`FollowPolicy::follows_library`).
    pinned: bool,
    /// Threads whose last sample showed a framework's frame.
    threads_in: HashSet<u32>,
    /// When a sample last showed one.
    last_in_ns: u64,
    /// Whether each code object (by address) is a framework's function.
    code_in: HashMap<u64, bool>,
}

impl ProcessFollow {
    pub fn new(policy: &FollowPolicy) -> ProcessFollow {
        ProcessFollow {
            rate: policy.initial(),
            pinned: false,
            threads_in: HashSet::new(),
            last_in_ns: 0,
            code_in: HashMap::new(),
        }
    }

    pub fn rate(&self) -> SampleRate {
        self.rate
    }

    /// Whether code object `code`, of file `filename`, is a framework's (asked once).
    pub fn is_framework_code(&mut self, policy: &FollowPolicy, code: u64, filename: &str) -> bool {
        *self
            .code_in
            .entry(code)
            .or_insert_with(|| policy.in_framework(filename))
    }

    /// Thread `tid`'s sample at `at_ns` showed a framework's frame (`in_framework`) or
    /// not. Returns the new rate if it changes.
    pub fn on_sample(
        &mut self,
        policy: &FollowPolicy,
        tid: u32,
        in_framework: bool,
        at_ns: u64,
    ) -> Option<SampleRate> {
        if in_framework {
            self.threads_in.insert(tid);
            self.last_in_ns = self.last_in_ns.max(at_ns);
        } else if self.threads_in.remove(&tid) {
            self.last_in_ns = self.last_in_ns.max(at_ns);
        }
        self.rate_at(policy, at_ns)
    }

    /// Followed from now on, whatever its stacks show. Returns the new rate if it changes.
    pub fn pin(&mut self, policy: &FollowPolicy) -> Option<SampleRate> {
        self.pinned = true;
        self.rate_at(policy, 0)
    }

    /// The rate at `now_ns`; the new one if it changes.
    pub fn rate_at(&mut self, policy: &FollowPolicy, now_ns: u64) -> Option<SampleRate> {
        let follow = policy.always
            || self.pinned
            || !self.threads_in.is_empty()
            || (self.last_in_ns != 0 && now_ns.saturating_sub(self.last_in_ns) < FOLLOW_FOR_NS);
        let rate = if follow {
            SampleRate::Follow
        } else {
            SampleRate::Watch
        };
        (rate != self.rate).then(|| {
            self.rate = rate;
            rate
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::groups::SpanGroup;

    fn rule(module: &str, framework: bool) -> PythonRule {
        PythonRule {
            index: 0,
            origin: "test".into(),
            module: module.into(),
            qualname: "f".into(),
            group: SpanGroup::Checkpoint,
            name: "train.checkpoint",
            framework,
        }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn a_framework_frame_is_followed_until_a_while_after_it_is_gone() {
        let policy = FollowPolicy::new(&[
            rule("transformers.trainer", true),
            rule("torch.distributed.checkpoint.state_dict_saver", true),
        ]);
        let mut process = ProcessFollow::new(&policy);
        assert_eq!(process.rate(), SampleRate::Watch);
        let dcp = "/v/lib/python3.11/site-packages/torch/distributed/checkpoint/state_dict.py";
        assert!(policy.in_framework(dcp));
        assert!(!policy.in_framework("/v/site-packages/torch/nn/modules/module.py"));
        assert!(policy.in_framework("/v/site-packages/transformers/trainer.py"));
        assert!(!policy.in_framework("/w/my_transformers/train.py"));

        assert_eq!(process.on_sample(&policy, 7, false, 10 * MS), None);
        assert_eq!(
            process.on_sample(&policy, 7, true, 20 * MS),
            Some(SampleRate::Follow)
        );
        // Another thread leaving nothing changes; the first leaving starts the wait.
        assert_eq!(process.on_sample(&policy, 8, false, 30 * MS), None);
        assert_eq!(process.on_sample(&policy, 7, false, 40 * MS), None);
        assert_eq!(process.rate_at(&policy, 40 * MS + FOLLOW_FOR_NS - 1), None);
        assert_eq!(
            process.rate_at(&policy, 40 * MS + FOLLOW_FOR_NS),
            Some(SampleRate::Watch)
        );
        assert_eq!(process.rate_at(&policy, 100 * FOLLOW_FOR_NS), None);
    }

    #[test]
    fn a_thread_in_a_framework_keeps_its_process_followed() {
        let policy = FollowPolicy::new(&[rule("lightning.fabric.fabric", true)]);
        let mut process = ProcessFollow::new(&policy);
        process.on_sample(&policy, 7, true, MS);
        assert_eq!(process.rate_at(&policy, 100 * FOLLOW_FOR_NS), None);
        assert_eq!(process.rate(), SampleRate::Follow);
    }

    #[test]
    fn a_process_that_maps_safetensors_is_followed_for_good() {
        let policy = FollowPolicy::new(&[rule("safetensors.torch", true)]);
        assert!(policy.follows_library(LibraryKind::Safetensors));
        assert!(!policy.follows_library(LibraryKind::TorchCpu));
        let mut process = ProcessFollow::new(&policy);
        assert_eq!(process.pin(&policy), Some(SampleRate::Follow));
        assert_eq!(process.on_sample(&policy, 7, false, MS), None);
        assert_eq!(process.rate_at(&policy, 100 * FOLLOW_FOR_NS), None);
        // Without safetensors' rules, its library says nothing.
        let policy = FollowPolicy::new(&[rule("transformers.trainer", true)]);
        assert!(!policy.follows_library(LibraryKind::Safetensors));
    }

    #[test]
    fn a_rule_of_the_users_follows_every_process() {
        let policy = FollowPolicy::new(&[
            rule("transformers.trainer", true),
            rule("train_loop", false),
        ]);
        let mut process = ProcessFollow::new(&policy);
        assert_eq!(process.rate(), SampleRate::Follow);
        assert_eq!(process.on_sample(&policy, 7, false, MS), None);
        assert_eq!(process.rate_at(&policy, 100 * FOLLOW_FOR_NS), None);
    }
}
