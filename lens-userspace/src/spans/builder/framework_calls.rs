//! Configured rules and framework save/load calls: the spans they open and close on
//! their thread, DCP's `async_save` carried over to the thread that writes it.

use crate::spans::{
    AttrValue, Attributes, SpanExporter, SpanId,
    pending::GatedOutput,
    phases::{ProcessContext, ThreadPhases},
};
use crate::{
    events::ProbeEvent,
    semconv,
    settings::{
        groups::SpanGroup,
        probe_rules::{ArgType, DCP_ASYNC_SAVE, DCP_GET_STATE_DICT, NativeRule},
    },
};

use super::*;

/// An `async_save` whose writer was never seen (its `save` too short to be sampled, or
/// it failed to start): the span is what the call itself did.
pub(super) fn close_unwritten_async_save(ctx: &mut ProcessContext<'_>, save: AsyncSave) {
    if save.writer.is_some() {
        return;
    }
    let (files, created) = save.caller_files.unwrap_or_default();
    let count = if created > 0 { created } else { files };
    ctx.arena
        .set_attr(save.span, semconv::NEMO_CHECKPOINT_FILES, count);
    ctx.arena.close(save.span, save.caller_end, false, ctx.out);
}

/// What a framework's save (load) function is to the span it bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FrameworkCall {
    /// The save (load) itself: the span lasts while it runs.
    Save,
    /// DCP's `async_save`: the span lasts until the background `save` it starts returns.
    AsyncSave,
    /// DCP's `get_state_dict`: the save or load that follows at once starts with it.
    Prelude,
}

/// A checkpoint begun by DCP's `async_save` on one thread and written by the `save` it
/// starts on another: one span, ended when the later of the two calls returns.
#[derive(Clone, Copy, Debug)]
pub(super) struct AsyncSave {
    pub(super) span: SpanId,
    pub(super) caller: u32,
    /// `async_save` has returned, with what it counted (`FileSpan::counts`) and where
    /// it ended.
    pub(super) caller_files: Option<(u32, u32)>,
    pub(super) caller_end: u64,
    /// The background thread carrying the span on, once its `save` began.
    pub(super) writer: Option<u32>,
    /// The background `save` returned (at, its counts) before `async_save` did.
    pub(super) written: Option<(u64, (u32, u32))>,
}

impl<E: SpanExporter> SpanBuilder<E> {
    /// Entry or return of a function a configured rule names: a span of the rule's
    /// group opens or ends on that thread (`ThreadPhases::rule_enter`). A rule of group
    /// step, evaluate, checkpoint or load_checkpoint takes that group over in the process
    /// from its first call: torch's signals for it are ignored from then on, and a step
    /// rule's spans count `dl.iteration`.
    pub(super) fn on_rule_call(&mut self, event: &ProbeEvent) {
        let ProbeEvent::RuleCall {
            tgid,
            tid,
            at_ns,
            launches,
            epoch,
            rule,
            at_return,
            args,
            text,
            ..
        } = event
        else {
            return;
        };
        // What the rule makes of the call: native rules read arguments; a Python
        // rule's call carries its function's file.
        let (index, group, name, attributes) = if let Some(rule) = self.rules.native_rule(*rule) {
            let attributes = (!at_return).then(|| rule_attributes(rule, args, text.as_deref()));
            (rule.index, rule.group, rule.name, attributes)
        } else if let Some(rule) = self.rules.python_rule(*rule)
            && rule.framework
        {
            let name = (rule.module.as_str(), rule.qualname.as_str());
            let function = format!("{}:{}", rule.module, rule.qualname);
            let kind = if name == DCP_ASYNC_SAVE {
                FrameworkCall::AsyncSave
            } else if name == DCP_GET_STATE_DICT {
                FrameworkCall::Prelude
            } else {
                FrameworkCall::Save
            };
            self.on_framework_call(event, rule.group, function, kind);
            return;
        } else if let Some(rule) = self.rules.python_rule(*rule) {
            let attributes = (!at_return).then(|| {
                let mut attributes: Attributes =
                    vec![(semconv::CODE_FUNCTION, rule.qualname.clone().into())];
                if let Some(file) = text {
                    attributes.push((semconv::CODE_FILEPATH, file.clone().into()));
                }
                attributes
            });
            (rule.index, rule.group, rule.name, attributes)
        } else {
            return;
        };
        let Some(process) = self.processes.get_mut(tgid) else {
            return;
        };
        let (at, tid) = (*at_ns, *tid);
        process
            .arena
            .launches_mut()
            .record_mark(at, *launches, *epoch);
        let taken_over = matches!(
            group,
            SpanGroup::Step
                | SpanGroup::Evaluate
                | SpanGroup::Checkpoint
                | SpanGroup::LoadCheckpoint
        );
        if !at_return && taken_over {
            process.ruled.groups.insert(group);
        }
        let iteration = (!at_return && group == SpanGroup::Step).then(|| {
            process.ruled.next_iteration += 1;
            process.ruled.next_iteration - 1
        });
        let idle = process.on_thread(
            tid,
            &mut self.ids,
            &mut self.pending,
            &mut self.exporter,
            |thread, ctx| match attributes {
                None => thread.rule_return(ctx, at, index),
                Some(attributes) => {
                    thread.rule_enter(ctx, at, index, name, group, attributes, iteration)
                }
            },
        );
        export_if_training(process, &mut self.pending, &mut self.exporter, &self.groups);
        self.place_when_known(*tgid, tid);
        if idle && let Some(process) = self.processes.get_mut(tgid) {
            process.threads.remove(&tid);
        }
    }

