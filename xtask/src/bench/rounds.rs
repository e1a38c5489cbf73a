//! The bench's one measuring loop, and what is taken from its runs. Every variant runs
//! once a round, interleaved (A B C A B C …), so that the drift of a noisy VM hits every
//! variant alike; the figures are then medians over the rounds, and ratios of medians or
//! per-round differences to a base variant run in the same round.

use xtask::error::Result;

use super::report::median;
use super::{Watch, say};

/// Each variant's runs, in round order.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Rounds<V, R> {
    runs: Vec<(V, Vec<R>)>,
}

impl<V, R> Default for Rounds<V, R> {
    fn default() -> Self {
        Rounds { runs: Vec::new() }
    }
}

impl<V, R> From<Vec<(V, Vec<R>)>> for Rounds<V, R> {
    fn from(runs: Vec<(V, Vec<R>)>) -> Self {
        Rounds { runs }
    }
}

impl<V: Copy + PartialEq, R> Rounds<V, R> {
    /// `run(variant, round)` for every variant, in the order given, in each of `rounds`
    /// rounds. Other tracers are looked for before each run, since they would share the
    /// CPUs and the probed files with it; after each, `round N/M: {said(variant, run)}`.
    pub(super) fn measure(
        rounds: u32,
        variants: impl IntoIterator<Item = V>,
        watch: &mut Watch,
        mut run: impl FnMut(V, u32) -> Result<R>,
        mut said: impl FnMut(V, &R) -> String,
    ) -> Result<Rounds<V, R>> {
        let mut runs: Vec<(V, Vec<R>)> = variants.into_iter().map(|v| (v, Vec::new())).collect();
        for round in 1..=rounds {
            for (variant, done) in &mut runs {
                watch.check();
                let result = run(*variant, round)?;
                say(&format!(
                    "round {round}/{rounds}: {}",
                    said(*variant, &result)
                ));
                done.push(result);
            }
        }
        Ok(Rounds { runs })
    }

    /// The variants and their runs, in the order they ran.
    pub(super) fn iter(&self) -> impl Iterator<Item = (V, &[R])> {
        self.runs.iter().map(|(v, runs)| (*v, runs.as_slice()))
    }

    /// One variant's runs, in round order (none for a variant that did not run).
    pub(super) fn runs(&self, variant: V) -> &[R] {
        self.runs
            .iter()
            .find(|(v, _)| *v == variant)
            .map_or(&[], |(_, runs)| runs)
    }

    /// One variant's runs, taken out.
    pub(super) fn into_runs(self, variant: V) -> Vec<R> {
        self.runs
            .into_iter()
            .find(|(v, _)| *v == variant)
            .map_or_else(Vec::new, |(_, runs)| runs)
    }

    /// `value` of each of a variant's runs, in round order.
    pub(super) fn values(&self, variant: V, value: impl Fn(&R) -> f64) -> Vec<f64> {
        self.runs(variant).iter().map(value).collect()
    }

    /// The median of `variant`'s values over the median of `base`'s.
    pub(super) fn ratio(&self, variant: V, base: V, value: impl Fn(&R) -> f64) -> Option<f64> {
        ratio_to(&self.values(variant, &value), &self.values(base, &value))
    }

    /// Per round: (`variant`'s value − `base`'s in the same round) / `per`. Differences
    /// within a round, not of medians, so that a round's drift cancels out.
    pub(super) fn over_base(
        &self,
        variant: V,
        base: V,
        value: impl Fn(&R) -> f64,
        per: f64,
    ) -> Vec<f64> {
        self.values(variant, &value)
            .iter()
            .zip(self.values(base, &value))
            .map(|(v, b)| (v - b) / per)
            .collect()
    }
}

/// The median of `values` over the median of `base`.
pub(super) fn ratio_to(values: &[f64], base: &[f64]) -> Option<f64> {
    Some(median(values)? / median(base)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_interleave_in_every_round() {
        let mut order = Vec::new();
        let rounds = Rounds::measure(
            3,
            ['a', 'b'],
            &mut Watch::default(),
            |variant, round| {
                order.push((variant, round));
                Ok(match variant {
                    'a' => 10.0 * f64::from(round),
                    _ => 10.0 * f64::from(round) + 2.0,
                })
            },
            |variant, time| format!("{variant} {time}"),
        )
        .unwrap();
        assert_eq!(
            order,
            [('a', 1), ('b', 1), ('a', 2), ('b', 2), ('a', 3), ('b', 3)]
        );
        assert_eq!(rounds.values('a', |t| *t), [10.0, 20.0, 30.0]);
        assert_eq!(rounds.runs('c'), &[] as &[f64]);
        // Medians 22 and 20.
        assert_eq!(rounds.ratio('b', 'a', |t| *t), Some(1.1));
        // The drift between rounds cancels out: 2 every round.
        assert_eq!(rounds.over_base('b', 'a', |t| *t, 4.0), [0.5, 0.5, 0.5]);
        let seen: Vec<(char, usize)> = rounds.iter().map(|(v, r)| (v, r.len())).collect();
        assert_eq!(seen, [('a', 3), ('b', 3)]);
        assert_eq!(rounds.into_runs('b'), [12.0, 22.0, 32.0]);
    }

    #[test]
    fn a_failed_run_ends_the_measure() {
        let mut runs = 0;
        let result: Result<Rounds<u8, ()>> = Rounds::measure(
            5,
            [1, 2],
            &mut Watch::default(),
            |variant, round| {
                runs += 1;
                if (variant, round) == (2, 2) {
                    Err("run 2 failed".into())
                } else {
                    Ok(())
                }
            },
            |_, _| String::new(),
        );
        assert_eq!(result.unwrap_err().to_string(), "run 2 failed");
        assert_eq!(runs, 4);
    }

    #[test]
    fn ratios_of_medians() {
        assert_eq!(ratio_to(&[2.0, 4.0, 3.0], &[1.0, 2.0]), Some(2.0));
        assert_eq!(ratio_to(&[], &[1.0]), None);
        assert_eq!(ratio_to(&[1.0], &[]), None);
    }
}
