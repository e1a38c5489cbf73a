//! The bench's blocks, as `--only` names them, and sets of them.

/// The bench's blocks, as `--only` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Block {
    /// The fake trainer: per-hit cost, slowdown per preset, its events (1, 2a, 5).
    Trainer,
    /// Per-hit cost per probe kind (1b).
    PerKind,
    /// An untraced process beside a traced one, the same library file (10).
    Neighbour,
    /// The PyTorch loop per preset, lens-probe's CPU and memory (2b, 4).
    Torch,
    /// `--pid` attach to a running PyTorch process (3, 4).
    Attach,
    /// The user side's event throughput from the kernel-side generator (5b).
    Throughput,
    /// `--overhead-budget` on a launch-heavy loop (2c).
    Budget,
    /// The Python stack sampler on a pure-Python loop (6).
    Python,
    /// Hang detection's look every second, on the fake trainer (7).
    Hangs,
    /// lens-probe's exit until its probes are out of the kernel (8).
    Teardown,
    /// transformers `Trainer` and 2-rank DDP loops per preset (9).
    Frameworks,
    /// Attach, links and teardown with 1, 8 and 64 traced processes (11).
    Scale,
    /// Activation checkpointing: grad mode switched hundreds of times a step (12).
    Recompute,
}

impl Block {
    pub const ALL: [Block; 13] = [
        Block::Trainer,
        Block::PerKind,
        Block::Neighbour,
        Block::Torch,
        Block::Attach,
        Block::Throughput,
        Block::Budget,
        Block::Python,
        Block::Hangs,
        Block::Teardown,
        Block::Frameworks,
        Block::Scale,
        Block::Recompute,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Block::Trainer => "trainer",
            Block::PerKind => "per-kind",
            Block::Neighbour => "neighbour",
            Block::Torch => "torch",
            Block::Attach => "attach",
            Block::Throughput => "throughput",
            Block::Budget => "budget",
            Block::Python => "python",
            Block::Hangs => "hangs",
            Block::Teardown => "teardown",
            Block::Frameworks => "frameworks",
            Block::Scale => "scale",
            Block::Recompute => "recompute",
        }
    }
}

/// A set of [`Block`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocks(u16);

impl Blocks {
    pub const ALL: Blocks = Blocks((1u16 << Block::ALL.len()) - 1);

    pub fn contains(self, block: Block) -> bool {
        self.0 & (1 << block as u16) != 0
    }

    pub fn of(blocks: &[Block]) -> Blocks {
        Blocks(blocks.iter().fold(0, |set, block| set | 1 << *block as u16))
    }
}
