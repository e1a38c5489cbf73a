//! Python stacks → rule spans. Each sample (sent when a thread's stack changed) is
//! matched against the Python rules; a matched frame that appears opens its rule's span,
//! one that is gone closes it, both at the sample's time. A frame is one call: its
//! address, code object and first local slot (a new call of the same function at the
//! same address nearly always holds another object there).
use std::{
    collections::{BTreeSet, HashMap, HashSet},
    sync::Arc,
};

use lens_common::RULE_ARGS;

use super::{
    code::{CodeName, CodeReader},
    follow::{FollowPolicy, ProcessFollow},
    runtime::CodeLayout,
    sampler::SampleRate,
};
use crate::{
    events::{ProbeEvent, PyFrame},
    settings::{
        groups::SpanGroup,
        probe_rules::{DCP_GET_STATE_DICT, PythonRule},
    },
};

/// One open Python rule call on a thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OpenCall {
    rule: u32,
    frame: PyFrame,
}

struct ProcessState {
    reader: Option<CodeReader>,
    /// The main script's path: the file of the main thread's outermost frame when it is
    /// a module body (what `__main__` rules match).
    main_script: Option<Arc<str>>,
    threads: HashMap<u32, ThreadCalls>,
    /// How closely it is sampled.
    follow: ProcessFollow,
}

/// A sample whose matched calls differ from those taken: held until the next sample
/// agrees. An asynchronous sample can catch a frame chain mid-update (a frame missing,
/// or a stale one shown); a call is opened only when two samples in a row show it, and
/// closed only when two in a row do not, at the first one's time.
#[derive(Clone, Debug)]
struct Tentative {
    calls: Vec<OpenCall>,
    at_ns: u64,
    /// Where the calls this one shows first began at the earliest: after the thread's
    /// sample before when it has not slept since, else within one sampling interval of
    /// its running time before this one (at the rate its process was sampled at).
    since_ns: Option<u64>,
    launches: u64,
    epoch: u64,
    /// The file of each call's function, for the spans it opens.
    files: Vec<Option<String>>,
}

impl Tentative {
    /// No call at `at_ns` (the process's `launches` and `epoch` then): where the calls
    /// open end.
    fn none_at(at_ns: u64, launches: u64, epoch: u64) -> Tentative {
        Tentative {
            calls: Vec::new(),
            at_ns,
            since_ns: None,
            launches,
            epoch,
            files: Vec::new(),
        }
    }

    /// Its calls, each with its function's file: what `transition` takes it to.
    fn target(&self) -> Vec<(OpenCall, Option<String>)> {
        self.calls
            .iter()
            .copied()
            .zip(self.files.iter().cloned())
            .collect()
    }
}

#[derive(Default)]
struct ThreadCalls {
    open: Vec<OpenCall>,
    tentative: Option<Tentative>,
    /// The last sample's time, launches and epoch: where the calls of a thread that
    /// exits without another sample end.
    last: (u64, u64, u64),
    /// The last sample's frames and their names, outermost first.
    named: Vec<(PyFrame, Option<CodeName>)>,
}

/// A tentative sample no later one contradicted after this long is taken (the stack has
/// not changed since: the sampler sends only changes).
const CONFIRM_AFTER_NS: u64 = 50_000_000;

/// Turns samples into `RuleCall` events for the builder.
pub struct PythonTracker {
    rules: Vec<PythonRule>,
    /// Which processes are sampled closely, from the rules.
    follow: FollowPolicy,
    /// Processes whose sampling rate changed, not yet taken.
    rate_changes: Vec<(u32, SampleRate)>,
    processes: HashMap<u32, ProcessState>,
    /// Rules some traced thread called, and how many CPython processes were sampled.
    matched: BTreeSet<u32>,
    sampled_processes: u64,
    /// Processes whose interpreter could not be read (warned about once).
    refused: HashSet<u32>,
}

