//! The OpenTelemetry resource of a traced process: the attributes NeMo Lens would give it
//! (`nemo.lens.providers.build_providers` and `nemo.lens.resources`), read from the
//! target itself (its environment, its root directory, its cgroup), not from lens-probe,
//! which may run in another container or on the host.
//!
//! | attribute | from |
//! | --- | --- |
//! | `service.name` | target's `OTEL_SERVICE_NAME`, else lens-probe's, else `nemo` |
//! | `service.version` | lens-probe's version |
//! | `dl.rank`, `dl.world_size` | the launcher's variables ([`RankInfo`]); 0 and 1 when unknown |
//! | `dl.local_rank` | the same, when known |
//! | `nemo.run.id` | `NEMO_LENS_RUN_ID`, else `SLURM_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else lens-probe's own run id |
//! | `service.instance.id` | `<run id>-rank<rank>`, with `-restart<n>` / `-requeue<n>` for a later attempt |
//! | `dl.restart_count` | `TORCHELASTIC_RESTART_COUNT`, when set |
//! | `slurm.restart_count` | `SLURM_RESTART_COUNT`, when set |
//! | `nemo.user.id` | `NEMO_LENS_USER_ID` |
//! | `wandb.entity`, `wandb.project` | `WANDB_ENTITY`, `WANDB_PROJECT` |
//! | `deployment.environment` | `DEPLOYMENT_ENV`, else `ENVIRONMENT` |
//! | `host.name` | `HOSTNAME`, else the target's `/etc/hostname`, else this machine's name |
//! | `process.pid`, `process.command_line` | `/proc/PID` |
//! | `host.gpu.count` | `CUDA_VISIBLE_DEVICES` entries, else the target's `/dev/nvidiaN` |
//! | `slurm.*` | `SLURM_*`, when `SLURM_JOB_ID` is set |
//! | `k8s.*` | `K8S_*` (downward API), when in Kubernetes; the namespace also from the service account, the pod UID also from the cgroup |
//! | others | the target's `OTEL_RESOURCE_ATTRIBUTES` (`key=value,…`, as the OpenTelemetry SDK in the target would read it), under the attributes above and without keys that look like secrets |
//!
//! Only the variables of [`crate::sys::target::ENVIRONMENT_ALLOW_LIST`] are ever read from the
//! target's environment; see `docs/security.md`.
use std::{
    fs,
    hash::{BuildHasher, Hasher},
    io::Read,
    path::Path,
};

use md5::{Digest, Md5};

use crate::{
    semconv,
    spans::AttrValue,
    sys::target::{ProcessInfo, RankInfo, TargetView, looks_secret},
};

/// Service name when neither the target nor lens-probe sets `OTEL_SERVICE_NAME` (Lens'
/// default).
pub const DEFAULT_SERVICE_NAME: &str = "nemo";

/// What describes one traced process to the backend.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetResource {
    /// Resource attributes, in Lens' order; names from [`semconv`].
    pub attributes: Vec<(&'static str, AttrValue)>,
    /// The job's run id (`nemo.run.id`): shared by every rank of a run.
    pub run_id: String,
    /// What names the attempt's trace ([`trace_id_for_run`]): the run id, and which
    /// restart (torchrun) or requeue (SLURM) of it, when a later one: each attempt of a
    /// restarted job is a trace of its own, its ranks together.
    pub attempt_id: String,
    /// The process's rank, from its environment; `None` for a process no launcher ranked.
    pub rank: Option<RankInfo>,
    /// From the target's `OTEL_RESOURCE_ATTRIBUTES`: keys that [`Self::attributes`] does
    /// not have and that do not look like secrets ([`looks_secret`]), in their order.
    pub user_attributes: Vec<(String, String)>,
}

impl TargetResource {
    pub fn attr(&self, key: &str) -> Option<&AttrValue> {
        self.attributes
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }
}

// The target's variables that say what it is.
const ENV_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
const ENV_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
const ENV_RUN_ID: &str = "NEMO_LENS_RUN_ID";
const ENV_USER_ID: &str = "NEMO_LENS_USER_ID";
const ENV_TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
const ENV_TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
const ENV_SLURM_RESTART_COUNT: &str = "SLURM_RESTART_COUNT";
const ENV_WANDB_ENTITY: &str = "WANDB_ENTITY";
const ENV_WANDB_PROJECT: &str = "WANDB_PROJECT";
const ENV_DEPLOYMENT_ENV: &str = "DEPLOYMENT_ENV";
const ENV_ENVIRONMENT: &str = "ENVIRONMENT";
const ENV_HOSTNAME: &str = "HOSTNAME";
const ENV_CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
const ENV_SLURM_JOB_ID: &str = "SLURM_JOB_ID";
const ENV_KUBERNETES_SERVICE_HOST: &str = "KUBERNETES_SERVICE_HOST";

/// `nemo.lens.resources.slurm`: variable → attribute, after `slurm.job.id`, the first
/// set one winning. Lens reads `SLURM_PARTITION`, which is only an input of sbatch and
/// srun: the tasks of a real job have `SLURM_JOB_PARTITION` (seen under slurmd 22.05).
const SLURM_ATTRIBUTES: [(&str, &str); 8] = [
    ("SLURM_JOB_NAME", semconv::SLURM_JOB_NAME),
    ("SLURM_NODELIST", semconv::SLURM_NODELIST),
    ("SLURM_NNODES", semconv::SLURM_NNODES),
    ("SLURM_NTASKS", semconv::SLURM_NTASKS),
    ("SLURM_PARTITION", semconv::SLURM_PARTITION),
    ("SLURM_JOB_PARTITION", semconv::SLURM_PARTITION),
    ("SLURM_CLUSTER_NAME", semconv::SLURM_CLUSTER_NAME),
    ("SLURM_STEP_ID", semconv::SLURM_STEP_ID),
];

