//! The built-in rules: the profiles `--profile` selects (Megatron-LM, NeMo-RL) and the
//! save and load functions of the frameworks people train with, which every run probes.
//! Both in the config file's own format, parsed by `config`.
use super::BadValue;
use std::{fmt, str::FromStr};

/// A built-in set of rules, selected with `--profile`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    /// lens-probe's built-in PyTorch probes and nothing more (the default).
    #[default]
    Pytorch,
    /// Megatron-LM's training loop (Python functions).
    Megatron,
    /// NeMo-RL's validation (Python functions).
    NemoRl,
}

impl Profile {
    pub const ALL: [Profile; 3] = [Profile::Pytorch, Profile::Megatron, Profile::NemoRl];

    pub const fn name(self) -> &'static str {
        match self {
            Profile::Pytorch => "pytorch",
            Profile::Megatron => "megatron",
            Profile::NemoRl => "nemo-rl",
        }
    }

    /// The profile's rules, in the config file's own format. Only names read in the
    /// projects' public source are here (see `docs/probes.md`).
    pub(super) const fn rules(self) -> &'static str {
        match self {
            Profile::Pytorch => "",
            // megatron/training/training.py and megatron/training/checkpointing.py.
            Profile::Megatron => {
                r#"
                [[probe]]
                python = "megatron.training.training:train_step"
                group = "step"
                [[probe]]
                python = "megatron.training.training:evaluate"
                group = "evaluate"
                [[probe]]
                python = "megatron.training.checkpointing:save_checkpoint"
                group = "checkpoint"
                [[probe]]
                python = "megatron.training.checkpointing:load_checkpoint"
                group = "load_checkpoint"
                "#
            }
            // nemo_rl/algorithms/sft.py: the training loop is one function (sft_train),
            // its steps are not functions of their own.
            Profile::NemoRl => {
                r#"
                [[probe]]
                python = "nemo_rl.algorithms.sft:validate"
                group = "evaluate"
                "#
            }
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Profile {
    type Err = BadValue;

    fn from_str(text: &str) -> Result<Profile, BadValue> {
        let lower = text.trim().to_ascii_lowercase();
        Profile::ALL
            .into_iter()
            .find(|p| p.name() == lower || p.name().replace('-', "_") == lower)
            .ok_or_else(|| {
                let names: Vec<&str> = Profile::ALL.iter().map(|p| p.name()).collect();
                BadValue::from(format!("unknown profile; valid: {}", names.join(", ")))
            })
    }
}

/// The save and load functions of the frameworks people train with: their calls bound
/// `train.checkpoint` / `train.load_checkpoint` (`docs/spans.md`, "checkpoint"), so a save
/// is one span from its start, Python work and collectives included, to its end. Only
/// names read in each project's source at the versions `docs/spans.md` lists.
pub(super) const FRAMEWORK_SAVE_RULES: &str = r#"
# transformers/trainer.py, transformers/modeling_utils.py
[[probe]]
python = "transformers.trainer:Trainer._save_checkpoint"
group = "checkpoint"
[[probe]]
python = "transformers.trainer:Trainer.save_model"
group = "checkpoint"
[[probe]]
python = "transformers.modeling_utils:PreTrainedModel.save_pretrained"
group = "checkpoint"
[[probe]]
python = "transformers.trainer:Trainer._load_from_checkpoint"
group = "load_checkpoint"
[[probe]]
python = "transformers.trainer:Trainer._load_optimizer_and_scheduler"
group = "load_checkpoint"
[[probe]]
python = "transformers.trainer:Trainer._load_rng_state"
group = "load_checkpoint"
# lightning/pytorch/trainer/trainer.py, .../connectors/checkpoint_connector.py: `restore`
# is the tuner's; `Trainer.fit(ckpt_path=...)` (and validate, test, predict) restores
# through `_restore_modules_and_callbacks` (the file's `torch.load`, then the model)
[[probe]]
python = "lightning.pytorch.trainer.trainer:Trainer.save_checkpoint"
group = "checkpoint"
[[probe]]
python = "pytorch_lightning.trainer.trainer:Trainer.save_checkpoint"
group = "checkpoint"
[[probe]]
python = "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector.restore"
group = "load_checkpoint"
[[probe]]
python = "pytorch_lightning.trainer.connectors.checkpoint_connector:_CheckpointConnector.restore"
group = "load_checkpoint"
[[probe]]
python = "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector._restore_modules_and_callbacks"
group = "load_checkpoint"
[[probe]]
python = "pytorch_lightning.trainer.connectors.checkpoint_connector:_CheckpointConnector._restore_modules_and_callbacks"
group = "load_checkpoint"
# lightning/fabric/fabric.py (also installed as the package lightning_fabric): save and
# load call the strategy's save_checkpoint (its state dicts, then `torch.save` into a
# buffer written through fsspec) / load_checkpoint, then a barrier
[[probe]]
python = "lightning.fabric.fabric:Fabric.save"
group = "checkpoint"
[[probe]]
python = "lightning_fabric.fabric:Fabric.save"
group = "checkpoint"
[[probe]]
python = "lightning.fabric.fabric:Fabric.load"
group = "load_checkpoint"
[[probe]]
python = "lightning_fabric.fabric:Fabric.load"
group = "load_checkpoint"
[[probe]]
python = "lightning.fabric.fabric:Fabric.load_raw"
group = "load_checkpoint"
[[probe]]
python = "lightning_fabric.fabric:Fabric.load_raw"
group = "load_checkpoint"
# accelerate/accelerator.py: save_state / load_state (model weights, optimizer,
# scheduler, sampler, RNG and custom states of a folder: accelerate/checkpointing.py),
# save_model (the model's state dict, sharded, as safetensors or torch.save files)
[[probe]]
python = "accelerate.accelerator:Accelerator.save_state"
group = "checkpoint"
[[probe]]
python = "accelerate.accelerator:Accelerator.save_model"
group = "checkpoint"
[[probe]]
python = "accelerate.accelerator:Accelerator.load_state"
group = "load_checkpoint"
# safetensors/torch.py
[[probe]]
python = "safetensors.torch:save_file"
group = "checkpoint"
[[probe]]
python = "safetensors.torch:save_model"
group = "checkpoint"
[[probe]]
python = "safetensors.torch:load_file"
group = "load_checkpoint"
[[probe]]
python = "safetensors.torch:load_model"
group = "load_checkpoint"
# torch/distributed/checkpoint/state_dict_saver.py, state_dict_loader.py
[[probe]]
python = "torch.distributed.checkpoint.state_dict_saver:save"
group = "checkpoint"
[[probe]]
python = "torch.distributed.checkpoint.state_dict_saver:async_save"
group = "checkpoint"
[[probe]]
python = "torch.distributed.checkpoint.state_dict_loader:load"
group = "load_checkpoint"
# torch/distributed/checkpoint/state_dict.py: the state gathered before a save or a load
# (the span that follows starts there), and a loaded state put into model and optimizer
[[probe]]
python = "torch.distributed.checkpoint.state_dict:get_state_dict"
group = "checkpoint"
[[probe]]
python = "torch.distributed.checkpoint.state_dict:set_state_dict"
group = "load_checkpoint"
[[probe]]
python = "torch.distributed.checkpoint.state_dict:set_model_state_dict"
group = "load_checkpoint"
[[probe]]
python = "torch.distributed.checkpoint.state_dict:set_optimizer_state_dict"
group = "load_checkpoint"
"#;

/// DCP's `async_save`: its span lasts until the background thread's `save` that it
/// started has returned.
pub const DCP_ASYNC_SAVE: (&str, &str) = (
    "torch.distributed.checkpoint.state_dict_saver",
    "async_save",
);

/// DCP's `get_state_dict`: what a save or a load begins with, so the checkpoint (load)
/// that follows it at once starts with it; alone it is no span.
pub const DCP_GET_STATE_DICT: (&str, &str) =
    ("torch.distributed.checkpoint.state_dict", "get_state_dict");