    /// Entry or return of a framework's save (load) function (sampled): it bounds the
    /// checkpoint (load) span of its thread (`ThreadPhases::save_call_enter`). DCP's
    /// `async_save` hands its span to the `save` it starts on a background thread.
    pub(super) fn on_framework_call(
        &mut self,
        event: &ProbeEvent,
        group: SpanGroup,
        function: String,
        kind: FrameworkCall,
    ) {
        let ProbeEvent::RuleCall {
            tgid,
            tid,
            at_ns,
            launches,
            epoch,
            at_return,
            since_ns,
            ..
        } = event
        else {
            return;
        };
        let Some(process) = self.processes.get_mut(tgid) else {
            return;
        };
        let (at, tid, at_return) = (*at_ns, *tid, *at_return);
        process
            .arena
            .launches_mut()
            .record_mark(at, *launches, *epoch);
        let traced_from_start = process.traced_from_start;
        let job = process.job;
        let mut output = GatedOutput {
            pending: &mut self.pending,
            out: &mut self.exporter,
        };
        let mut ctx = ProcessContext {
            arena: &mut process.arena,
            ids: &mut self.ids,
            out: &mut output,
            job,
            model_init: &mut process.model_init,
            ruled: &process.ruled.groups,
        };
        let thread = process
            .threads
            .entry(tid)
            .or_insert_with(|| ThreadPhases::new(tid, traced_from_start));
        let effects = on_framework_thread(
            thread,
            &mut ctx,
            &mut process.async_save,
            FrameworkCallAt {
                tid,
                at,
                since: *since_ns,
                at_return,
                group,
                kind,
                function,
            },
        );
        if process.loop_thread.is_none() && thread.is_active() {
            process.loop_thread = Some(tid);
        }
        process.apply_to_caller(group, effects);
        export_if_training(process, &mut self.pending, &mut self.exporter, &self.groups);
        self.place_when_known(*tgid, tid);
    }
}

/// A framework call's entry or return, as its thread's phases see it.
struct FrameworkCallAt {
    tid: u32,
    at: u64,
    /// The thread's sample before the one that showed the call (entry only): it began
    /// after that, when known.
    since: Option<u64>,
    at_return: bool,
    group: SpanGroup,
    kind: FrameworkCall,
    function: String,
}

/// What a call on a DCP `async_save`'s writer thread changes on its caller's thread.
#[derive(Default)]
struct CallerEffects {
    /// The writer took the span over: (caller, span).
    handed_off: Option<(u32, SpanId)>,
    /// The writer ended the span: (caller, span, end).
    closed_for_caller: Option<(u32, SpanId, u64)>,
    /// The writer returned first: (caller, span, its file counts).
    written_to_caller: Option<(u32, SpanId, (u32, u32))>,
}