/// `module` is where `filename` is: `a.b.c` for `…/a/b/c.py` or `…/a/b/c/__init__.py`.
fn module_matches(module: &str, filename: &str, main_script: Option<&str>) -> bool {
    if module == "__main__" {
        return main_script == Some(filename);
    }
    let path = module.replace('.', "/");
    [format!("{path}.py"), format!("{path}/__init__.py")]
        .iter()
        .any(|tail| filename == tail || filename.ends_with(&format!("/{tail}")))
}

/// The names of a sample's frames, outermost first. The outer frames this sample shares
/// with the thread's last one (`last`) are the same calls, still running (an outer frame
/// cannot end before the frames it called): their names are kept, not read again.
/// Reading names costs a few system calls per frame, and on a loaded node a loader that
/// reads every frame of every sample falls behind its targets (DCP saves went unseen so).
fn name_frames(
    reader: &mut CodeReader,
    frames: &[PyFrame],
    last: &[(PyFrame, Option<CodeName>)],
) -> Vec<(PyFrame, Option<CodeName>)> {
    let mut kept = 0;
    frames
        .iter()
        .rev()
        .map(|frame| {
            if let Some((_, Some(name))) = last.get(kept).filter(|(f, _)| f == frame) {
                kept += 1;
                return (*frame, Some(name.clone()));
            }
            kept = usize::MAX;
            (*frame, reader.name(frame.code).cloned())
        })
        .collect()
}

/// The rule calls named frames show, and the file of each one's function.
fn matching_calls(
    rules: &[PythonRule],
    names: &[(PyFrame, Option<CodeName>)],
    main_script: Option<&str>,
) -> (Vec<OpenCall>, Vec<Option<String>>) {
    let calls: Vec<OpenCall> = names
        .iter()
        .filter_map(|(frame, name)| {
            let name = name.as_ref()?;
            let rule = rules.iter().find(|rule| {
                *rule.qualname == *name.qualname
                    && module_matches(&rule.module, &name.filename, main_script)
            })?;
            Some(OpenCall {
                rule: rule.index,
                frame: *frame,
            })
        })
        .collect();
    let files: Vec<Option<String>> = calls
        .iter()
        .map(|call| {
            names
                .iter()
                .find(|(frame, _)| *frame == call.frame)
                .and_then(|(_, name)| name.as_ref().map(|n| n.filename.to_string()))
        })
        .collect();
    (calls, files)
}

impl ThreadCalls {
    /// A sample taken where the thread stopped in a probed C call the interpreter made:
    /// its frame chain is whole, so what it shows holds now, without a second sample (a
    /// framework save that then waits, unsampled, for the GIL or a peer is seen where it
    /// began). What it confirms of a tentative sample before it held from that one.
    fn take_synchronous(&mut self, tgid: u32, tid: u32, sample: Tentative) -> Vec<ProbeEvent> {
        let mut calls = self.take_agreed(tgid, tid, &sample);
        calls.extend(transition(
            tgid,
            tid,
            &mut self.open,
            sample.target(),
            &sample,
        ));
        calls
    }

    /// An asynchronous sample: what it and the tentative one before it agree on is taken,
    /// and it is held as the next tentative one where it differs from the open calls.
    fn take_confirmed(&mut self, tgid: u32, tid: u32, sample: Tentative) -> Vec<ProbeEvent> {
        let calls = self.take_agreed(tgid, tid, &sample);
        if sample.calls != self.open {
            self.tentative = Some(sample);
        }
        calls
    }

    /// What the tentative sample, taken out, and the `later` one agree on, as of the
    /// tentative one's time: open calls either still shows stay; calls both show are
    /// opened.
    fn take_agreed(&mut self, tgid: u32, tid: u32, later: &Tentative) -> Vec<ProbeEvent> {
        let Some(tentative) = self.tentative.take() else {
            return Vec::new();
        };
        let target: Vec<(OpenCall, Option<String>)> = self
            .open
            .iter()
            .filter(|call| tentative.calls.contains(call) || later.calls.contains(call))
            .map(|call| (*call, None))
            .chain(
                tentative
                    .calls
                    .iter()
                    .zip(&tentative.files)
                    .filter(|(call, _)| later.calls.contains(call) && !self.open.contains(call))
                    .map(|(call, file)| (*call, file.clone())),
            )
            .collect();
        transition(tgid, tid, &mut self.open, target, &tentative)
    }
}

