//! Spans of configured probe rules: opened and closed on their thread, taking their
//! group over from torch's signals (`docs/spans.md`, "Configured probes").

use crate::spans::Attributes;
use crate::{semconv, settings::groups::SpanGroup};

use super::*;

impl ThreadPhases {
    /// A function a configured rule names was entered: its span opens, under the
    /// innermost open span of the thread, like a call. Rules of the top-level groups
    /// (step, evaluate, checkpoint, load_checkpoint) *are* the phase when nothing else is
    /// open: a complete torch step ends first, `model_init` ends, and the span hangs on
    /// the job. `iteration`: the step's `dl.iteration`, for step rules.
    #[allow(clippy::too_many_arguments)]
    pub fn rule_enter(
        &mut self,
        ctx: &mut ProcessContext<'_>,
        at: u64,
        rule: u32,
        name: &'static str,
        group: SpanGroup,
        attributes: Attributes,
        iteration: Option<u64>,
    ) {
        let top_level = matches!(
            group,
            SpanGroup::Step
                | SpanGroup::Evaluate
                | SpanGroup::Checkpoint
                | SpanGroup::LoadCheckpoint
        );
        if group == SpanGroup::Step {
            // Steps come from the rule now: a torch step still open here never completes.
            self.finish_step(ctx);
            if let Some(step) = self.training.step.take() {
                for id in [step.forward_backward, step.optimizer]
                    .into_iter()
                    .flatten()
                {
                    ctx.truncate(id, at);
                }
                ctx.truncate(step.span, at);
            }
        } else if top_level && self.rule_spans.is_empty() {
            self.finish_step(ctx);
        }
        if top_level && self.rule_spans.is_empty() {
            self.end_finished_evaluation(ctx, at);
        }
        let mut parent = self.innermost(ctx);
        if top_level && Some(parent) == *ctx.model_init {
            ctx.end_model_init(at);
            parent = ctx.job;
        }
        let span = self.open_phase(ctx, name, group, parent, at);
        for (key, value) in attributes {
            ctx.arena.set_attr(span, key, value);
        }
        if let Some(iteration) = iteration {
            ctx.arena.set_attr(span, semconv::DL_ITERATION, iteration);
        }
        self.rule_spans.push((rule, span));
    }

    /// The function of `rule` returned: its innermost open span ends. Spans opened inside
    /// it and still open (their return was never seen: a longjmp, an exception through
    /// C) end with it, truncated. A return without its entry (attached mid-call) is
    /// ignored.
    pub fn rule_return(&mut self, ctx: &mut ProcessContext<'_>, at: u64, rule: u32) {
        let Some(position) = self.rule_spans.iter().rposition(|(r, _)| *r == rule) else {
            return;
        };
        while self.rule_spans.len() > position + 1 {
            if let Some((_, span)) = self.rule_spans.pop() {
                self.truncate_phase(ctx, span, at);
            }
        }
        if let Some((_, span)) = self.rule_spans.pop() {
            self.close_phase(ctx, span, at);
        }
    }
}
