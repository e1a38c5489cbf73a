//! The deployment files: `observability/k8s/` (valid against the Kubernetes schemas, and
//! the DaemonSet's security posture as documented) and `observability/slurm/` (the
//! prolog starts a node-wide lens-probe for one job, the epilog stops it after a flush).
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use lens_tests::otlp_file_spans as file_spans;
use serde_json::Value;

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// The oldest Kubernetes the manifests are for: `securityContext.appArmorProfile`
/// exists from 1.30.
const OLDEST_KUBERNETES: &str = "1.30.0";

/// The capabilities the DaemonSet adds, in the order daemonset.yaml and docs/deploy.md
/// give them, with their numbers (linux/capability.h).
const CAPABILITIES: [(&str, u32); 5] = [
    ("BPF", 39),
    ("PERFMON", 38),
    ("SYS_ADMIN", 21),
    ("SYS_PTRACE", 19),
    ("DAC_READ_SEARCH", 2),
];

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative)
}

fn k8s_dir() -> PathBuf {
    repo_path("observability/k8s")
}

/// The `.yaml` files of observability/k8s, sorted by name.
fn k8s_files() -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(k8s_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    names.sort();
    names
}

/// The documents of a YAML file, as JSON values (serde_yaml_ng).
fn parse_yaml(text: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|document| Value::deserialize(document).expect("valid YAML"))
        .filter(|document| !document.is_null())
        .collect()
}

fn k8s_resource(file: &str) -> Value {
    let text = fs::read_to_string(k8s_dir().join(file)).unwrap();
    let mut documents = parse_yaml(&text);
    assert_eq!(documents.len(), 1, "{file}: one resource");
    documents.remove(0)
}

fn strings(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {value}"))
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect()
}