impl PythonTracker {
    pub fn new(rules: Vec<PythonRule>) -> PythonTracker {
        PythonTracker {
            follow: FollowPolicy::new(&rules),
            rate_changes: Vec::new(),
            rules,
            processes: HashMap::new(),
            matched: BTreeSet::new(),
            sampled_processes: 0,
            refused: HashSet::new(),
        }
    }

    /// What a built-in framework rule's call may be part of: (a save, a load); `None`
    /// for any other rule. DCP's `get_state_dict` begins either.
    pub fn framework_role(&self, index: u32) -> Option<(bool, bool)> {
        let rule = self
            .rules
            .iter()
            .find(|rule| rule.index == index && rule.framework)?;
        Some(
            if (rule.module.as_str(), rule.qualname.as_str()) == DCP_GET_STATE_DICT {
                (true, true)
            } else {
                let load = rule.group == SpanGroup::LoadCheckpoint;
                (!load, load)
            },
        )
    }

    /// Whether a rule of the user's (or a profile's) is among them: then a process that
    /// runs CPython is traced for it alone.
    pub fn has_configured(&self) -> bool {
        self.rules.iter().any(|rule| !rule.framework)
    }

    /// `pid`'s interpreter cannot be read: true the first time (warn then).
    pub fn refused(&mut self, pid: u32) -> bool {
        self.refused.insert(pid)
    }

    /// Rules no sampled thread called, one warning line each.
    pub fn unmatched(&self) -> Vec<String> {
        let why = match self.sampled_processes {
            0 => "no traced process runs a CPython lens-probe can read (3.10 to 3.13)".to_string(),
            n => format!("no sampled call in {n} traced CPython process(es)"),
        };
        self.rules
            .iter()
            .filter(|rule| !rule.framework && !self.matched.contains(&rule.index))
            .map(|rule| {
                format!(
                    "{}: python = \"{}:{}\": {why}",
                    rule.origin, rule.module, rule.qualname
                )
            })
            .collect()
    }

    /// `pid` runs a CPython with this code layout: its samples can be read.
    pub fn add_process(&mut self, pid: u32, layout: CodeLayout) {
        let reader = match CodeReader::open(pid, layout) {
            Ok(reader) => Some(reader),
            Err(error) => {
                log::warn!("pid {pid}: cannot read its Python code objects: {error}");
                None
            }
        };
        self.sampled_processes += 1;
        self.processes.insert(
            pid,
            ProcessState {
                reader,
                main_script: None,
                threads: HashMap::new(),
                follow: ProcessFollow::new(&self.follow),
            },
        );
    }

    /// (qualified name, file) of code object `code` in `pid`, if it can be read.
    pub fn name_code(&mut self, pid: u32, code: u64) -> Option<(String, String)> {
        let reader = self.processes.get_mut(&pid)?.reader.as_mut()?;
        let name = reader.name(code)?;
        Some((name.qualname.to_string(), name.filename.to_string()))
    }

    /// The code objects of `pid` named (or found unreadable) since the last call, each
    /// with whether it may be a rule's function (its qualified name is a rule's, whatever its module: the main
    /// script may not be known yet). Samples of named code that is no rule's need not
    /// reach the tracker at once (`PY_NAMED`).
    pub fn take_named(&mut self, pid: u32) -> Vec<(u64, bool)> {
        let Some(reader) = self
            .processes
            .get_mut(&pid)
            .and_then(|process| process.reader.as_mut())
        else {
            return Vec::new();
        };
        reader
            .take_named()
            .into_iter()
            .map(|(code, name)| {
                let ruled = name.is_some_and(|name| {
                    self.rules
                        .iter()
                        .any(|rule| *rule.qualname == *name.qualname)
                });
                (code, ruled)
            })
            .collect()
    }

