//! What is kept of a target's environment and command line: its rank, the allow-listed
//! variables, and secrets (in names, URLs, options) redacted.
use std::fs;

/// A process's rank as its launcher set it in its environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: i64,
    pub world_size: Option<i64>,
    pub local_rank: Option<i64>,
}

/// (rank, world size, local rank) variables, by launcher, in order of preference:
/// torchrun/torch.distributed, SLURM, Open MPI.
pub(super) const RANK_VARIABLES: [[&str; 3]; 3] = [
    ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
    ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
    [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ],
];

impl RankInfo {
    pub fn from_environment(environment: &[(String, String)]) -> Option<RankInfo> {
        let get = |key: &str| -> Option<i64> {
            environment
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| v.trim().parse().ok())
        };
        RANK_VARIABLES.iter().find_map(|[rank, world, local]| {
            Some(RankInfo {
                rank: get(rank)?,
                world_size: get(world),
                local_rank: get(local),
            })
        })
    }
}

/// The only variables kept from a target's environment: what its rank
/// ([`RANK_VARIABLES`]) and its resource (`export/resource.rs`) are made of. Everything
/// else in `/proc/PID/environ` is dropped as it is read, so it cannot reach telemetry, a
/// log or a summary. None of these names looks like a secret ([`looks_secret`]).
pub const ENVIRONMENT_ALLOW_LIST: [&str; 37] = [
    // Rank, world size, local rank: torchrun, SLURM, Open MPI.
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    // NeMo Lens' resource attributes.
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "NEMO_LENS_RUN_ID",
    "NEMO_LENS_USER_ID",
    "TORCHELASTIC_RUN_ID",
    // Which attempt of a restarted job (torchrun's restarts, SLURM's requeues).
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_RESTART_COUNT",
    "WANDB_ENTITY",
    "WANDB_PROJECT",
    "DEPLOYMENT_ENV",
    "ENVIRONMENT",
    "HOSTNAME",
    "CUDA_VISIBLE_DEVICES",
    // SLURM.
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_NODELIST",
    "SLURM_NNODES",
    "SLURM_PARTITION",
    "SLURM_JOB_PARTITION",
    "SLURM_STEP_ID",
    "SLURM_CLUSTER_NAME",
    // Kubernetes (the downward API variables Lens reads).
    "KUBERNETES_SERVICE_HOST",
    "K8S_NAMESPACE",
    "K8S_POD_NAME",
    "K8S_POD_UID",
    "K8S_NODE_NAME",
    "K8S_CONTAINER_NAME",
    "K8S_JOB_NAME",
];

/// Words in a name (of a variable, a resource attribute, a command-line option) that mark
/// its value as a secret: such values are never kept, whatever the name's place.
const SECRET_WORDS: [&str; 12] = [
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "PRIVATE",
    "KEY",
    "COOKIE",
    "AUTHORIZATION",
    "BEARER",
    "APIKEY",
];

/// Short words that mark a secret only as a whole part of a name (`--auth`, `--db_pass`,
/// `--pat`, `GITLAB_PAT`), not inside another word (`PATH`, `--author`, `--compass`).
const SECRET_PARTS: [&str; 6] = ["AUTH", "PASS", "PAT", "PW", "PWD", "CRED"];

/// Whether `name` looks like it names a secret (`MY_API_TOKEN`, `db.password`,
/// `--wandb-api-key`, `AWS_SECRET_ACCESS_KEY`, `--auth`, `--db_pass`): case-insensitive,
/// anywhere in the name, or, for short words, as one of its parts. A false positive only
/// costs an attribute; there are no exceptions.
pub fn looks_secret(name: &str) -> bool {
    let name = name.to_ascii_uppercase();
    SECRET_WORDS.iter().any(|word| name.contains(word))
        || name
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|part| SECRET_PARTS.contains(&part))
}

/// `scheme://user:secret@host/...` → `scheme://…@host/...`, for every URL in `text`:
/// credentials in a URL are never shown nor exported, whatever carries them (an error
/// message, a command line).
pub fn redact_url_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        let authority_end = after
            .find(|c: char| matches!(c, '/' | '?' | '#') || c.is_whitespace() || c == '"')
            .unwrap_or(after.len());
        match after[..authority_end].rfind('@') {
            Some(user_end) => {
                out.push('…');
                rest = &after[user_end..];
            }
            None => rest = after,
        }
    }
    out.push_str(rest);
    out
}

pub(super) fn allowed_variable(name: &str) -> bool {
    ENVIRONMENT_ALLOW_LIST.contains(&name) && !looks_secret(name)
}

/// `NAME=VALUE` entries of a `/proc/PID/environ`, for which `keep(NAME)` holds.
pub(super) fn environment_entries(
    environ: &[u8],
    keep: impl Fn(&str) -> bool,
) -> Vec<(String, String)> {
    environ
        .split(|b| *b == 0)
        .filter_map(|entry| {
            let at = entry.iter().position(|b| *b == b'=')?;
            let key = std::str::from_utf8(&entry[..at]).ok()?;
            keep(key).then(|| {
                (
                    key.to_string(),
                    String::from_utf8_lossy(&entry[at + 1..]).into_owned(),
                )
            })
        })
        .collect()
}

/// The allow-listed variables ([`ENVIRONMENT_ALLOW_LIST`]) of the environment the process
/// started its current program with (`/proc/PID/environ`).
pub fn read_environment(pid: u32) -> Vec<(String, String)> {
    let environ = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    environment_entries(&environ, allowed_variable)
}

/// The value of one variable of `pid`'s environment, allow-listed or not, for a
/// comparison the user asked for (`--match-env`); kept nowhere.
pub fn read_variable(pid: u32, name: &str) -> Option<String> {
    let environ = fs::read(format!("/proc/{pid}/environ")).ok()?;
    environment_entries(&environ, |key| key == name)
        .pop()
        .map(|(_, value)| value)
}

/// A command line with the values of secret-looking options and assignments replaced by
/// `***`: `--api-key=X`, `--token X`, `WANDB_API_KEY=X` (as `env` takes it).
pub fn redact_command_line(arguments: Vec<String>) -> Vec<String> {
    let mut redact_next = false;
    arguments
        .into_iter()
        .map(|argument| {
            if std::mem::take(&mut redact_next) && !argument.starts_with('-') {
                return "***".to_string();
            }
            let argument = redact_url_userinfo(&argument);
            if let Some((name, _)) = argument.split_once('=')
                && looks_secret(name)
            {
                return format!("{name}=***");
            }
            redact_next = argument.starts_with('-') && looks_secret(&argument);
            argument
        })
        .collect()
}