/// `nemo.lens.resources.kubernetes`: variable → attribute, the first set one winning
/// (`HOSTNAME` is the pod name's fallback).
const K8S_ATTRIBUTES: [(&str, &str); 7] = [
    ("K8S_NAMESPACE", semconv::K8S_NAMESPACE_NAME),
    ("K8S_POD_NAME", semconv::K8S_POD_NAME),
    ("K8S_POD_UID", semconv::K8S_POD_UID),
    ("K8S_NODE_NAME", semconv::K8S_NODE_NAME),
    ("K8S_CONTAINER_NAME", semconv::K8S_CONTAINER_NAME),
    ("K8S_JOB_NAME", semconv::K8S_JOB_NAME),
    (ENV_HOSTNAME, semconv::K8S_POD_NAME),
];

/// The target's variables, looked up as `getenv` does (the first of a name).
struct Environment<'a>(&'a [(String, String)]);

impl Environment<'_> {
    /// Set, even if empty (Python's `os.environ.get(key)` is not `None`).
    fn raw(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Set and not empty (Python's `if os.environ.get(key):`).
    fn get(&self, key: &str) -> Option<&str> {
        self.raw(key).filter(|v| !v.is_empty())
    }

    /// Set and not blank, trimmed (Lens' `_env`, `.strip() or default`).
    fn trimmed(&self, key: &str) -> Option<&str> {
        self.raw(key).map(str::trim).filter(|v| !v.is_empty())
    }

    /// Set to a whole number.
    fn number(&self, key: &str) -> Option<u64> {
        self.trimmed(key)?.parse().ok()
    }
}

/// The resource of the process `info`, from its `environment`, its root directory `root`
/// (`/proc/PID/root`) and the text of its `/proc/PID/cgroup`. `fallback_run_id` is the
/// run id when the target's environment names none (lens-probe's own, one per lens-probe
/// run: see [`random_run_id`]); `service_name` is lens-probe's `OTEL_SERVICE_NAME`.
pub fn detect(
    info: &ProcessInfo,
    environment: &[(String, String)],
    root: &Path,
    cgroup: &str,
    fallback_run_id: &str,
    service_name: Option<&str>,
) -> TargetResource {
    let view = TargetView::read(root, environment.to_vec(), cgroup.to_string());
    detect_view(info, &view, fallback_run_id, service_name)
}

/// The resource of the process `info` from what it saw of itself (see [`TargetView`]).
pub fn detect_view(
    info: &ProcessInfo,
    view: &TargetView,
    fallback_run_id: &str,
    service_name: Option<&str>,
) -> TargetResource {
    let environment = &view.environment;
    let env = Environment(environment);
    let rank = RankInfo::from_environment(environment).or(info.rank);
    let run_id = run_id(&env, fallback_run_id);
    let mut attributes: Vec<(&'static str, AttrValue)> = Vec::new();

    // build_providers' own attributes.
    let service_name = env
        .trimmed(ENV_SERVICE_NAME)
        .or(service_name.map(str::trim).filter(|s| !s.is_empty()))
        .unwrap_or(DEFAULT_SERVICE_NAME);
    attributes.push((semconv::SERVICE_NAME, service_name.into()));
    attributes.push((semconv::SERVICE_VERSION, env!("CARGO_PKG_VERSION").into()));
    let rank_number = rank.map_or(0, |r| r.rank);
    attributes.push((semconv::DL_RANK, rank_number.into()));
    attributes.push((
        semconv::DL_WORLD_SIZE,
        rank.and_then(|r| r.world_size).unwrap_or(1).into(),
    ));
    if let Some(local_rank) = rank.and_then(|r| r.local_rank) {
        attributes.push((semconv::DL_LOCAL_RANK, local_rank.into()));
    }
    attributes.push((semconv::NEMO_RUN_ID, run_id.clone().into()));
    let attempt = attempt_suffix(&env, &mut attributes);
    let attempt_id = format!("{run_id}{attempt}");
    attributes.push((
        semconv::SERVICE_INSTANCE_ID,
        format!("{run_id}-rank{rank_number}{attempt}").into(),
    ));
    if let Some(user) = env.trimmed(ENV_USER_ID) {
        attributes.push((semconv::NEMO_USER_ID, user.into()));
    }
    if let Some(entity) = env.get(ENV_WANDB_ENTITY) {
        attributes.push((semconv::WANDB_ENTITY, entity.into()));
    }
    if let Some(project) = env.get(ENV_WANDB_PROJECT) {
        attributes.push((semconv::WANDB_PROJECT, project.into()));
    }
    // `os.environ.get("DEPLOYMENT_ENV", os.environ.get("ENVIRONMENT", ""))`: a set but
    // empty DEPLOYMENT_ENV hides ENVIRONMENT.
    let deployment = env
        .raw(ENV_DEPLOYMENT_ENV)
        .or_else(|| env.raw(ENV_ENVIRONMENT))
        .filter(|v| !v.is_empty());
    if let Some(deployment) = deployment {
        attributes.push((semconv::DEPLOYMENT_ENVIRONMENT, deployment.into()));
    }

    // resources.local
    attributes.push((semconv::HOST_NAME, host_name(&env, view).into()));
    attributes.push((semconv::PROCESS_PID, info.pid.into()));
    if let Some(vpid) = view.namespace_pid {
        attributes.push((semconv::PROCESS_VPID, vpid.into()));
    }
    attributes.push((
        semconv::PROCESS_COMMAND_LINE,
        info.command_line.join(" ").into(),
    ));
    if let Some(count) = gpu_count(&env, view) {
        attributes.push((semconv::HOST_GPU_COUNT, count.into()));
    }

    // resources.slurm
    if let Some(job_id) = env.get(ENV_SLURM_JOB_ID) {
        attributes.push((semconv::SLURM_JOB_ID, job_id.into()));
        for (variable, name) in SLURM_ATTRIBUTES {
            if let Some(value) = env.get(variable)
                && !attributes.iter().any(|(k, _)| *k == name)
            {
                attributes.push((name, value.into()));
            }
        }
    }

    // resources.kubernetes, and what the pod's files say when the downward API does not.
    if env.get(ENV_KUBERNETES_SERVICE_HOST).is_some() || view.kubernetes_secrets {
        let mut k8s: Vec<(&'static str, AttrValue)> = Vec::new();
        for (variable, name) in K8S_ATTRIBUTES {
            if let Some(value) = env.get(variable)
                && !k8s.iter().any(|(k, _)| *k == name)
            {
                k8s.push((name, value.into()));
            }
        }
        if !k8s.iter().any(|(k, _)| *k == semconv::K8S_NAMESPACE_NAME)
            && let Some(namespace) = &view.service_account_namespace
        {
            k8s.push((semconv::K8S_NAMESPACE_NAME, namespace.clone().into()));
        }
        if !k8s.iter().any(|(k, _)| *k == semconv::K8S_POD_UID)
            && let Some(uid) = pod_uid_from_cgroup(&view.cgroup)
        {
            k8s.push((semconv::K8S_POD_UID, uid.into()));
        }
        attributes.extend(k8s);
    }

    let user_attributes = env
        .raw(ENV_RESOURCE_ATTRIBUTES)
        .map(|text| user_attributes(text, &attributes))
        .unwrap_or_default();
    TargetResource {
        attributes,
        run_id,
        attempt_id,
        rank,
        user_attributes,
    }
}

/// Which attempt of a restarted job this is: its counts as attributes, and the suffix
/// (`-requeue<n>`, `-restart<n>`) that a later attempt's instance and trace ids take.
fn attempt_suffix(env: &Environment, attributes: &mut Vec<(&'static str, AttrValue)>) -> String {
    let restart = env.number(ENV_TORCHELASTIC_RESTART_COUNT);
    let requeue = env.number(ENV_SLURM_RESTART_COUNT);
    if let Some(n) = restart {
        attributes.push((semconv::DL_RESTART_COUNT, n.into()));
    }
    if let Some(n) = requeue {
        attributes.push((semconv::SLURM_RESTART_COUNT, n.into()));
    }
    let mut suffix = String::new();
    if let Some(n) = requeue.filter(|n| *n > 0) {
        suffix.push_str(&format!("-requeue{n}"));
    }
    if let Some(n) = restart.filter(|n| *n > 0) {
        suffix.push_str(&format!("-restart{n}"));
    }
    suffix
}

/// `OTEL_RESOURCE_ATTRIBUTES` as the Python SDK's `OTELResourceDetector` reads it
/// (`key=value` pairs split at commas, trimmed, values percent-decoded, the last of a key
/// winning), less the keys Lens sets itself (`Resource.create` lets those win) and the
/// keys that look like secrets, whose values are never exported.
fn user_attributes(text: &str, own: &[(&'static str, AttrValue)]) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = Vec::new();
    for item in text.split(',') {
        let Some((key, value)) = item.split_once('=') else {
            continue;
        };
        let key = key.trim();
        if key.is_empty() || looks_secret(key) || own.iter().any(|(k, _)| *k == key) {
            continue;
        }
        let value = percent_decode(value.trim());
        match found.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => found.push((key.to_string(), value)),
        }
    }
    found
}

/// `%XX` escapes decoded (as Python's `urllib.parse.unquote`: bad escapes stay as they
/// are, invalid UTF-8 becomes U+FFFD).
fn percent_decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// [`detect`] for a running process: its `/proc/PID/environ`, `/proc/PID/root` and
/// `/proc/PID/cgroup`.
pub fn detect_pid(
    info: &ProcessInfo,
    fallback_run_id: &str,
    service_name: Option<&str>,
) -> TargetResource {
    detect_view(info, &info.view, fallback_run_id, service_name)
}

/// `NEMO_LENS_RUN_ID`, else `SLURM_JOB_ID` (as Lens), else `TORCHELASTIC_RUN_ID` (the
/// rendezvous id torchrun gives every worker of a job; its default `none`, used by
/// multi-node jobs without `--rdzv-id`, is the same for every job and is skipped), else
/// the fallback.
fn run_id(env: &Environment, fallback: &str) -> String {
    env.trimmed(ENV_RUN_ID)
        .or_else(|| env.get(ENV_SLURM_JOB_ID))
        .or_else(|| {
            env.trimmed(ENV_TORCHELASTIC_RUN_ID)
                .filter(|id| !id.eq_ignore_ascii_case("none"))
        })
        .unwrap_or(fallback)
        .to_string()
}

/// The name the target sees: its `HOSTNAME`, else its root's `/etc/hostname`, else this
/// machine's (same UTS namespace, or as good a guess as any).
fn host_name(env: &Environment, view: &TargetView) -> String {
    env.trimmed(ENV_HOSTNAME)
        .map(str::to_string)
        .or_else(|| view.hostname_file.clone())
        .unwrap_or_else(own_host_name)
}

/// This machine's host name (for lens-probe's own resource and as the last fallback).
pub fn own_host_name() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates unless it
    // truncates, and the last byte stays 0 either way.
    let status = unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len() - 1) };
    if status != 0 {
        return String::new();
    }
    let end = buffer.iter().position(|b| *b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

/// `resources.local._detect_gpu_count`: `CUDA_VISIBLE_DEVICES` when set (blank: 0, else
/// its comma-separated entries, as Python's `len(split(","))`); else the NVIDIA device
/// files the target can see (where Lens asks `nvidia-smi`); none: unknown.
fn gpu_count(env: &Environment, view: &TargetView) -> Option<i64> {
    if let Some(visible) = env.raw(ENV_CUDA_VISIBLE_DEVICES) {
        if visible.trim().is_empty() {
            return Some(0);
        }
        return Some(visible.split(',').count() as i64);
    }
    (view.nvidia_devices > 0).then_some(view.nvidia_devices as i64)
}

/// The pod UID in a kubelet cgroup path (`/proc/PID/cgroup`, v1 or v2): with the systemd
/// driver `…/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/…`, with
/// the cgroupfs driver `…/kubepods/burstable/pod<uid>/<container>`. Returned with dashes,
/// as the API server spells it.
pub fn pod_uid_from_cgroup(cgroup: &str) -> Option<String> {
    cgroup
        .lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .filter(|path| path.contains("kubepods"))
        .flat_map(|path| path.split('/'))
        .find_map(|segment| {
            let segment = segment.strip_suffix(".slice").unwrap_or(segment);
            // systemd: the last `-pod` of kubepods[-qos]-pod<uid>; cgroupfs: pod<uid>.
            let uid = match segment.rfind("-pod") {
                Some(at) if segment.starts_with("kubepods") => &segment[at + 4..],
                _ => segment.strip_prefix("pod")?,
            };
            let uid = uid.replace('_', "-");
            is_pod_uid(&uid).then_some(uid)
        })
}

/// A UUID (8-4-4-4-12 hex digits), or the 32 hex digits of a static pod's hash.
fn is_pod_uid(text: &str) -> bool {
    let hex = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_hexdigit());
    let parts: Vec<&str> = text.split('-').collect();
    match parts.as_slice() {
        [whole] => whole.len() == 32 && hex(whole),
        [a, b, c, d, e] => {
            [a.len(), b.len(), c.len(), d.len(), e.len()] == [8, 4, 4, 4, 12]
                && parts.iter().all(|p| hex(p))
        }
        _ => false,
    }
}

/// The trace id of a run: the MD5 of its run id. Every rank of a job, traced by however
/// many lens-probe instances on however many nodes, computes the same id from the same
/// run id, so all of the job's spans land in one trace without any coordination.
pub fn trace_id_for_run(run_id: &str) -> [u8; 16] {
    Md5::digest(run_id.as_bytes()).into()
}

/// A fresh run id for a job that names none: 12 lowercase hex digits, as Lens'
/// `uuid.uuid4().hex[:12]`. From `/dev/urandom`, else from std's randomly keyed hasher.
pub fn random_run_id() -> String {
    let mut bytes = [0u8; 6];
    let from_urandom = fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_ok();
    if !from_urandom {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            hasher.write_u128(now.as_nanos());
        }
        bytes.copy_from_slice(&hasher.finish().to_be_bytes()[..6]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A fresh directory standing for the target's root.
    struct Root(PathBuf);

    impl Root {
        fn new(name: &str) -> Root {
            let path = std::env::temp_dir()
                .join(format!("lens-probe-resource-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).unwrap();
            Root(path)
        }

        fn file(&self, relative: &str, text: &str) -> &Root {
            let path = self.0.join(relative);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
            self
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn info() -> ProcessInfo {
        ProcessInfo {
            pid: 4242,
            name: "python".into(),
            command_line: vec![
                "python".into(),
                "train.py".into(),
                "--lr".into(),
                "3e-4".into(),
            ],
            traced_from_start: true,
            rank: None,
            view: Default::default(),
        }
    }

    fn environment(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn detect_in(root: &Root, env: &[(&str, &str)], cgroup: &str) -> TargetResource {
        detect(
            &info(),
            &environment(env),
            &root.0,
            cgroup,
            "fallback0001",
            None,
        )
    }

    fn str_attr<'a>(resource: &'a TargetResource, key: &str) -> Option<&'a str> {
        match resource.attr(key)? {
            AttrValue::Str(s) => Some(s.as_str()),
            other => panic!("{key} is {other:?}, not a string"),
        }
    }

    fn int_attr(resource: &TargetResource, key: &str) -> Option<i64> {
        match resource.attr(key)? {
            AttrValue::Int(i) => Some(*i),
            other => panic!("{key} is {other:?}, not an integer"),
        }
    }

    fn has_prefix(resource: &TargetResource, prefix: &str) -> bool {
        resource
            .attributes
            .iter()
            .any(|(k, _)| k.starts_with(prefix))
    }

    #[test]
    fn a_plain_process_gets_lens_defaults() {
        let root = Root::new("plain");
        root.file("etc/hostname", "node-17\n");
        let r = detect_in(&root, &[], "0::/user.slice/session-1.scope\n");
        assert_eq!(r.run_id, "fallback0001");
        assert_eq!(r.rank, None);
        assert_eq!(str_attr(&r, semconv::SERVICE_NAME), Some("nemo"));
        assert_eq!(
            str_attr(&r, semconv::SERVICE_VERSION),
            Some(env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(int_attr(&r, semconv::DL_RANK), Some(0));
        assert_eq!(int_attr(&r, semconv::DL_WORLD_SIZE), Some(1));
        assert_eq!(r.attr(semconv::DL_LOCAL_RANK), None);
        assert_eq!(str_attr(&r, semconv::NEMO_RUN_ID), Some("fallback0001"));
        assert_eq!(
            str_attr(&r, semconv::SERVICE_INSTANCE_ID),
            Some("fallback0001-rank0")
        );
        assert_eq!(str_attr(&r, semconv::HOST_NAME), Some("node-17"));
        assert_eq!(int_attr(&r, semconv::PROCESS_PID), Some(4242));
        assert_eq!(
            str_attr(&r, semconv::PROCESS_COMMAND_LINE),
            Some("python train.py --lr 3e-4")
        );
        assert_eq!(r.attr(semconv::HOST_GPU_COUNT), None);
        assert_eq!(r.attr(semconv::NEMO_USER_ID), None);
        assert_eq!(r.attr(semconv::DEPLOYMENT_ENVIRONMENT), None);
        assert!(!has_prefix(&r, "slurm."));
        assert!(!has_prefix(&r, "k8s."));
        assert!(!has_prefix(&r, "wandb."));
    }

    #[test]
    fn service_name_target_first_then_lens_probe_then_nemo() {
        let root = Root::new("service");
        let env = environment(&[("OTEL_SERVICE_NAME", " trainer ")]);
        let r = detect(&info(), &env, &root.0, "", "x", Some("probe"));
        assert_eq!(str_attr(&r, semconv::SERVICE_NAME), Some("trainer"));
        let r = detect(&info(), &[], &root.0, "", "x", Some("probe"));
        assert_eq!(str_attr(&r, semconv::SERVICE_NAME), Some("probe"));
        let env = environment(&[("OTEL_SERVICE_NAME", "")]);
        let r = detect(&info(), &env, &root.0, "", "x", None);
        assert_eq!(str_attr(&r, semconv::SERVICE_NAME), Some("nemo"));
    }

    #[test]
    fn ranks_and_instance_id_come_from_the_launcher() {
        let root = Root::new("ranks");
        let r = detect_in(
            &root,
            &[
                ("RANK", "5"),
                ("WORLD_SIZE", "16"),
                ("LOCAL_RANK", "5"),
                ("NEMO_LENS_RUN_ID", "run-abc"),
            ],
            "",
        );
        assert_eq!(
            r.rank,
            Some(RankInfo {
                rank: 5,
                world_size: Some(16),
                local_rank: Some(5)
            })
        );
        assert_eq!(int_attr(&r, semconv::DL_RANK), Some(5));
        assert_eq!(int_attr(&r, semconv::DL_WORLD_SIZE), Some(16));
        assert_eq!(int_attr(&r, semconv::DL_LOCAL_RANK), Some(5));
        assert_eq!(
            str_attr(&r, semconv::SERVICE_INSTANCE_ID),
            Some("run-abc-rank5")
        );
    }

    #[test]
    fn each_attempt_of_a_restarted_job_is_an_instance_and_a_trace_of_its_own() {
        let root = Root::new("attempts");
        let job = [("RANK", "1"), ("TORCHELASTIC_RUN_ID", "rdzv-7")];
        let attempt = |extra: &[(&'static str, &'static str)]| {
            let env: Vec<(&str, &str)> = job.iter().chain(extra).copied().collect();
            detect_in(&root, &env, "")
        };
        // torchrun sets the count from the first attempt on (0): the first keeps the run's
        // own names, so a job that never restarts is named as before.
        let first = attempt(&[("TORCHELASTIC_RESTART_COUNT", "0")]);
        assert_eq!(first.attempt_id, "rdzv-7");
        assert_eq!(int_attr(&first, semconv::DL_RESTART_COUNT), Some(0));
        assert_eq!(
            str_attr(&first, semconv::SERVICE_INSTANCE_ID),
            Some("rdzv-7-rank1")
        );
        let second = attempt(&[("TORCHELASTIC_RESTART_COUNT", "1")]);
        assert_eq!(second.run_id, "rdzv-7");
        assert_eq!(second.attempt_id, "rdzv-7-restart1");
        assert_eq!(int_attr(&second, semconv::DL_RESTART_COUNT), Some(1));
        assert_eq!(
            str_attr(&second, semconv::SERVICE_INSTANCE_ID),
            Some("rdzv-7-rank1-restart1")
        );
        assert_ne!(
            trace_id_for_run(&first.attempt_id),
            trace_id_for_run(&second.attempt_id)
        );
        // A SLURM requeue, and a restart inside it.
        let requeued = attempt(&[
            ("SLURM_RESTART_COUNT", "2"),
            ("TORCHELASTIC_RESTART_COUNT", "1"),
        ]);
        assert_eq!(requeued.attempt_id, "rdzv-7-requeue2-restart1");
        assert_eq!(int_attr(&requeued, semconv::SLURM_RESTART_COUNT), Some(2));
        // Without either variable: no attribute, the run's names.
        let plain = attempt(&[]);
        assert_eq!(plain.attempt_id, "rdzv-7");
        assert_eq!(int_attr(&plain, semconv::DL_RESTART_COUNT), None);
    }

    #[test]
    fn run_id_precedence() {
        let root = Root::new("run-id");
        let all = [
            ("NEMO_LENS_RUN_ID", " explicit "),
            ("SLURM_JOB_ID", "123456"),
            ("TORCHELASTIC_RUN_ID", "rdzv-1"),
        ];
        assert_eq!(detect_in(&root, &all, "").run_id, "explicit");
        assert_eq!(detect_in(&root, &all[1..], "").run_id, "123456");
        assert_eq!(detect_in(&root, &all[2..], "").run_id, "rdzv-1");
        // Blank is unset; torchrun's default rendezvous id is no job's id.
        let r = detect_in(
            &root,
            &[("NEMO_LENS_RUN_ID", " "), ("TORCHELASTIC_RUN_ID", "none")],
            "",
        );
        assert_eq!(r.run_id, "fallback0001");
        assert_eq!(str_attr(&r, semconv::NEMO_RUN_ID), Some("fallback0001"));
    }

    #[test]
    fn slurm_attributes_as_lens() {
        let root = Root::new("slurm");
        let r = detect_in(
            &root,
            &[
                ("SLURM_JOB_ID", "98765"),
                ("SLURM_JOB_NAME", "pretrain"),
                ("SLURM_NODELIST", "gpu[01-04]"),
                ("SLURM_NNODES", "4"),
                ("SLURM_NTASKS", "32"),
                ("SLURM_PARTITION", "batch"),
                ("SLURM_CLUSTER_NAME", ""),
                ("SLURM_PROCID", "9"),
                ("SLURM_LOCALID", "1"),
            ],
            "",
        );
        let slurm: Vec<(&str, &AttrValue)> = r
            .attributes
            .iter()
            .filter(|(k, _)| k.starts_with("slurm."))
            .map(|(k, v)| (*k, v))
            .collect();
        assert_eq!(
            slurm,
            [
                (semconv::SLURM_JOB_ID, &AttrValue::from("98765")),
                (semconv::SLURM_JOB_NAME, &AttrValue::from("pretrain")),
                (semconv::SLURM_NODELIST, &AttrValue::from("gpu[01-04]")),
                (semconv::SLURM_NNODES, &AttrValue::from("4")),
                (semconv::SLURM_NTASKS, &AttrValue::from("32")),
                (semconv::SLURM_PARTITION, &AttrValue::from("batch")),
            ]
        );
        // A real task: the partition is SLURM_JOB_PARTITION's.
        let task = detect_in(
            &root,
            &[
                ("SLURM_JOB_ID", "7"),
                ("SLURM_JOB_PARTITION", "gpu"),
                ("SLURM_STEP_ID", "2"),
            ],
            "",
        );
        assert_eq!(str_attr(&task, semconv::SLURM_PARTITION), Some("gpu"));
        assert_eq!(str_attr(&task, semconv::SLURM_STEP_ID), Some("2"));
        // Rank from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; the run is the job.
        assert_eq!(int_attr(&r, semconv::DL_RANK), Some(9));
        assert_eq!(int_attr(&r, semconv::DL_WORLD_SIZE), Some(32));
        assert_eq!(int_attr(&r, semconv::DL_LOCAL_RANK), Some(1));
        assert_eq!(
            str_attr(&r, semconv::SERVICE_INSTANCE_ID),
            Some("98765-rank9")
        );
        // No job id, no slurm.*.
        let r = detect_in(&root, &[("SLURM_JOB_ID", ""), ("SLURM_JOB_NAME", "x")], "");
        assert!(!has_prefix(&r, "slurm."));
    }

    #[test]
    fn kubernetes_downward_api_as_lens() {
        let root = Root::new("k8s-env");
        let r = detect_in(
            &root,
            &[
                ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
                ("K8S_NAMESPACE", "training"),
                ("K8S_POD_NAME", "pretrain-worker-3"),
                ("K8S_POD_UID", "0e3a4b5c-1111-2222-3333-444455556666"),
                ("K8S_NODE_NAME", "gpu-node-7"),
                ("K8S_CONTAINER_NAME", "trainer"),
                ("K8S_JOB_NAME", "pretrain"),
                ("HOSTNAME", "pretrain-worker-3-host"),
            ],
            "0::/kubepods/burstable/pod11111111-2222-3333-4444-555555555555/abc\n",
        );
        assert_eq!(str_attr(&r, semconv::K8S_NAMESPACE_NAME), Some("training"));
        // K8S_POD_NAME wins over the HOSTNAME fallback.
        assert_eq!(
            str_attr(&r, semconv::K8S_POD_NAME),
            Some("pretrain-worker-3")
        );
        // The downward API wins over the cgroup.
        assert_eq!(
            str_attr(&r, semconv::K8S_POD_UID),
            Some("0e3a4b5c-1111-2222-3333-444455556666")
        );
        assert_eq!(str_attr(&r, semconv::K8S_NODE_NAME), Some("gpu-node-7"));
        assert_eq!(str_attr(&r, semconv::K8S_CONTAINER_NAME), Some("trainer"));
        assert_eq!(str_attr(&r, semconv::K8S_JOB_NAME), Some("pretrain"));
        assert_eq!(
            str_attr(&r, semconv::HOST_NAME),
            Some("pretrain-worker-3-host")
        );
        let pod_names = r
            .attributes
            .iter()
            .filter(|(k, _)| *k == semconv::K8S_POD_NAME)
            .count();
        assert_eq!(pod_names, 1);

        // HOSTNAME is the pod name when K8S_POD_NAME is not set.
        let r = detect_in(
            &root,
            &[
                ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
                ("HOSTNAME", "pod-x"),
            ],
            "",
        );
        assert_eq!(str_attr(&r, semconv::K8S_POD_NAME), Some("pod-x"));

        // Outside Kubernetes the K8S_* variables mean nothing.
        let r = detect_in(&root, &[("K8S_NAMESPACE", "training")], "");
        assert!(!has_prefix(&r, "k8s."));
    }

    #[test]
    fn kubernetes_namespace_file_and_cgroup_uid_systemd_driver() {
        let root = Root::new("k8s-systemd");
        root.file(
            "var/run/secrets/kubernetes.io/serviceaccount/namespace",
            "research\n",
        );
        let cgroup = "0::/kubepods.slice/kubepods-burstable.slice/\
                      kubepods-burstable-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/\
                      cri-containerd-0123456789abcdef.scope\n";
        // No KUBERNETES_SERVICE_HOST: the service account directory says Kubernetes.
        let r = detect_in(&root, &[], cgroup);
        assert_eq!(str_attr(&r, semconv::K8S_NAMESPACE_NAME), Some("research"));
        assert_eq!(
            str_attr(&r, semconv::K8S_POD_UID),
            Some("1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d")
        );
        // The downward API's namespace wins over the file.
        let r = detect_in(&root, &[("K8S_NAMESPACE", "training")], cgroup);
        assert_eq!(str_attr(&r, semconv::K8S_NAMESPACE_NAME), Some("training"));
    }

    #[test]
    fn kubernetes_cgroup_uid_cgroupfs_driver_and_v1() {
        let root = Root::new("k8s-cgroupfs");
        let env = [("KUBERNETES_SERVICE_HOST", "10.0.0.1")];
        let cgroup = "12:memory:/kubepods/burstable/pod0e3a4b5c-1111-2222-3333-444455556666/\
                      0123456789abcdef0123456789abcdef\n\
                      11:cpu,cpuacct:/kubepods/burstable/pod0e3a4b5c-1111-2222-3333-444455556666/\
                      0123456789abcdef0123456789abcdef\n";
        let r = detect_in(&root, &env, cgroup);
        assert_eq!(
            str_attr(&r, semconv::K8S_POD_UID),
            Some("0e3a4b5c-1111-2222-3333-444455556666")
        );
        // No namespace file, no namespace variable: no namespace.
        assert_eq!(r.attr(semconv::K8S_NAMESPACE_NAME), None);
    }

    #[test]
    fn pod_uids_in_cgroup_paths() {
        let uid = "1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d";
        for (cgroup, want) in [
            // Guaranteed QoS, systemd driver: no QoS slice.
            (
                "0::/kubepods.slice/kubepods-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/x.scope",
                Some(uid),
            ),
            (
                "0::/kubepods.slice/kubepods-besteffort.slice/\
                 kubepods-besteffort-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice",
                Some(uid),
            ),
            // Guaranteed QoS, cgroupfs driver.
            (
                "0::/kubepods/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d/abc",
                Some(uid),
            ),
            // A static pod: 32 hex digits.
            (
                "0::/kubepods/burstable/pod0123456789abcdef0123456789abcdef/abc",
                Some("0123456789abcdef0123456789abcdef"),
            ),
            // Seen from a nested cgroup namespace.
            (
                "0::/../../kubepods-burstable-pod1a2b3c4d_5e6f_7a8b_9c0d_1e2f3a4b5c6d.slice/x",
                Some(uid),
            ),
            ("0::/", None),
            ("0::/system.slice/docker-abc.scope", None),
            (
                "0::/user.slice/pod1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d",
                None,
            ),
            ("0::/kubepods/burstable/podnot-a-uid/abc", None),
            ("", None),
        ] {
            assert_eq!(pod_uid_from_cgroup(cgroup).as_deref(), want, "{cgroup}");
        }
    }

    #[test]
    fn gpu_count_rules() {
        let root = Root::new("gpus");
        // No CUDA_VISIBLE_DEVICES, no devices: unknown.
        assert_eq!(
            detect_in(&root, &[], "").attr(semconv::HOST_GPU_COUNT),
            None
        );
        for device in [
            "nvidia0",
            "nvidia1",
            "nvidia7",
            "nvidiactl",
            "nvidia-uvm",
            "nvidia-caps/x",
        ] {
            root.file(&format!("dev/{device}"), "");
        }
        // The device files the target sees.
        assert_eq!(
            int_attr(&detect_in(&root, &[], ""), semconv::HOST_GPU_COUNT),
            Some(3)
        );
        // CUDA_VISIBLE_DEVICES wins, entries counted as Python's split(",").
        for (visible, want) in [
            ("0,1", 2),
            ("3", 1),
            ("", 0),
            (" ", 0),
            ("0,1,", 3),
            ("GPU-a,GPU-b", 2),
        ] {
            let r = detect_in(&root, &[("CUDA_VISIBLE_DEVICES", visible)], "");
            assert_eq!(
                int_attr(&r, semconv::HOST_GPU_COUNT),
                Some(want),
                "{visible:?}"
            );
        }
    }

    #[test]
    fn host_name_from_env_then_root_then_this_machine() {
        let root = Root::new("hostname");
        let r = detect_in(&root, &[], "");
        assert_eq!(
            str_attr(&r, semconv::HOST_NAME),
            Some(own_host_name().as_str())
        );
        assert!(!own_host_name().is_empty());
        root.file("etc/hostname", "from-file\n");
        let r = detect_in(&root, &[], "");
        assert_eq!(str_attr(&r, semconv::HOST_NAME), Some("from-file"));
        let r = detect_in(&root, &[("HOSTNAME", "from-env")], "");
        assert_eq!(str_attr(&r, semconv::HOST_NAME), Some("from-env"));
    }

    #[test]
    fn user_wandb_and_deployment_as_lens() {
        let root = Root::new("labels");
        let r = detect_in(
            &root,
            &[
                ("NEMO_LENS_USER_ID", "alice"),
                ("WANDB_ENTITY", "nvidia"),
                ("WANDB_PROJECT", "llm"),
                ("ENVIRONMENT", "staging"),
            ],
            "",
        );
        assert_eq!(str_attr(&r, semconv::NEMO_USER_ID), Some("alice"));
        assert_eq!(str_attr(&r, semconv::WANDB_ENTITY), Some("nvidia"));
        assert_eq!(str_attr(&r, semconv::WANDB_PROJECT), Some("llm"));
        assert_eq!(
            str_attr(&r, semconv::DEPLOYMENT_ENVIRONMENT),
            Some("staging")
        );
        let r = detect_in(
            &root,
            &[("DEPLOYMENT_ENV", "prod"), ("ENVIRONMENT", "staging")],
            "",
        );
        assert_eq!(str_attr(&r, semconv::DEPLOYMENT_ENVIRONMENT), Some("prod"));
        // Set but empty, DEPLOYMENT_ENV hides ENVIRONMENT (Python's nested .get).
        let r = detect_in(
            &root,
            &[("DEPLOYMENT_ENV", ""), ("ENVIRONMENT", "staging")],
            "",
        );
        assert_eq!(r.attr(semconv::DEPLOYMENT_ENVIRONMENT), None);
    }

    #[test]
    fn resource_values_are_unquoted_as_python_does() {
        // Good escapes decoded, a bad one left as it is, invalid UTF-8 replaced.
        let found = user_attributes("a=x%20y%2Cz, b=50%, c=%zz, d=%e9", &[]);
        let value = |key: &str| {
            found
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(value("a"), Some("x y,z"));
        assert_eq!(value("b"), Some("50%"));
        assert_eq!(value("c"), Some("%zz"));
        assert_eq!(value("d"), Some("\u{FFFD}"));
    }

    #[test]
    fn otel_resource_attributes_of_the_target_without_secrets() {
        let root = Root::new("otel-attrs");
        let r = detect_in(
            &root,
            &[
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    " team = ml ,db.password=hunter2,api_key=abc,note=a%2Cb%20c,\
                     dl.rank=99,broken,=x,team=ml2,cost.center=%zz",
                ),
                ("RANK", "1"),
            ],
            "",
        );
        assert_eq!(
            r.user_attributes,
            [
                ("team".to_string(), "ml2".to_string()),
                ("note".to_string(), "a,b c".to_string()),
                ("cost.center".to_string(), "%zz".to_string()),
            ]
        );
        // Lens' own attributes win.
        assert_eq!(int_attr(&r, semconv::DL_RANK), Some(1));
        assert!(detect_in(&root, &[], "").user_attributes.is_empty());
    }

    #[test]
    fn the_resource_is_made_of_allow_listed_variables_only() {
        // Every variable the resource reads is on the list (ENV_* and the tables).
        let read = [
            ENV_SERVICE_NAME,
            ENV_RESOURCE_ATTRIBUTES,
            ENV_RUN_ID,
            ENV_USER_ID,
            ENV_TORCHELASTIC_RUN_ID,
            ENV_WANDB_ENTITY,
            ENV_WANDB_PROJECT,
            ENV_DEPLOYMENT_ENV,
            ENV_ENVIRONMENT,
            ENV_HOSTNAME,
            ENV_CUDA_VISIBLE_DEVICES,
            ENV_SLURM_JOB_ID,
            ENV_KUBERNETES_SERVICE_HOST,
        ];
        let tables = SLURM_ATTRIBUTES.iter().chain(K8S_ATTRIBUTES.iter());
        for variable in read.into_iter().chain(tables.map(|(v, _)| *v)) {
            assert!(
                crate::sys::target::ENVIRONMENT_ALLOW_LIST.contains(&variable),
                "{variable} is read but not allow-listed"
            );
        }
    }

    #[test]
    fn detect_pid_reads_a_real_process() {
        let me = ProcessInfo::read(std::process::id()).unwrap();
        let r = detect_pid(&me, "self", None);
        assert_eq!(int_attr(&r, semconv::PROCESS_PID), Some(i64::from(me.pid)));
        assert!(str_attr(&r, semconv::HOST_NAME).is_some_and(|h| !h.is_empty()));
    }

    #[test]
    fn every_rank_of_a_run_shares_its_trace_id() {
        // python3 -c "import hashlib; print(hashlib.md5(b'abc123').hexdigest())"
        let expected = [
            0xe9, 0x9a, 0x18, 0xc4, 0x28, 0xcb, 0x38, 0xd5, 0xf2, 0x60, 0x85, 0x36, 0x78, 0x92,
            0x2e, 0x03,
        ];
        assert_eq!(trace_id_for_run("abc123"), expected);
        assert_ne!(trace_id_for_run("abc123"), trace_id_for_run("abc124"));
    }

    #[test]
    fn random_run_ids_are_12_hex_digits() {
        let a = random_run_id();
        let b = random_run_id();
        assert_eq!(a.len(), 12);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
    }
}
