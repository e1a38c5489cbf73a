//! How uprobes go into the kernel (`--uprobe-links`): a setting the attaching reads.
use super::BadValue;

/// How uprobes go into the kernel (`--uprobe-links`, `LENS_PROBE_UPROBE_LINKS`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UprobeLinks {
    /// One uprobe_multi link per program and library where the kernel has them, else one
    /// perf link per point, said once.
    #[default]
    Auto,
    /// One uprobe_multi link per program and library, or refuse to start.
    Multi,
    /// One perf link per point: each is removed on its own (one RCU grace period each).
    Perf,
}

impl UprobeLinks {
    pub const ALL: [UprobeLinks; 3] = [UprobeLinks::Auto, UprobeLinks::Multi, UprobeLinks::Perf];

    pub fn name(self) -> &'static str {
        match self {
            UprobeLinks::Auto => "auto",
            UprobeLinks::Multi => "multi",
            UprobeLinks::Perf => "perf",
        }
    }
}

impl std::str::FromStr for UprobeLinks {
    type Err = BadValue;

    fn from_str(text: &str) -> std::result::Result<UprobeLinks, BadValue> {
        let lower = text.trim().to_ascii_lowercase();
        UprobeLinks::ALL
            .into_iter()
            .find(|links| links.name() == lower)
            .ok_or_else(|| {
                let names: Vec<&str> = UprobeLinks::ALL.iter().map(|l| l.name()).collect();
                BadValue::from(format!(
                    "unknown uprobe link kind; valid: {}",
                    names.join(", ")
                ))
            })
    }
}
