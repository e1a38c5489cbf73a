//! Which ranks export: NeMo Lens' four built-in export strategies
//! (`nemo.lens.strategies`), decided per traced process from the rank its launcher gave
//! it. The decisions are the same as Lens' for the same settings, so a job traced by
//! lens-probe exports from the same ranks as the same job instrumented with Lens.
use std::{fmt, str::FromStr};

use md5::{Digest, Md5};

use crate::{
    error::{LensError, Result},
    sys::target::RankInfo,
};

/// A rank-selection rule (`NEMO_LENS_EXPORT_STRATEGY`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExportStrategy {
    /// Only `rank` exports; a negative `rank` (Lens' default, -1) means the last rank,
    /// `world_size - 1` (`NEMO_LENS_EXPORT_RANK`).
    SingleRank { rank: i64 },
    /// Every rank exports.
    AllRanks,
    /// A deterministic share `rate` (0..=1) of ranks exports: a rank exports when
    /// `int(md5(str(rank)), 16) % 10000 / 10000 < rate` (`NEMO_LENS_EXPORT_SAMPLE_RATE`).
    Sampled { rate: f64 },
    /// The first local rank of each node (`LOCAL_RANK` 0, a missing one counting as 0).
    FirstRankPerNode,
}

impl ExportStrategy {
    /// The names, as NeMo Lens registers them.
    pub const NAMES: [&'static str; 4] =
        ["single_rank", "all_ranks", "sampled", "first_rank_per_node"];

    pub fn name(&self) -> &'static str {
        match self {
            ExportStrategy::SingleRank { .. } => "single_rank",
            ExportStrategy::AllRanks => "all_ranks",
            ExportStrategy::Sampled { .. } => "sampled",
            ExportStrategy::FirstRankPerNode => "first_rank_per_node",
        }
    }

    /// Whether a process with this rank exports. A process without rank information is
    /// rank 0 of a world of 1 (Lens' `setup_telemetry` defaults), and a rank whose world
    /// size is unknown is in a world of 1 too. The local rank is the one
    /// [`RankInfo::from_environment`] found (`LOCAL_RANK`, else the SLURM or Open MPI
    /// one); a missing one is 0.
    pub fn exports(&self, rank: Option<&RankInfo>) -> bool {
        let (rank, world_size, local_rank) = match rank {
            Some(info) => (
                info.rank,
                info.world_size.unwrap_or(1),
                info.local_rank.unwrap_or(0),
            ),
            None => (0, 1, 0),
        };
        match *self {
            ExportStrategy::AllRanks => true,
            ExportStrategy::SingleRank { rank: export_rank } => {
                let resolved = if export_rank >= 0 {
                    export_rank
                } else {
                    world_size - 1
                };
                rank == resolved
            }
            ExportStrategy::Sampled { rate } => sampled(rank, rate),
            ExportStrategy::FirstRankPerNode => local_rank == 0,
        }
    }
}

/// Lens' rank sampling (`strategies._sampled`, `sampling.RankAwareSampler`): the MD5 of
/// the rank's decimal string, as one big-endian 128-bit integer, modulo 10000, over
/// 10000, compared with the rate. A rate of 1 or more always samples and 0 or less never
/// does (as `RankAwareSampler`; within [0, 1] the formula alone gives the same).
pub fn sampled(rank: i64, rate: f64) -> bool {
    if rate >= 1.0 {
        return true;
    }
    if rate <= 0.0 || rate.is_nan() {
        return false;
    }
    let digest: [u8; 16] = Md5::digest(rank.to_string().as_bytes()).into();
    let bucket = u128::from_be_bytes(digest) % 10_000;
    (bucket as f64) / 10_000.0 < rate
}

impl FromStr for ExportStrategy {
    type Err = LensError;

    /// A strategy name, case-insensitive, surrounding blanks ignored. The parameters get
    /// Lens' defaults (`SingleRank { rank: -1 }`, `Sampled { rate: 1.0 }`); the settings
    /// ([`super::config`]) fill in the configured ones.
    fn from_str(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "single_rank" => Ok(ExportStrategy::SingleRank { rank: -1 }),
            "all_ranks" => Ok(ExportStrategy::AllRanks),
            "sampled" => Ok(ExportStrategy::Sampled { rate: 1.0 }),
            "first_rank_per_node" => Ok(ExportStrategy::FirstRankPerNode),
            _ => Err(LensError::InvalidSetting {
                key: "export strategy".into(),
                value: text.into(),
                reason: format!("expected one of {}", ExportStrategy::NAMES.join(", ")),
            }),
        }
    }
}