/// The framework call `call` on its own thread; `async_save` is the process's DCP
/// `async_save` in progress, carried between its caller and its writer.
fn on_framework_thread(
    thread: &mut ThreadPhases,
    ctx: &mut ProcessContext<'_>,
    async_save: &mut Option<AsyncSave>,
    call: FrameworkCallAt,
) -> CallerEffects {
    let FrameworkCallAt {
        tid,
        at,
        since,
        at_return,
        group,
        kind,
        function,
    } = call;
    let is_async = kind == FrameworkCall::AsyncSave;
    let mut effects = CallerEffects::default();
    match (at_return, *async_save) {
        (false, _) if kind == FrameworkCall::Prelude => thread.save_prelude(at, since),
        (true, _) if kind == FrameworkCall::Prelude => {}
        // The background writer of an `async_save` begins: it carries the span on.
        (false, Some(save))
            if group == SpanGroup::Checkpoint && save.writer.is_none() && save.caller != tid =>
        {
            thread.adopt_file_span(save.span, group);
            *async_save = Some(AsyncSave {
                writer: Some(tid),
                ..save
            });
            effects.handed_off = Some((save.caller, save.span));
        }
        // The writer's `save` seen again after a sample showed it gone (the frame
        // caught mid-update as it returns): still the same writing, files and all.
        (false, Some(save)) if group == SpanGroup::Checkpoint && save.writer == Some(tid) => {
            thread.adopt_file_span(save.span, group);
            if let Some((_, files)) = save.written {
                thread.add_files(group, files);
            }
            *async_save = Some(AsyncSave {
                written: None,
                ..save
            });
            effects.handed_off = Some((save.caller, save.span));
        }
        (false, _) => {
            let attributes = vec![(semconv::CODE_FUNCTION, function.into())];
            thread.save_call_enter(ctx, (at, since), group, attributes);
            if is_async && let Some(span) = thread.file_span(group) {
                // One still waiting for a writer never got one: it was what it did.
                if let Some(orphan) = async_save.take() {
                    close_unwritten_async_save(ctx, orphan);
                }
                *async_save = Some(AsyncSave {
                    span,
                    caller: tid,
                    caller_files: None,
                    caller_end: at,
                    writer: None,
                    written: None,
                });
            }
        }
        (true, Some(save)) if save.writer == Some(tid) => {
            match save.caller_files {
                // `async_save` returned first: the span ends with the writer (the
                // caller's return is seen late when it waited for it, blocked).
                Some(files) => {
                    if let Some(end) = thread.end_adopted(ctx, at, group, files) {
                        effects.closed_for_caller = Some((save.caller, save.span, end));
                    }
                    *async_save = None;
                }
                None => {
                    let files = thread.take_file_span(group).map_or((0, 0), |f| f.counts());
                    *async_save = Some(AsyncSave {
                        written: Some((at, files)),
                        ..save
                    });
                    // Credited to the caller's span at once: the caller's next phase
                    // may end it before a sample shows `async_save` returned (its
                    // thread sat blocked in `future.result()`).
                    effects.written_to_caller = Some((save.caller, save.span, files));
                }
            }
        }
        (true, Some(save)) if save.caller == tid && is_async => {
            thread.save_call_return(at, group);
            match (save.writer, save.written) {
                // The writer finished first: the span is the caller's again.
                (_, Some((end, files))) => {
                    thread.save_call_return(end, group);
                    thread.add_files(group, files);
                    *async_save = None;
                }
                // The writer goes on (or has not been sampled yet): it ends the span.
                (_, None) => {
                    let files = thread.take_file_span(group).map_or((0, 0), |f| f.counts());
                    *async_save = Some(AsyncSave {
                        caller_files: Some(files),
                        caller_end: at,
                        ..save
                    });
                }
            }
        }
        (true, _) => thread.save_call_return(at, group),
    }
    effects
}

impl ProcessSpans {
    /// Applies what the writer thread of an `async_save` changed to its caller's thread.
    fn apply_to_caller(&mut self, group: SpanGroup, effects: CallerEffects) {
        if let Some((caller, span)) = effects.handed_off
            && let Some(caller) = self.threads.get_mut(&caller)
        {
            caller.hand_off(span, group);
        }
        if let Some((caller, span, end)) = effects.closed_for_caller
            && let Some(caller) = self.threads.get_mut(&caller)
        {
            caller.closed_elsewhere(span, end);
        }
        if let Some((caller, span, files)) = effects.written_to_caller
            && self
                .threads
                .get_mut(&caller)
                .is_some_and(|caller| caller.add_files_to(span, group, files))
            && let Some(save) = self.async_save.as_mut()
        {
            save.written = save.written.map(|(end, _)| (end, (0, 0)));
        }
    }
}

/// The attributes a rule's arguments give, as its `args` say to read them. A string
/// argument that was NULL or unreadable is left out.
pub(super) fn rule_attributes(rule: &NativeRule, args: &[u64], text: Option<&str>) -> Attributes {
    let mut attributes = Attributes::new();
    for arg in &rule.args {
        let raw = args.get(arg.index as usize).copied().unwrap_or(0);
        let value = match arg.kind {
            ArgType::Int => AttrValue::Int((raw as u32 as i32).into()),
            ArgType::Uint => AttrValue::Int((raw as u32).into()),
            ArgType::Long => AttrValue::Int(raw as i64),
            ArgType::Ulong => raw.into(),
            ArgType::Bool => AttrValue::Bool(raw & 0xff != 0),
            ArgType::Ptr => AttrValue::Str(format!("{raw:#x}")),
            ArgType::Str | ArgType::StdString => match text {
                Some(text) => text.into(),
                None => continue,
            },
        };
        attributes.push((arg.attribute, value));
    }
    attributes
}