    /// How closely `pid`'s threads are to be sampled now.
    pub fn rate(&self, pid: u32) -> SampleRate {
        self.processes
            .get(&pid)
            .map_or(self.follow.initial(), |process| process.follow.rate())
    }

    /// `pid` maps a library of `kind`: followed for good if that says a framework whose
    /// calls need it is loaded (`follow`).
    pub fn library_mapped(&mut self, pid: u32, kind: crate::sys::library::LibraryKind) {
        if !self.follow.follows_library(kind) {
            return;
        }
        if let Some(process) = self.processes.get_mut(&pid)
            && let Some(rate) = process.follow.pin(&self.follow)
        {
            self.rate_changes.push((pid, rate));
        }
    }

    /// Processes whose time to be followed after their last framework frame has run out
    /// by `now_ns` are to be watched (taken with the other changes).
    pub fn expire_follows(&mut self, now_ns: u64) {
        for (pid, process) in &mut self.processes {
            if let Some(rate) = process.follow.rate_at(&self.follow, now_ns) {
                self.rate_changes.push((*pid, rate));
            }
        }
    }

    /// Processes whose threads are to be sampled at another rate from now on.
    pub fn take_rate_changes(&mut self) -> Vec<(u32, SampleRate)> {
        std::mem::take(&mut self.rate_changes)
    }

    pub fn knows(&self, pid: u32) -> bool {
        self.processes.contains_key(&pid)
    }

    /// `pid` ended: its open calls end with its job (the builder truncates them).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    /// The rule calls a sample opens and closes: returns first (innermost first), then
    /// entries (outermost first), all at the sample's time.
    pub fn on_sample(&mut self, sample: &ProbeEvent) -> Vec<ProbeEvent> {
        let ProbeEvent::PyStack {
            tgid,
            tid,
            synchronous,
            at_ns,
            since_ns,
            launches,
            epoch,
            frames,
        } = sample
        else {
            return Vec::new();
        };
        let Some(process) = self.processes.get_mut(tgid) else {
            return Vec::new();
        };
        let Some(reader) = process.reader.as_mut() else {
            return Vec::new();
        };
        let last = process
            .threads
            .get_mut(tid)
            .map(|thread| std::mem::take(&mut thread.named))
            .unwrap_or_default();
        let names = name_frames(reader, frames, &last);
        // The main thread's outermost frame is the script's body once it runs (during
        // start-up it is `site`'s or an import's: followed, not kept). Outermost of the
        // named frames: 3.12+ put an interpreter shim frame, which has no name, below it.
        if tid == tgid
            && let Some(outermost) = names.iter().find_map(|(_, name)| name.as_ref())
            && &*outermost.qualname == "<module>"
        {
            process.main_script = Some(outermost.filename.clone());
        }
        let sampled_every = process.follow.rate().interval().as_nanos() as u64;
        let since_ns = since_ns
            .filter(|since| since < at_ns)
            .unwrap_or(at_ns.saturating_sub(sampled_every));
        let in_framework = names.iter().any(|(frame, name)| {
            name.as_ref().is_some_and(|name| {
                process
                    .follow
                    .is_framework_code(&self.follow, frame.code, &name.filename)
            })
        });
        if let Some(rate) = process
            .follow
            .on_sample(&self.follow, *tid, in_framework, *at_ns)
        {
            self.rate_changes.push((*tgid, rate));
        }
        let (calls, files) = matching_calls(&self.rules, &names, process.main_script.as_deref());
        let sample = Tentative {
            calls,
            at_ns: *at_ns,
            since_ns: Some(since_ns),
            launches: *launches,
            epoch: *epoch,
            files,
        };
        log::debug!(
            "[{tgid}:{tid}] Python sample at {at_ns} (since {since_ns:?}): {:?}, rules {:?}",
            names
                .iter()
                .map(|(_, name)| name.as_ref().map_or("?", |n| &*n.qualname))
                .collect::<Vec<_>>(),
            sample.calls.iter().map(|c| c.rule).collect::<Vec<_>>()
        );
        let thread = process.threads.entry(*tid).or_default();
        thread.last = (*at_ns, *launches, *epoch);
        thread.named = names;
        let calls = if *synchronous {
            thread.take_synchronous(*tgid, *tid, sample)
        } else {
            thread.take_confirmed(*tgid, *tid, sample)
        };
        self.note_opened(&calls);
        calls
    }