impl fmt::Display for ExportStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExportStrategy::SingleRank { rank } if *rank >= 0 => {
                write!(f, "single_rank (rank {rank})")
            }
            ExportStrategy::SingleRank { .. } => write!(f, "single_rank (last rank)"),
            ExportStrategy::Sampled { rate } => write!(f, "sampled (rate {rate})"),
            other => f.write_str(other.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(rank: i64, world_size: Option<i64>, local_rank: Option<i64>) -> RankInfo {
        RankInfo {
            rank,
            world_size,
            local_rank,
        }
    }

    #[test]
    fn sampling_decides_as_lens_does() {
        // Computed with:
        // python3 -c "import hashlib; print([(int(hashlib.md5(str(r).encode()).hexdigest(), 16) % 10000) / 10000.0 < 0.5 for r in range(17)])"
        let expected = [
            false, false, false, true, true, true, true, false, true, false, true, true, false,
            true, false, false, false,
        ];
        for (r, want) in expected.into_iter().enumerate() {
            let info = rank(r as i64, Some(17), None);
            let strategy = ExportStrategy::Sampled { rate: 0.5 };
            assert_eq!(strategy.exports(Some(&info)), want, "rank {r}");
        }
        // Buckets (same formula, without the comparison): rank 3 → 0.0883, rank 7 → 0.5555.
        assert!(sampled(3, 0.0884) && !sampled(3, 0.0883));
        assert!(sampled(7, 0.5556) && !sampled(7, 0.5555));
    }

    #[test]
    fn sampling_rates_at_the_bounds() {
        for r in 0..64 {
            assert!(sampled(r, 1.0));
            assert!(!sampled(r, 0.0));
        }
        assert!(sampled(0, 2.0));
        assert!(!sampled(0, -1.0));
    }

    #[test]
    fn single_rank_defaults_to_the_last() {
        let last = ExportStrategy::SingleRank { rank: -1 };
        assert!(last.exports(Some(&rank(7, Some(8), Some(7)))));
        assert!(!last.exports(Some(&rank(0, Some(8), Some(0)))));
        let second = ExportStrategy::SingleRank { rank: 1 };
        assert!(second.exports(Some(&rank(1, Some(8), None))));
        assert!(!second.exports(Some(&rank(7, Some(8), None))));
    }

    #[test]
    fn a_process_without_rank_is_rank_0_of_1() {
        assert!(ExportStrategy::SingleRank { rank: -1 }.exports(None));
        assert!(ExportStrategy::SingleRank { rank: 0 }.exports(None));
        assert!(!ExportStrategy::SingleRank { rank: 1 }.exports(None));
        assert!(ExportStrategy::AllRanks.exports(None));
        assert!(ExportStrategy::FirstRankPerNode.exports(None));
        // md5("0") → bucket 0.785.
        assert!(!ExportStrategy::Sampled { rate: 0.5 }.exports(None));
        assert!(ExportStrategy::Sampled { rate: 0.79 }.exports(None));
        // A rank without a world size is in a world of 1.
        assert!(!ExportStrategy::SingleRank { rank: -1 }.exports(Some(&rank(3, None, None))));
    }

    #[test]
    fn first_rank_per_node_reads_the_local_rank() {
        let s = ExportStrategy::FirstRankPerNode;
        assert!(s.exports(Some(&rank(8, Some(16), Some(0)))));
        assert!(!s.exports(Some(&rank(9, Some(16), Some(1)))));
        assert!(s.exports(Some(&rank(9, Some(16), None))));
    }

    #[test]
    fn all_ranks_export() {
        for r in 0..8 {
            assert!(ExportStrategy::AllRanks.exports(Some(&rank(r, Some(8), Some(r % 4)))));
        }
    }

    #[test]
    fn names_parse_case_insensitively() {
        assert_eq!(
            " Single_Rank ".parse::<ExportStrategy>().unwrap(),
            ExportStrategy::SingleRank { rank: -1 }
        );
        assert_eq!(
            "ALL_RANKS".parse::<ExportStrategy>().unwrap(),
            ExportStrategy::AllRanks
        );
        assert_eq!(
            "sampled".parse::<ExportStrategy>().unwrap(),
            ExportStrategy::Sampled { rate: 1.0 }
        );
        assert_eq!(
            "first_rank_per_node".parse::<ExportStrategy>().unwrap(),
            ExportStrategy::FirstRankPerNode
        );
        for name in ExportStrategy::NAMES {
            assert_eq!(name.parse::<ExportStrategy>().unwrap().name(), name);
        }
    }

    #[test]
    fn an_unknown_name_lists_the_valid_ones() {
        let error = "every_rank".parse::<ExportStrategy>().unwrap_err();
        assert_eq!(error.exit_code(), 2);
        assert_eq!(
            error.to_string(),
            "invalid value \"every_rank\" for export strategy: expected one of \
             single_rank, all_ranks, sampled, first_rank_per_node"
        );
    }
}