#[test]
fn kubernetes_manifests_validate_against_the_schemas() {
    let name = "kubernetes_manifests_validate_against_the_schemas";
    let Some(validator) = lens_tests::kubernetes_validate(name) else {
        return;
    };
    let files = k8s_files();
    let (kustomization, manifests): (Vec<String>, Vec<String>) = files
        .iter()
        .cloned()
        .partition(|f| f == "kustomization.yaml");
    assert_eq!(kustomization.len(), 1, "{files:?}");
    // The kustomization (no Kubernetes schema) lists every other manifest, which exist.
    let kustomization = k8s_resource("kustomization.yaml");
    assert_eq!(kustomization["kind"], "Kustomization");
    let mut listed = strings(&kustomization["resources"]);
    listed.sort_unstable();
    assert_eq!(listed, manifests, "kustomization.yaml resources");

    let versions = [OLDEST_KUBERNETES, validator.version.as_str()];
    let mut command = validator.command();
    command.arg("--strict");
    for version in versions {
        command.args(["-k", version]);
    }
    let output = command
        .args(&manifests)
        .current_dir(k8s_dir())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "kubernetes-validate failed:\n{stdout}{stderr}"
    );
    // Every resource had a schema (no WARN) and passed, against both versions.
    assert!(
        !stdout.contains("WARN") && !stdout.contains("ERROR"),
        "{stdout}"
    );
    for file in &manifests {
        for version in versions {
            let minor: String = version.split('.').take(2).collect::<Vec<_>>().join(".");
            assert!(
                stdout
                    .lines()
                    .any(|l| l.starts_with(&format!("INFO {file} passed"))
                        && l.ends_with(&format!("against version {minor}"))),
                "{file} not validated against {minor}:\n{stdout}"
            );
        }
    }

    // Strict mode really rejects what Kubernetes does not know (a misspelt field).
    let bad = std::env::temp_dir().join(format!("lens-deploy-bad-{}.yaml", std::process::id()));
    let daemonset = fs::read_to_string(k8s_dir().join("daemonset.yaml")).unwrap();
    fs::write(&bad, daemonset.replace("hostPID:", "hostPid:")).unwrap();
    let output = validator
        .command()
        .args(["--strict", "-k", OLDEST_KUBERNETES])
        .arg(&bad)
        .output()
        .unwrap();
    let _ = fs::remove_file(&bad);
    assert!(
        !output.status.success(),
        "a misspelt field validated: {}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[test]
fn the_daemonset_has_the_documented_security_posture() {
    let daemonset = k8s_resource("daemonset.yaml");
    let configmap = k8s_resource("configmap.yaml");
    let namespace = k8s_resource("namespace.yaml");
    let account = k8s_resource("serviceaccount.yaml");
    assert_eq!(daemonset["kind"], "DaemonSet");
    let ns = namespace["metadata"]["name"].as_str().unwrap();
    for resource in [&daemonset, &configmap, &account] {
        assert_eq!(resource["metadata"]["namespace"], ns);
    }
    // hostPID and added capabilities are admitted only at the privileged level.
    assert_eq!(
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "privileged"
    );

    let pod = &daemonset["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    assert_eq!(pod["hostNetwork"], Value::Null);
    assert_eq!(pod["serviceAccountName"], account["metadata"]["name"]);
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["nodeSelector"]["nvidia.com/gpu.present"], "true");
    assert!(
        pod["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == "nvidia.com/gpu"),
        "{pod}"
    );
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let container = &containers[0];
    assert_eq!(container["image"], "ghcr.io/example/lens-probe:0.1.0");

    let security = &container["securityContext"];
    assert_eq!(security["privileged"], false);
    assert_eq!(security["runAsUser"], 0);
    // The API server refuses allowPrivilegeEscalation: false with SYS_ADMIN.
    assert_ne!(security["allowPrivilegeEscalation"], false);
    assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"]);
    let added = strings(&security["capabilities"]["add"]);
    let documented: Vec<&str> = CAPABILITIES.iter().map(|(name, _)| *name).collect();
    assert_eq!(added, documented, "capabilities.add");
    // What lens-probe checks at start is among them.
    let cap_eff: u64 = CAPABILITIES.iter().map(|(_, bit)| 1u64 << bit).sum();
    let status = format!("CapEff:\t{cap_eff:016x}\n");
    assert!(
        lens_probe::sys::privileges::missing_capabilities(&status).is_empty(),
        "{:?}",
        lens_probe::sys::privileges::missing_capabilities(&status)
    );
    // Each one is explained where it is granted and in the deployment guide.
    let manifest_text = fs::read_to_string(k8s_dir().join("daemonset.yaml")).unwrap();
    let guide = fs::read_to_string(repo_path("docs/deploy.md")).unwrap();
    for name in documented {
        let cap = format!("CAP_{name}");
        assert!(
            manifest_text.contains(&cap),
            "daemonset.yaml does not explain {cap}"
        );
        assert!(
            guide.contains(&cap),
            "docs/deploy.md does not explain {cap}"
        );
    }

    // lens-probe --node; every $(VAR) of the arguments is a ConfigMap key (or the kubelet
    // would pass it on literally).
    assert_eq!(
        strings(&container["command"]),
        ["/usr/local/bin/lens-probe"]
    );
    let args = strings(&container["args"]);
    assert_eq!(args[0], "--node");
    let data = &configmap["data"];
    for arg in &args {
        if let Some(var) = arg.strip_prefix("$(").and_then(|a| a.strip_suffix(')')) {
            assert!(data.get(var).is_some(), "{var} is not in the ConfigMap");
        }
    }
    assert_eq!(
        container["envFrom"][0]["configMapRef"]["name"],
        configmap["metadata"]["name"]
    );
    let node_name = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .expect("NODE_NAME");
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    for (key, value) in [
        ("NEMO_LENS_SPAN_GROUPS", "per_step"),
        ("NEMO_LENS_EXPORT_STRATEGY", "all_ranks"),
        ("NEMO_LENS_EXPORTER", "otlp"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://otel-collector.observability.svc:4317",
        ),
    ] {
        assert_eq!(data[key], value, "{key}");
    }
    assert!(
        data["OTEL_METRIC_EXPORT_INTERVAL"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .is_ok()
    );

    // Only the kernel's BTF is mounted, read-only; nothing else from the host.
    let mounts = container["volumeMounts"].as_array().unwrap();
    assert_eq!(mounts.len(), 2, "{mounts:?}");
    assert_eq!(mounts[0]["mountPath"], "/sys/kernel/btf");
    assert_eq!(mounts[0]["readOnly"], true);
    let volumes = pod["volumes"].as_array().unwrap();
    assert_eq!(volumes.len(), 2, "{volumes:?}");
    assert_eq!(volumes[0]["hostPath"]["path"], "/sys/kernel/btf");
    assert_eq!(volumes[0]["name"], mounts[0]["name"]);
    // The timeline (commented out in the ConfigMap) goes to a writable host directory:
    // the root filesystem is read-only.
    assert_eq!(mounts[1]["mountPath"], "/var/log/lens-probe");
    assert_ne!(mounts[1]["readOnly"], true);
    assert_eq!(volumes[1]["name"], mounts[1]["name"]);
    assert_eq!(volumes[1]["hostPath"]["path"], "/var/log/lens-probe");
    let configmap_text = fs::read_to_string(k8s_dir().join("configmap.yaml")).unwrap();
    assert!(
        configmap_text
            .contains("# LENS_PROBE_PERFETTO: /var/log/lens-probe/timeline.perfetto-trace"),
        "the ConfigMap shows where the timeline goes"
    );
    let limits = &container["resources"]["limits"];
    assert!(
        limits["memory"].is_string() && limits["cpu"].is_string(),
        "{limits}"
    );
}

// ---- SLURM

fn slurm_script(name: &str) -> PathBuf {
    repo_path("observability/slurm").join(name)
}

/// The state letter of /proc/PID/stat (`Z`: exited, unreaped), None when gone.
fn process_state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

fn running(pid: u32) -> bool {
    process_state(pid).is_some_and(|s| s != 'Z')
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified`
/// on a hybrid host), when this process may create cgroups in it.
fn writable_cgroup2_root() -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let root = mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split_whitespace().nth(4)?;
        (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
    })?;
    let probe = root.join(format!("lens-deploy-probe-{}", std::process::id()));
    fs::create_dir(&probe).ok()?;
    let usable = probe.join("cgroup.procs").exists();
    let _ = fs::remove_dir(&probe);
    usable.then_some(root)
}

/// Cleans up whatever the SLURM test leaves if it fails half-way: the lens-probe it
/// started (killed), the job's cgroup, the temporary directory.
struct SlurmScratch {
    dir: PathBuf,
    job: String,
    cgroup: Option<PathBuf>,
}

impl Drop for SlurmScratch {
    fn drop(&mut self) {
        let pid_file = self.dir.join("run").join(format!("{}.pid", self.job));
        if let Some(pid) = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
        {
            let ours = fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c).contains(&format!("SLURM_JOB_ID={}", self.job))
                })
                .unwrap_or(false);
            if ours && running(pid) {
                // SAFETY: plain kill(2) of the lens-probe this test started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
        if let Some(cgroup) = &self.cgroup {
            let _ = fs::remove_dir(cgroup);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The fake trainer as one rank of SLURM job `job`, in `cgroup` when given (moved there
/// by a shell before it execs the trainer, as slurmstepd would).
fn start_trainer(job: &str, cgroup: Option<&Path>) -> std::process::Child {
    let trainer = lens_tests::torch_trainer();
    let mut command = match cgroup {
        Some(cgroup) => {
            let mut c = Command::new("sh");
            c.args(["-c", "echo $$ > \"$0\" && exec \"$@\""])
                .arg(cgroup.join("cgroup.procs"))
                .arg(&trainer);
            c
        }
        None => Command::new(&trainer),
    };
    command
        .args(["2", "1", "0", "0"])
        .env("TRAINER_INIT_MS", "700")
        .env("SLURM_JOB_ID", job)
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "1")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("NEMO_LENS_RUN_ID")
        .env_remove("TORCHELASTIC_RUN_ID")
        .stdout(Stdio::null());
    command.spawn().unwrap()
}

/// The prolog or epilog, as slurmd runs it: root, SLURM_JOB_ID, no lens-probe settings
/// inherited from this process.
fn run_slurm_script(name: &str, job: &str, dir: &Path) -> (std::process::Output, Duration) {
    let mut command = Command::new(slurm_script(name));
    for (key, _) in std::env::vars() {
        if key.starts_with("NEMO_LENS_")
            || key.starts_with("OTEL_")
            || key.starts_with("LENS_PROBE_")
        {
            command.env_remove(key);
        }
    }
    command
        .env("SLURM_JOB_ID", job)
        .env("LENS_PROBE_BIN", LENS_PROBE)
        .env("LENS_PROBE_RUN_DIR", dir.join("run"))
        .env("LENS_PROBE_LOG_DIR", dir.join("log"))
        .env("LENS_PROBE_ENV_FILE", dir.join("lens-probe.env"))
        .stdin(Stdio::null());
    let start = Instant::now();
    let output = command.output().unwrap();
    (output, start.elapsed())
}

fn attribute(resource: &BTreeMap<String, Value>, key: &str) -> Option<String> {
    let value = resource.get(key)?;
    value["stringValue"]
        .as_str()
        .or_else(|| value["intValue"].as_str())
        .map(str::to_string)
}

#[test]
fn slurm_prolog_and_epilog_trace_exactly_the_job() {
    let name = "slurm_prolog_and_epilog_trace_exactly_the_job";
    if !lens_tests::require_bpf(name) {
        return;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let job = format!("7{}{:03}", std::process::id(), nanos % 1000);
    // Its id starts with this job's: an exact match is needed to leave it alone.
    let other_job = format!("{job}9");
    let dir = std::env::temp_dir().join(format!("lens-deploy-slurm-{job}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let mut scratch = SlurmScratch {
        dir: dir.clone(),
        job: job.clone(),
        cgroup: None,
    };
    fs::write(
        dir.join("lens-probe.env"),
        format!(
            "# as /etc/lens-probe/lens-probe.env\n\
             NEMO_LENS_EXPORTER=file\n\
             LENS_PROBE_EXPORT_FILE={}/spans-%j.jsonl\n\
             NEMO_LENS_SPAN_GROUPS=per_step\n\
             export NEMO_LENS_EXPORT_STRATEGY=\"all_ranks\"\n",
            dir.display()
        ),
    )
    .unwrap();
    let export_file = dir.join(format!("spans-{job}.jsonl"));
    let pid_file = dir.join("run").join(format!("{job}.pid"));
    let log_file = dir.join("log").join(format!("{job}.log"));
    let log = || fs::read_to_string(&log_file).unwrap_or_default();

    // Job start: the prolog returns at once, lens-probe runs on, detached.
    let (output, took) = run_slurm_script("lens-probe-prolog.sh", &job, &dir);
    assert!(
        output.status.success(),
        "prolog: {:?}\n{}\nlog:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        log()
    );
    assert!(took < Duration::from_secs(12), "prolog took {took:?}");
    wait_for("the pid file", Duration::from_secs(10), || {
        pid_file.exists()
    });
    let pid: u32 = fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(running(pid), "lens-probe {pid} is not running:\n{}", log());
    wait_for("node mode to watch", Duration::from_secs(15), || {
        log().contains("watching for new ones")
    });

    // The job's rank in the job's cgroup (like slurmstepd), and another job's.
    let cgroup = writable_cgroup2_root().map(|root| root.join(format!("lens-test-job_{job}")));
    if let Some(cgroup) = &cgroup {
        fs::create_dir(cgroup).unwrap();
        scratch.cgroup = Some(cgroup.clone());
    } else {
        eprintln!("{name}: no writable cgroup v2 hierarchy: the trainer stays in this cgroup");
    }
    let ours = start_trainer(&job, cgroup.as_deref());
    let theirs = start_trainer(&other_job, None);
    if let Some(cgroup) = &cgroup {
        let procs = cgroup.join("cgroup.procs");
        wait_for("the trainer in its cgroup", Duration::from_secs(5), || {
            fs::read_to_string(&procs).is_ok_and(|p| p.contains(&ours.id().to_string()))
        });
    }
    for mut child in [ours, theirs] {
        assert!(child.wait().unwrap().success());
    }
    // Let lens-probe see the exit (the job span then ends normally).
    std::thread::sleep(Duration::from_millis(500));

    // Job end: SIGTERM, flush, exit, pid file removed.
    let (output, took) = run_slurm_script("lens-probe-epilog.sh", &job, &dir);
    let log_text = log();
    assert!(
        output.status.success(),
        "epilog: {:?}\n{}\nlog:\n{log_text}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        took < Duration::from_secs(30),
        "epilog took {took:?}:\n{log_text}"
    );
    assert!(!pid_file.exists(), "the pid file is left");
    assert!(!running(pid), "lens-probe {pid} still runs:\n{log_text}");
    assert!(
        log_text.contains(&format!("lens-probe (pid {pid}) stopped")),
        "{log_text}"
    );
    assert!(log_text.contains("spans exported to"), "{log_text}");

    let spans = file_spans(&export_file);
    let job_of = |resource: &BTreeMap<String, Value>| attribute(resource, "slurm.job.id");
    let jobs: Vec<_> = spans
        .iter()
        .filter(|(_, s)| s["name"] == "train.job")
        .collect();
    assert_eq!(jobs.len(), 1, "one traced process:\n{log_text}");
    assert_eq!(job_of(&jobs[0].0).as_deref(), Some(job.as_str()));
    assert_eq!(attribute(&jobs[0].0, "dl.rank").as_deref(), Some("0"));
    let steps = spans
        .iter()
        .filter(|(r, s)| s["name"] == "train.step" && job_of(r).as_deref() == Some(&job))
        .count();
    assert_eq!(steps, 2, "{log_text}");
    for (resource, span) in &spans {
        assert_eq!(
            job_of(resource).as_deref(),
            Some(job.as_str()),
            "a span of another process: {span}"
        );
    }

    if let Some(cgroup) = scratch.cgroup.take() {
        fs::remove_dir(&cgroup).unwrap();
    }
}