    /// Thread `tid` of `tgid` made a native call (or phase mark) at `at_ns`: a tentative
    /// sample from before it that only changes framework calls is taken now. The thread
    /// ran on after it without another sample (it blocked, in a barrier, say), and a
    /// framework call's span must end before that call begins; a glitched sample costs
    /// such a span nothing (a call seen again joins it). The process's other threads'
    /// earlier such samples are taken first, in time order: DCP's `async_save` (its
    /// caller's sample) comes before the `save` its background thread runs.
    pub fn settle_framework_calls(&mut self, tgid: u32, tid: u32, at_ns: u64) -> Vec<ProbeEvent> {
        let Some(process) = self.processes.get(&tgid) else {
            return Vec::new();
        };
        let mut earlier: Vec<(u64, u32)> = process
            .threads
            .iter()
            .filter_map(|(other, thread)| {
                let sampled = thread.tentative.as_ref()?.at_ns;
                (*other != tid && sampled < at_ns).then_some((sampled, *other))
            })
            .collect();
        earlier.sort_unstable();
        let mut calls = Vec::new();
        for (_, other) in earlier {
            calls.extend(self.settle_thread(tgid, other, at_ns));
        }
        calls.extend(self.settle_thread(tgid, tid, at_ns));
        calls
    }

    /// Thread `tid` of `tgid` fetched a batch or began a backward pass at `at_ns`
    /// (`launches`, `epoch`: the process's at that mark): no framework save or load runs
    /// there any more (none fetches or runs a backward), so the framework calls its
    /// samples still show open, innermost, end there. Their last sample can come after
    /// the phase that follows has begun (the sampler's interval, or a wait for a CPU):
    /// a `validate(ckpt_path=…)`'s load then overlapped its evaluation.
    pub fn end_framework_calls(
        &mut self,
        tgid: u32,
        tid: u32,
        at_ns: u64,
        launches: u64,
        epoch: u64,
    ) -> Vec<ProbeEvent> {
        let rules = &self.rules;
        let Some(thread) = thread_of(&mut self.processes, tgid, tid) else {
            return Vec::new();
        };
        let framework = |call: &OpenCall| is_framework(rules, call);
        let Some(first) = thread.open.iter().position(framework) else {
            return Vec::new();
        };
        // Only when they are the innermost calls: a rule call inside one would be
        // ended with it, and opened again by the next sample.
        if !thread.open[first..].iter().all(framework) {
            return Vec::new();
        }
        let target = thread.open[..first]
            .iter()
            .map(|call| (*call, None))
            .collect();
        let at = Tentative::none_at(at_ns, launches, epoch);
        transition(tgid, tid, &mut thread.open, target, &at)
    }

    fn settle_thread(&mut self, tgid: u32, tid: u32, at_ns: u64) -> Vec<ProbeEvent> {
        let Some(thread) = thread_of(&mut self.processes, tgid, tid) else {
            return Vec::new();
        };
        let Some(tentative) = thread.tentative.as_ref().filter(|t| t.at_ns < at_ns) else {
            return Vec::new();
        };
        let framework = |call: &OpenCall| is_framework(&self.rules, call);
        let changed_only_framework = thread
            .open
            .iter()
            .filter(|call| !tentative.calls.contains(call))
            .chain(
                tentative
                    .calls
                    .iter()
                    .filter(|call| !thread.open.contains(call)),
            )
            .all(framework);
        if !changed_only_framework {
            return Vec::new();
        }
        let Some(tentative) = thread.tentative.take() else {
            return Vec::new();
        };
        let calls = transition(tgid, tid, &mut thread.open, tentative.target(), &tentative);
        self.note_opened(&calls);
        calls
    }

