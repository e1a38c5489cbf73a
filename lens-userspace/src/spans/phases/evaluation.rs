//! Evaluation loops: grad mode switched off between steps, then batches fetched, make
//! an `evaluate` span (`docs/spans.md`, "Rules").

use crate::names;
use crate::settings::groups::SpanGroup;

use super::*;

impl ThreadPhases {
    pub(super) fn grad_mode(&mut self, at: u64, enabled: bool) {
        if enabled == self.evaluation.grad_enabled {
            return;
        }
        self.evaluation.grad_enabled = enabled;
        if enabled {
            self.evaluation.grad_on_at = at;
        }
        if self.in_optimizer_scope() {
            // The optimizer's own `no_grad`: neither evaluation nor its end.
            return;
        }
        if let Some(evaluate) = self.evaluation.evaluate.as_mut() {
            // Inside an evaluation loop grad mode may go on and off (per batch, around a
            // recompile): the loop goes on until another phase begins.
            if enabled {
                evaluate.ended_at = Some(at);
            } else {
                // The batch fetched meanwhile was the evaluation's, unless a backward
                // pass comes next.
                if let (Some(end), Some(fetch)) =
                    (evaluate.ended_at, self.training.pending_fetch.take())
                {
                    evaluate.resumed = Some((end, fetch));
                }
                evaluate.ended_at = None;
            }
            return;
        }
        if !enabled {
            // Between backward passes it is the step's own work.
            if !self.step_running() {
                self.evaluation.eval_candidate = Some(match self.evaluation.fetch_since_training {
                    Some(fetch) => EvalCandidate {
                        start: fetch,
                        fetched_first: true,
                    },
                    None => EvalCandidate {
                        start: at,
                        fetched_first: false,
                    },
                });
            }
            return;
        }
        // A `no_grad` block without a batch in it (an EMA update, logging) is not
        // evaluation, unless a batch came just before it (a per-batch `no_grad`).
        if self
            .evaluation
            .eval_candidate
            .is_some_and(|c| !c.fetched_first)
        {
            self.evaluation.eval_candidate = None;
        }
    }

    /// Evaluation: a DataLoader fetch after grad mode went off between steps. It began
    /// when grad mode was switched off, or at the batch fetched just before that.
    pub(super) fn evaluate_begins(&mut self, ctx: &mut ProcessContext<'_>, start: u64) {
        self.finish_step(ctx);
        ctx.end_model_init(start);
        let span = self.open_phase(ctx, names::EVALUATE, SpanGroup::Evaluate, ctx.job, start);
        // Confirmed by a fetch after a per-batch `no_grad` block: the loop is over at
        // that block's end unless grad mode goes off again.
        let ended_at = self
            .evaluation
            .grad_enabled
            .then_some(self.evaluation.grad_on_at.max(start));
        self.evaluation.evaluate = Some(Evaluate {
            span,
            ended_at,
            resumed: None,
        });
        self.evaluation.eval_candidate = None;
        self.training.pending_fetch = None;
    }

    /// Another phase begins at `at`: an evaluation whose grad mode is back on ends (one
    /// still under `no_grad` goes on: the new phase is inside it).
    pub(super) fn end_finished_evaluation(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        if self
            .evaluation
            .evaluate
            .as_ref()
            .is_some_and(|e| e.ended_at.is_some())
        {
            self.end_evaluation(ctx, at);
        }
    }

    /// Another phase begins at `at`: an evaluation loop still open ends, where grad mode
    /// was last switched back on (or here, if it is still off).
    pub(super) fn end_evaluation(&mut self, ctx: &mut ProcessContext<'_>, at: u64) {
        let Some(evaluate) = self.evaluation.evaluate.take() else {
            return;
        };
        let mut end = evaluate.ended_at.unwrap_or(at);
        if let Some((ended, fetch)) = evaluate.resumed {
            // What looked like another batch was the next step's forward.
            end = ended;
            self.training.pending_fetch = Some(fetch);
        }
        self.close_phase(ctx, evaluate.span, end);
        self.training.boundary = Some(end);
        // Its batches are its own: a later evaluation begins at its own (Lightning's
        // `validate(ckpt_path=...)` after `fit`, the load between them).
        self.evaluation.fetch_since_training = None;
    }
}
