//! Span groups, exactly as NeMo Lens names them, and the spec syntax that enables them.
//!
//! A group that is off has its probes not attached at all (see `probes::catalog`).
use std::{collections::BTreeSet, fmt, str::FromStr};

use crate::error::LensError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanGroup {
    Job,
    Checkpoint,
    Evaluate,
    ModelInit,
    LoadCheckpoint,
    Step,
    ForwardBackward,
    Optimizer,
}

impl SpanGroup {
    pub const ALL: [SpanGroup; 8] = [
        SpanGroup::Job,
        SpanGroup::Checkpoint,
        SpanGroup::Evaluate,
        SpanGroup::ModelInit,
        SpanGroup::LoadCheckpoint,
        SpanGroup::Step,
        SpanGroup::ForwardBackward,
        SpanGroup::Optimizer,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            SpanGroup::Job => "job",
            SpanGroup::Checkpoint => "checkpoint",
            SpanGroup::Evaluate => "evaluate",
            SpanGroup::ModelInit => "model_init",
            SpanGroup::LoadCheckpoint => "load_checkpoint",
            SpanGroup::Step => "step",
            SpanGroup::ForwardBackward => "forward_backward",
            SpanGroup::Optimizer => "optimizer",
        }
    }
}

impl fmt::Display for SpanGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Named sets of groups.
pub const PRESET_DEFAULT: &str = "default";
pub const PRESET_PER_STEP: &str = "per_step";
pub const PRESET_ALL: &str = "all";

const DEFAULT_GROUPS: [SpanGroup; 3] = [SpanGroup::Job, SpanGroup::Checkpoint, SpanGroup::Evaluate];

/// The enabled groups. Parsed from a spec such as `default,step`: comma-separated presets
/// and group names, case-insensitive, blanks around names ignored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpanGroups(BTreeSet<SpanGroup>);

impl SpanGroups {
    pub fn contains(&self, group: SpanGroup) -> bool {
        self.0.contains(&group)
    }

    pub fn iter(&self) -> impl Iterator<Item = SpanGroup> + '_ {
        self.0.iter().copied()
    }

    /// Every valid name in a spec, sorted, for error messages.
    pub fn valid_names() -> Vec<&'static str> {
        let mut names: Vec<&'static str> = SpanGroup::ALL.iter().map(|g| g.name()).collect();
        names.extend([PRESET_DEFAULT, PRESET_PER_STEP, PRESET_ALL]);
        names.sort_unstable();
        names
    }
}

impl Default for SpanGroups {
    fn default() -> Self {
        SpanGroups(DEFAULT_GROUPS.into_iter().collect())
    }
}

impl FromStr for SpanGroups {
    type Err = LensError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: String| LensError::InvalidSetting {
            key: "span groups".into(),
            value: spec.into(),
            reason,
        };
        let mut groups = BTreeSet::new();
        for name in spec.split(',').map(str::trim) {
            if name.is_empty() {
                return Err(invalid(format!(
                    "empty group name; valid: {}",
                    SpanGroups::valid_names().join(", ")
                )));
            }
            let lower = name.to_ascii_lowercase();
            match lower.as_str() {
                PRESET_DEFAULT => groups.extend(DEFAULT_GROUPS),
                PRESET_PER_STEP | PRESET_ALL => groups.extend(SpanGroup::ALL),
                other => match SpanGroup::ALL.iter().find(|g| g.name() == other) {
                    Some(group) => {
                        groups.insert(*group);
                    }
                    None => {
                        return Err(invalid(format!(
                            "unknown span group {name:?}; valid: {}",
                            SpanGroups::valid_names().join(", ")
                        )));
                    }
                },
            }
        }
        Ok(SpanGroups(groups))
    }
}

impl fmt::Display for SpanGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.iter().map(|g| g.name()).collect();
        f.write_str(&names.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_preset_is_job_checkpoint_evaluate() {
        let groups: SpanGroups = "default".parse().unwrap();
        assert_eq!(groups.to_string(), "job,checkpoint,evaluate");
        assert_eq!(groups, SpanGroups::default());
    }

    #[test]
    fn per_step_and_all_enable_all_eight() {
        for spec in ["per_step", "all", "ALL", " Per_Step "] {
            let groups: SpanGroups = spec.parse().unwrap();
            assert_eq!(groups.iter().count(), 8, "{spec}");
        }
    }

    #[test]
    fn presets_and_groups_mix_case_insensitively() {
        let groups: SpanGroups = "default,STEP, optimizer".parse().unwrap();
        assert_eq!(groups.to_string(), "job,checkpoint,evaluate,step,optimizer");
    }

    #[test]
    fn unknown_name_is_rejected_with_the_sorted_valid_list() {
        let error = "default,steps"
            .parse::<SpanGroups>()
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown span group \"steps\""), "{error}");
        assert!(
            error.contains(
                "valid: all, checkpoint, default, evaluate, forward_backward, job, \
                 load_checkpoint, model_init, optimizer, per_step, step"
            ),
            "{error}"
        );
    }

    #[test]
    fn empty_names_are_rejected() {
        assert!("".parse::<SpanGroups>().is_err());
        assert!("job,,step".parse::<SpanGroups>().is_err());
    }
}