    /// Tentative samples no later one contradicted by `now_ns` are taken (all of
    /// `pid`'s, with `pid`: it ended).
    pub fn confirm(&mut self, now_ns: u64, pid: Option<u32>) -> Vec<ProbeEvent> {
        let mut calls = Vec::new();
        for (tgid, process) in &mut self.processes {
            if pid.is_some_and(|pid| pid != *tgid) {
                continue;
            }
            for (tid, thread) in &mut process.threads {
                // A thread that ended (a save's background writer, a worker) while in
                // calls: they ended at its last sample.
                let gone = pid.is_none()
                    && !thread.open.is_empty()
                    && !crate::sys::process::Process::new(*tgid).has_thread(*tid);
                if gone {
                    let (at_ns, launches, epoch) = thread.last;
                    let at_ns = thread
                        .tentative
                        .as_ref()
                        .map_or(at_ns, |t| t.at_ns.min(at_ns));
                    thread.tentative = Some(Tentative::none_at(at_ns, launches, epoch));
                }
                let due = gone
                    || thread.tentative.as_ref().is_some_and(|tentative| {
                        pid.is_some() || now_ns.saturating_sub(tentative.at_ns) >= CONFIRM_AFTER_NS
                    });
                if due && let Some(tentative) = thread.tentative.take() {
                    calls.extend(transition(
                        *tgid,
                        *tid,
                        &mut thread.open,
                        tentative.target(),
                        &tentative,
                    ));
                }
            }
            process
                .threads
                .retain(|_, thread| !thread.open.is_empty() || thread.tentative.is_some());
        }
        self.note_opened(&calls);
        calls
    }
}

impl PythonTracker {
    /// The rules whose calls `calls` open have been called (`unmatched` leaves them out).
    fn note_opened(&mut self, calls: &[ProbeEvent]) {
        for call in calls {
            if let ProbeEvent::RuleCall {
                rule,
                at_return: false,
                ..
            } = call
            {
                self.matched.insert(*rule);
            }
        }
    }
}

/// The rule calls kept for thread `tid` of `tgid`, if it was sampled.
fn thread_of(
    processes: &mut HashMap<u32, ProcessState>,
    tgid: u32,
    tid: u32,
) -> Option<&mut ThreadCalls> {
    processes.get_mut(&tgid)?.threads.get_mut(&tid)
}

/// `call` is of a framework save or load rule's.
fn is_framework(rules: &[PythonRule], call: &OpenCall) -> bool {
    rules
        .iter()
        .any(|rule| rule.index == call.rule && rule.framework)
}

/// From the calls `open` to `target` at `at`'s time: returns for those that ended
/// (innermost first), then entries for the new ones (outermost first, with their file).
fn transition(
    tgid: u32,
    tid: u32,
    open: &mut Vec<OpenCall>,
    target: Vec<(OpenCall, Option<String>)>,
    at: &Tentative,
) -> Vec<ProbeEvent> {
    let kept = open
        .iter()
        .zip(&target)
        .take_while(|(a, (b, _))| *a == b)
        .count();
    let event = |rule: u32, at_return: bool, text: Option<String>| ProbeEvent::RuleCall {
        tgid,
        tid,
        at_ns: at.at_ns,
        launches: at.launches,
        epoch: at.epoch,
        rule,
        at_return,
        args: [0; RULE_ARGS],
        text,
        ret: 0,
        since_ns: at.since_ns.filter(|_| !at_return),
    };
    let mut calls: Vec<ProbeEvent> = open[kept..]
        .iter()
        .rev()
        .map(|closed| event(closed.rule, true, None))
        .collect();
    calls.extend(
        target[kept..]
            .iter()
            .map(|(opened, file)| event(opened.rule, false, file.clone())),
    );
    *open = target.into_iter().map(|(call, _)| call).collect();
    calls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_are_matched_by_the_file_path() {
        let m = |module, file| module_matches(module, file, Some("/w/train.py"));
        assert!(m(
            "megatron.training.training",
            "/src/megatron/training/training.py"
        ));
        assert!(m("megatron.training", "/src/megatron/training/__init__.py"));
        assert!(!m("training", "/src/megatron/training/training_utils.py"));
        assert!(m("train_loop", "train_loop.py"));
        assert!(m("__main__", "/w/train.py"));
        assert!(!m("__main__", "/w/other.py"));
    }

    fn rule(index: u32, qualname: &str, framework: bool) -> PythonRule {
        PythonRule {
            index,
            origin: "test".into(),
            module: "m".into(),
            qualname: qualname.into(),
            group: SpanGroup::LoadCheckpoint,
            name: "train.load_checkpoint",
            framework,
        }
    }

    fn call(rule: u32, frame: u64) -> OpenCall {
        OpenCall {
            rule,
            frame: PyFrame {
                code: 0x100 + u64::from(rule),
                frame,
                first_local: 1,
            },
        }
    }

    /// A tracker with thread 7 of process 7 in `open` (outermost first).
    fn tracker_in(open: Vec<OpenCall>) -> PythonTracker {
        let mut tracker = PythonTracker::new(vec![
            rule(0, "Trainer._restore_modules_and_callbacks", true),
            rule(1, "train_step", false),
        ]);
        let thread = ThreadCalls {
            open,
            ..ThreadCalls::default()
        };
        tracker.processes.insert(
            7,
            ProcessState {
                reader: None,
                main_script: None,
                threads: HashMap::from([(7, thread)]),
                follow: ProcessFollow::new(&tracker.follow),
            },
        );
        tracker
    }

    #[test]
    fn a_batch_fetch_ends_the_framework_load_its_samples_still_show() {
        let mut tracker = tracker_in(vec![call(1, 0xa0), call(0, 0xb0)]);
        let ended = tracker.end_framework_calls(7, 7, 500, 3, 4);
        let [
            ProbeEvent::RuleCall {
                rule: 0,
                at_return: true,
                at_ns: 500,
                launches: 3,
                epoch: 4,
                ..
            },
        ] = ended.as_slice()
        else {
            panic!("the load's return at the fetch, and only that: {ended:?}");
        };
        // The user's rule call around it goes on; nothing more to end.
        assert_eq!(tracker.processes[&7].threads[&7].open, [call(1, 0xa0)]);
        assert!(tracker.end_framework_calls(7, 7, 600, 3, 4).is_empty());
    }

    fn sample(at_ns: u64, since_ns: u64, calls: Vec<OpenCall>) -> Tentative {
        Tentative {
            files: vec![None; calls.len()],
            calls,
            at_ns,
            since_ns: Some(since_ns),
            launches: 0,
            epoch: 0,
        }
    }

    #[test]
    fn a_synchronous_sample_confirms_the_call_a_sample_before_it_showed() {
        // A clock sample shows a save begun; a file opened inside it takes a synchronous
        // one before the next tick: the save began before the first, not at the second.
        let save = call(0, 0xb0);
        let mut thread = ThreadCalls::default();
        assert!(
            thread
                .take_confirmed(7, 7, sample(1_000, 10, vec![save]))
                .is_empty()
        );
        let calls = thread.take_synchronous(7, 7, sample(1_700, 1_000, vec![save]));
        let [
            ProbeEvent::RuleCall {
                rule: 0,
                at_return: false,
                at_ns: 1_000,
                since_ns: Some(10),
                ..
            },
        ] = calls.as_slice()
        else {
            panic!("the save's entry at the clock sample that first showed it: {calls:?}");
        };
        assert_eq!(thread.open, [save]);
        assert!(thread.tentative.is_none());
    }

    #[test]
    fn a_framework_call_with_a_rule_call_inside_is_left_to_the_samples() {
        let open = vec![call(0, 0xb0), call(1, 0xc0)];
        let mut tracker = tracker_in(open.clone());
        assert!(tracker.end_framework_calls(7, 7, 500, 0, 0).is_empty());
        assert_eq!(tracker.processes[&7].threads[&7].open, open);
        assert!(tracker.end_framework_calls(8, 8, 500, 0, 0).is_empty());
    }
}
