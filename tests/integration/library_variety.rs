//! Kernel and library variety (issue 7, item 6): libraries without the symbol, stripped,
//! with versioned symbols, aliases, mapped twice; a kernel without uprobes.
//!
//! Each case is a variant of the fake libraries (`tests/fixtures/build.sh`, under
//! `variants/`) driven by `variety_caller`, which opens libraries by path and calls what
//! each defines a known number of times (see tests/README.md). What is asserted is what a
//! user checks: the per-probe report (which probes attached, which did not and why, in
//! the attacher's outcomes or as the one warning line the CLI prints) and exact counts.
use std::{
    collections::BTreeMap,
    ffi::{CString, OsString},
    io::{BufRead, BufReader, Write},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::Duration,
};

use lens_common::ProbeId;
use lens_probe::{
    events::{PhaseSignal, ProbeEvent},
    probes::attach::{ProbeOutcome, ProbeScope},
    session::{RunReport, Session, TraceOptions},
    sink::EventLog,
    sys::{library::LibraryKind, target::ExitStatus},
};

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// How many times `variety_caller` calls each function.
const CALLS: u64 = 3;

fn variety_caller() -> PathBuf {
    lens_tests::fixtures_dir().join("variety_caller")
}

/// A library variant: `variants/NAME` under the fixtures.
fn variant(name: &str) -> PathBuf {
    lens_tests::fixtures_dir().join("variants").join(name)
}

fn options() -> TraceOptions {
    TraceOptions {
        span_groups: "per_step".parse().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    }
}

/// `env VARS… variety_caller CALLS SPECS…`, with 1 ms fake syncs.
fn caller_argv(vars: &[&str], specs: &[&Path]) -> Vec<OsString> {
    let mut argv: Vec<OsString> = vec!["env".into(), "LENS_FAKE_SYNC_MS=1".into()];
    argv.extend(vars.iter().map(OsString::from));
    argv.push(variety_caller().into());
    argv.push(CALLS.to_string().into());
    argv.extend(specs.iter().map(|spec| spec.as_os_str().to_owned()));
    argv
}

/// Runs `argv` under a session of its own (`per_step`) to its end.
fn trace_exec(argv: &[OsString]) -> (Session, EventLog, RunReport) {
    let mut session = Session::new(options()).unwrap();
    session.exec(argv).unwrap();
    let mut log = EventLog::default();
    let report = session
        .run_blocking(&mut log, Some(Duration::from_secs(60)))
        .unwrap();
    assert_eq!(report.child_exit, Some(ExitStatus::Exited(0)), "{argv:?}");
    assert_eq!(report.losses.total(), 0, "{:?}", report.losses);
    (session, log, report)
}

/// The outcomes of the one library of `kind` the session attached to.
fn outcomes(session: &Session, kind: LibraryKind) -> Vec<ProbeOutcome> {
    let attachments: Vec<_> = session
        .attacher()
        .attachments()
        .iter()
        .filter(|a| a.library.kind == kind)
        .collect();
    assert_eq!(
        attachments.len(),
        1,
        "one {kind:?} file attached: {attachments:?}"
    );
    attachments[0].outcomes.clone()
}

/// Symbol → reason of each probe that failed.
fn failures(outcomes: &[ProbeOutcome]) -> BTreeMap<String, String> {
    outcomes
        .iter()
        .filter_map(|o| match o {
            ProbeOutcome::Failed { symbol, reason } => Some((symbol.clone(), reason.clone())),
            ProbeOutcome::Attached { .. } => None,
        })
        .collect()
}

/// Symbol → how many uprobes (entry, return) went in for it.
fn attached(outcomes: &[ProbeOutcome]) -> BTreeMap<String, usize> {
    let mut attached = BTreeMap::new();
    for outcome in outcomes {
        if let ProbeOutcome::Attached { symbol, .. } = outcome {
            *attached.entry(symbol.clone()).or_default() += 1;
        }
    }
    attached
}

/// The calls counted for the one process that ended.
fn calls(log: &EventLog) -> &BTreeMap<ProbeId, u64> {
    assert_eq!(log.ended.len(), 1, "{:?}", log.ended);
    &log.ended[0].calls
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The `lens-probe: warning:` lines of a run.
fn warnings(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|line| line.starts_with("lens-probe: warning:"))
        .collect()
}

/// `lens-probe --span-groups per_step --summary-json FILE --exec -- ARGV`: its output and
/// the summary's call counts of its one process.
fn lens_probe_exec(name: &str, argv: &[OsString]) -> (Output, serde_json::Value) {
    let json =
        std::env::temp_dir().join(format!("lens-variety-{name}-{}.json", std::process::id()));
    let output = Command::new(LENS_PROBE)
        .args(["--span-groups", "per_step", "--summary-json"])
        .arg(&json)
        .args(["--exec", "--"])
        .args(argv)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let processes = summary["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 1, "{summary}");
    (output, processes[0]["calls"].clone())
}

const CUDART_PROBES: [ProbeId; 6] = [
    ProbeId::CudaLaunchKernel,
    ProbeId::CudaLaunchKernelExC,
    ProbeId::CudaGraphLaunch,
    ProbeId::CudaStreamSynchronize,
    ProbeId::CudaEventSynchronize,
    ProbeId::CudaDeviceSynchronize,
];

/// Functions of the fake libcudart that `per_step` probes: the six the caller calls,
/// `cudaEventRecord[WithFlags]`, `cudaEventQuery`, `__cudaRegisterFunction`, the five
/// memory calls (`cudaMalloc`, `cudaMallocAsync`, `cudaMallocManaged`, `cudaFree`,
/// `cudaFreeAsync`) and the four graph calls (`cudaStreamBeginCapture`,
/// `cudaStreamEndCapture`, `cudaGraphInstantiate`, `cudaGraphInstantiateWithFlags`).
const CUDART_SYMBOLS_PROBED: usize = 19;

/// The address of each definition named `name` in `library`'s dynamic symbols.
fn dynamic_definitions(library: &Path, name: &str) -> Vec<u64> {
    use object::{Object, ObjectSymbol};
    let bytes = std::fs::read(library).unwrap();
    let elf = object::File::parse(&*bytes).unwrap();
    elf.dynamic_symbols()
        .filter(|symbol| symbol.is_definition() && symbol.name() == Ok(name))
        .map(|symbol| symbol.address())
        .collect()
}

fn has_static_symbols(library: &Path) -> bool {
    use object::Object;
    let bytes = std::fs::read(library).unwrap();
    object::File::parse(&*bytes)
        .unwrap()
        .section_by_name(".symtab")
        .is_some()
}

/// The variants are what the tests below take them for (no privileges needed).
#[test]
fn the_variants_are_built_as_described() {
    use std::os::unix::fs::MetadataExt;
    let missing = variant("missing/libcudart.so.12");
    assert!(dynamic_definitions(&missing, "cudaGraphLaunch").is_empty());
    assert_eq!(dynamic_definitions(&missing, "cudaLaunchKernel").len(), 1);

    for stripped in ["stripped/libcudart.so.12", "stripped/libtorch_cpu.so"] {
        assert!(!has_static_symbols(&variant(stripped)), "{stripped}");
    }
    assert!(has_static_symbols(
        &lens_tests::fake_torch_dir().join("libtorch_cpu.so")
    ));
    assert_eq!(
        dynamic_definitions(&variant("stripped/libcudart.so.12"), "cudaGraphLaunch").len(),
        1
    );

    // Two definitions of ncclAllReduce, at two addresses (the versions: see the
    // symbols unit tests).
    let versioned = dynamic_definitions(&variant("versioned/libnccl.so.2"), "ncclAllReduce");
    assert_eq!(versioned.len(), 2);
    assert_ne!(versioned[0], versioned[1]);

    let alias = variant("alias/libnccl.so.2");
    let at = |name| dynamic_definitions(&alias, name);
    assert_eq!(at("pncclAllReduce"), at("ncclAllReduce"));
    assert_eq!(at("ncclGroupEnd"), at("ncclGroupStart"));
    assert_ne!(at("ncclAllReduce"), at("ncclGroupStart"));

    let inode = |path: PathBuf| {
        let meta = std::fs::metadata(path).unwrap();
        (meta.dev(), meta.ino())
    };
    let file = inode(variant("twice/libcudart.so.12"));
    assert_eq!(inode(variant("twice/hardlink/libcudart.so.12")), file);
    assert_eq!(inode(variant("twice/symlink/libcudart.so.12")), file);
    assert!(
        std::fs::symlink_metadata(variant("twice/symlink/libcudart.so.12"))
            .unwrap()
            .file_type()
            .is_symlink()
    );

    let usage = Command::new(variety_caller()).output().unwrap();
    assert_eq!(usage.status.code(), Some(2));
    let absent = Command::new(variety_caller())
        .args(["1", "/nonexistent/libcudart.so.12"])
        .output()
        .unwrap();
    assert_eq!(absent.status.code(), Some(2));
}

#[test]
fn a_missing_symbol_fails_alone_and_the_other_probes_count_exactly() {
    if !lens_tests::require_bpf("a_missing_symbol_fails_alone_and_the_other_probes_count_exactly") {
        return;
    }
    let library = variant("missing/libcudart.so.12");
    let (session, log, _) = trace_exec(&caller_argv(&[], &[&library]));

    let outcomes = outcomes(&session, LibraryKind::CudaRuntime);
    assert_eq!(
        failures(&outcomes),
        BTreeMap::from([(
            "cudaGraphLaunch".to_string(),
            "libcudart defines no such symbol".to_string()
        )])
    );
    // The others: launches, event records and kernel registration at entry, syncs,
    // event queries and memory calls at entry and return.
    assert_eq!(
        attached(&outcomes),
        BTreeMap::from([
            ("cudaLaunchKernel".to_string(), 1),
            ("cudaLaunchKernelExC".to_string(), 1),
            ("cudaStreamSynchronize".to_string(), 2),
            ("cudaEventSynchronize".to_string(), 2),
            ("cudaDeviceSynchronize".to_string(), 2),
            ("cudaEventRecord".to_string(), 1),
            ("cudaEventRecordWithFlags".to_string(), 1),
            ("cudaEventQuery".to_string(), 2),
            ("__cudaRegisterFunction".to_string(), 1),
            ("cudaMalloc".to_string(), 2),
            ("cudaMallocAsync".to_string(), 2),
            ("cudaMallocManaged".to_string(), 2),
            ("cudaFree".to_string(), 2),
            ("cudaFreeAsync".to_string(), 2),
            ("cudaStreamBeginCapture".to_string(), 2),
            ("cudaStreamEndCapture".to_string(), 2),
            ("cudaGraphInstantiate".to_string(), 2),
            ("cudaGraphInstantiateWithFlags".to_string(), 2),
        ])
    );
    let expected: BTreeMap<ProbeId, u64> = CUDART_PROBES
        .into_iter()
        .filter(|p| *p != ProbeId::CudaGraphLaunch)
        .map(|p| (p, CALLS))
        .collect();
    assert_eq!(calls(&log), &expected);
}

#[test]
fn a_missing_symbol_is_one_warning_naming_it_and_the_library() {
    if !lens_tests::require_bpf("a_missing_symbol_is_one_warning_naming_it_and_the_library") {
        return;
    }
    let library = variant("missing/libcudart.so.12");
    let (output, calls) = lens_probe_exec("missing", &caller_argv(&[], &[library.as_path()]));
    let text = stderr(&output);
    assert_eq!(
        warnings(&text),
        [format!(
            "lens-probe: warning: cannot probe cudaGraphLaunch in {}: libcudart defines no such symbol",
            library.display()
        )],
        "{text}"
    );
    assert_eq!(
        calls,
        serde_json::json!({
            "cudaLaunchKernel": CALLS,
            "cudaLaunchKernelExC": CALLS,
            "cudaStreamSynchronize": CALLS,
            "cudaEventSynchronize": CALLS,
            "cudaDeviceSynchronize": CALLS,
        }),
        "{text}"
    );
}

#[test]
fn a_stripped_runtime_is_probed_whole_from_its_dynamic_symbols() {
    if !lens_tests::require_bpf("a_stripped_runtime_is_probed_whole_from_its_dynamic_symbols") {
        return;
    }
    let library = variant("stripped/libcudart.so.12");
    let (session, log, _) = trace_exec(&caller_argv(&[], &[&library]));

    let outcomes = outcomes(&session, LibraryKind::CudaRuntime);
    assert!(failures(&outcomes).is_empty(), "{outcomes:?}");
    assert_eq!(
        attached(&outcomes).len(),
        CUDART_SYMBOLS_PROBED,
        "{outcomes:?}"
    );
    let expected: BTreeMap<ProbeId, u64> = CUDART_PROBES.into_iter().map(|p| (p, CALLS)).collect();
    assert_eq!(calls(&log), &expected);
}

#[test]
fn a_stripped_libtorch_says_the_local_symbol_cannot_be_found() {
    if !lens_tests::require_bpf("a_stripped_libtorch_says_the_local_symbol_cannot_be_found") {
        return;
    }
    // The stripped libtorch_cpu.so comes first on the library path; the rest as usual.
    let stripped = variant("stripped");
    let argv: Vec<OsString> = vec![
        "env".into(),
        format!("LD_LIBRARY_PATH={}", stripped.display()).into(),
        lens_tests::torch_trainer().into(),
        // 2 steps of 1 microbatch, no evaluation, no checkpoint.
        "2".into(),
        "1".into(),
        "0".into(),
        "0".into(),
    ];
    let (session, log, _) = trace_exec(&argv);

    let attachment = session
        .attacher()
        .attachments()
        .iter()
        .find(|a| a.library.kind == LibraryKind::TorchCpu)
        .expect("libtorch_cpu attached");
    assert_eq!(
        attachment.library.shown_path,
        stripped.join("libtorch_cpu.so"),
        "the stripped copy was the one loaded"
    );
    let scope_exit = lens_probe::probes::catalog::symbol(ProbeId::TorchScopeExit).to_string();
    assert_eq!(
        failures(&attachment.outcomes),
        BTreeMap::from([(
            scope_exit.clone(),
            "libtorch_cpu does not export it, and the library is stripped (no .symtab): \
             a local symbol cannot be found"
                .to_string()
        )])
    );
    // Everything it exports is probed: scope entries are still seen, one per scope.
    assert!(!attached(&attachment.outcomes).contains_key(&scope_exit));
    let signals = |wanted: fn(&PhaseSignal) -> bool| {
        log.events
            .iter()
            .filter(|e| matches!(e, ProbeEvent::Phase { signal, .. } if wanted(signal)))
            .count()
    };
    // Per step: the DataLoader fetch, Optimizer.step, Optimizer.zero_grad.
    assert_eq!(
        signals(|s| matches!(s, PhaseSignal::ScopeEnter { .. })),
        2 * 3,
        "{:?}",
        log.events
    );
    assert_eq!(signals(|s| matches!(s, PhaseSignal::ScopeExit)), 0);
}

#[test]
fn the_default_version_of_a_versioned_symbol_is_probed_and_named() {
    if !lens_tests::require_bpf("the_default_version_of_a_versioned_symbol_is_probed_and_named") {
        return;
    }
    // ncclAllReduce@@NCCL_2.0 called CALLS times, the old ncclAllReduce@NCCL_1.0 5 times.
    let library = variant("versioned/libnccl.so.2");
    let vars = ["CALLER_VERSION=NCCL_1.0", "CALLER_VERSION_CALLS=5"];
    let (session, log, _) = trace_exec(&caller_argv(&vars, &[&library]));

    let outcomes = outcomes(&session, LibraryKind::Nccl);
    assert!(failures(&outcomes).is_empty(), "{outcomes:?}");
    for outcome in &outcomes {
        let ProbeOutcome::Attached { version, .. } = outcome else {
            unreachable!()
        };
        assert_eq!(version.as_deref(), Some("NCCL_2.0"), "{outcome:?}");
    }
    // Only the default version's calls: not 5, not 8.
    let calls = calls(&log);
    assert_eq!(
        calls.get(&ProbeId::NcclAllReduce),
        Some(&CALLS),
        "{calls:?}"
    );
    assert_eq!(calls.get(&ProbeId::NcclGroupStart), Some(&CALLS));
    assert_eq!(calls.get(&ProbeId::NcclGroupEnd), Some(&CALLS));
    let collectives = log
        .events
        .iter()
        .filter(|e| matches!(e, ProbeEvent::Collective { .. }))
        .count() as u64;
    assert_eq!(collectives, CALLS);
}

#[test]
fn the_cli_says_which_version_it_probed_and_which_it_did_not() {
    if !lens_tests::require_bpf("the_cli_says_which_version_it_probed_and_which_it_did_not") {
        return;
    }
    let library = variant("versioned/libnccl.so.2");
    let vars = ["CALLER_VERSION=NCCL_1.0", "CALLER_VERSION_CALLS=5"];
    let (output, calls) = lens_probe_exec("versioned", &caller_argv(&vars, &[&library]));
    let text = stderr(&output);
    assert_eq!(
        warnings(&text),
        [format!(
            "lens-probe: warning: {}: probed ncclAllReduce@@NCCL_2.0, the default version, \
             not ncclAllReduce@NCCL_1.0: calls from programs linked against an older \
             version are not seen",
            library.display()
        )],
        "{text}"
    );
    assert_eq!(
        calls,
        serde_json::json!({
            "ncclAllReduce": CALLS,
            "ncclGroupStart": CALLS,
            "ncclGroupEnd": CALLS,
        }),
        "{text}"
    );
}

#[test]
fn aliases_are_probed_once_and_a_shared_address_is_reported() {
    if !lens_tests::require_bpf("aliases_are_probed_once_and_a_shared_address_is_reported") {
        return;
    }
    // ncclAllReduce and pncclAllReduce: one function, both names called CALLS times; so
    // are ncclGroupStart and ncclGroupEnd (an alias of it here).
    let library = variant("alias/libnccl.so.2");
    let (session, log, _) = trace_exec(&caller_argv(&[], &[&library]));

    let outcomes = outcomes(&session, LibraryKind::Nccl);
    assert_eq!(
        failures(&outcomes),
        BTreeMap::from([(
            "ncclGroupEnd".to_string(),
            "at the same address as ncclGroupStart (one function under two names): \
             its calls are counted as ncclGroupStart"
                .to_string()
        )])
    );
    let attached = attached(&outcomes);
    // Entry and return, once: pncclAllReduce is not probed again.
    assert_eq!(attached.get("ncclAllReduce"), Some(&2), "{attached:?}");
    assert_eq!(attached.get("ncclGroupStart"), Some(&1), "{attached:?}");
    assert!(!attached.contains_key("ncclGroupEnd"));

    // Every call counted once, under the probed name.
    let calls = calls(&log);
    let expected: BTreeMap<ProbeId, u64> = [
        (ProbeId::NcclAllReduce, 2 * CALLS),
        (ProbeId::NcclGroupStart, 2 * CALLS),
    ]
    .into();
    assert_eq!(calls, &expected);
    let collectives = log
        .events
        .iter()
        .filter(|e| matches!(e, ProbeEvent::Collective { .. }))
        .count() as u64;
    assert_eq!(collectives, 2 * CALLS);
}

#[test]
fn a_library_mapped_twice_in_one_process_is_probed_once_and_counts_each_call_once() {
    if !lens_tests::require_bpf("a_library_mapped_twice_in_one_process_is_probed_once") {
        return;
    }
    // Through a symlink (dlopen: mapped at the real path), then through a hard link into
    // a namespace of its own (dlmopen: mapped again, at the hard link's path).
    let symlink = variant("twice/symlink/libcudart.so.12");
    let hardlink = variant("twice/hardlink/libcudart.so.12");
    let mut new_namespace = OsString::from("new:");
    new_namespace.push(&hardlink);
    let mut argv = caller_argv(&[], &[&symlink]);
    argv.push(new_namespace);
    let (session, log, _) = trace_exec(&argv);

    let outcomes = outcomes(&session, LibraryKind::CudaRuntime);
    assert!(failures(&outcomes).is_empty(), "{outcomes:?}");
    assert_eq!(attached(&outcomes).len(), CUDART_SYMBOLS_PROBED);
    let expected: BTreeMap<ProbeId, u64> =
        CUDART_PROBES.into_iter().map(|p| (p, 2 * CALLS)).collect();
    assert_eq!(calls(&log), &expected);
}

/// Makes `command` run in a mount namespace of its own (private: nothing propagates back)
/// where `source` is mounted on `target` first: bind-mounted, or as a file system of type
/// `fstype`.
fn in_mount_namespace(command: &mut Command, source: &Path, target: &Path, fstype: Option<&str>) {
    let cstring = |bytes: &[u8]| CString::new(bytes).unwrap();
    let root = cstring(b"/");
    let source = cstring(source.as_os_str().as_encoded_bytes());
    let target = cstring(target.as_os_str().as_encoded_bytes());
    let fstype = fstype.map(|fstype| cstring(fstype.as_bytes()));
    let flags = if fstype.is_some() { 0 } else { libc::MS_BIND };
    // SAFETY: only system calls between fork and exec, on strings made before.
    unsafe {
        command.pre_exec(move || {
            let private = libc::MS_REC | libc::MS_PRIVATE;
            let null = std::ptr::null();
            let fstype = fstype.as_ref().map_or(null, |f| f.as_ptr());
            if libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(null, root.as_ptr(), null, private, std::ptr::null()) != 0
                || libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    fstype,
                    flags,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// `variety_caller` opening `library`, waiting for a line on stdin before its calls;
/// `bind`: first, in a mount namespace of its own, `(source, target)` bind-mounted (a
/// container's view of the same file).
fn waiting_caller(library: &Path, bind: Option<(&Path, &Path)>) -> Child {
    let mut command = waiting_caller_command(library);
    if let Some((source, target)) = bind {
        in_mount_namespace(&mut command, source, target, None);
    }
    command.spawn().unwrap()
}

/// The command of [`waiting_caller`], without a mount namespace.
fn waiting_caller_command(library: &Path) -> Command {
    let mut command = Command::new(variety_caller());
    command
        .arg(CALLS.to_string())
        .arg(library)
        .env("CALLER_WAIT", "1")
        .env("LENS_FAKE_SYNC_MS", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    command
}

/// Two waiting callers of `library`: `matched` (a filter's match) and one without it,
/// ready, their entry bytes checked unpatched.
fn matched_and_other(
    library: &Path,
    matched: &mut Command,
) -> (Child, Child, [BufReader<std::process::ChildStdout>; 2]) {
    let mut matched = matched.spawn().unwrap();
    let mut other = waiting_caller(library, None);
    let outputs = [wait_ready(&mut matched), wait_ready(&mut other)];
    let byte = |pid| entry_byte(pid, library, "cudaLaunchKernel");
    assert_eq!((byte(matched.id()), byte(other.id())), (PUSH_RBP, PUSH_RBP));
    (matched, other, outputs)
}

/// Reads the caller's "ready" (its library is open).
fn wait_ready(child: &mut Child) -> BufReader<std::process::ChildStdout> {
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    stdout
}

#[test]
fn one_file_under_two_paths_in_two_mount_namespaces_is_probed_once() {
    if !lens_tests::require_bpf("one_file_under_two_paths_in_two_mount_namespaces") {
        return;
    }
    // One process opens the library at its own path; the other sees the same directory
    // bind-mounted elsewhere, in a mount namespace of its own (a container would).
    let dir = variant("twice");
    let elsewhere = std::env::temp_dir().join(format!("lens-variety-ns-{}", std::process::id()));
    std::fs::create_dir_all(&elsewhere).unwrap();
    let mut host = waiting_caller(&dir.join("libcudart.so.12"), None);
    let mut contained = waiting_caller(
        &elsewhere.join("libcudart.so.12"),
        Some((dir.as_path(), elsewhere.as_path())),
    );
    let mut outputs = [wait_ready(&mut host), wait_ready(&mut contained)];
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", contained.id())).unwrap();
    assert!(
        maps.contains(&format!("{}/libcudart.so.12", elsewhere.display())),
        "mapped under the other path: {maps}"
    );

    let mut session = Session::new(options()).unwrap();
    session.attach_pid(host.id()).unwrap();
    session.attach_pid(contained.id()).unwrap();
    for child in [&mut host, &mut contained] {
        writeln!(child.stdin.take().unwrap(), "go").unwrap();
    }
    let mut log = EventLog::default();
    let report = session
        .run_blocking(&mut log, Some(Duration::from_secs(60)))
        .unwrap();
    for child in [&mut host, &mut contained] {
        assert!(child.wait().unwrap().success());
    }
    for output in &mut outputs {
        let mut rest = String::new();
        std::io::Read::read_to_string(output, &mut rest).unwrap();
        assert!(
            rest.contains(&format!("cudaLaunchKernel {CALLS}")),
            "{rest}"
        );
    }
    let _ = std::fs::remove_dir(&elsewhere);
    assert_eq!(report.losses.total(), 0, "{:?}", report.losses);

    // The one inode probed for each process (the kernel plants the breakpoints per
    // process), under whichever path each maps it...
    let runtimes: Vec<_> = session
        .attacher()
        .attachments()
        .iter()
        .filter(|a| a.library.kind == LibraryKind::CudaRuntime)
        .collect();
    let scopes: std::collections::BTreeSet<_> = runtimes.iter().map(|a| a.scope).collect();
    assert_eq!(
        scopes,
        [host.id(), contained.id()]
            .into_iter()
            .map(ProbeScope::Process)
            .collect(),
        "{runtimes:?}"
    );
    assert!(
        runtimes
            .iter()
            .all(|a| a.library.file == runtimes[0].library.file),
        "{runtimes:?}"
    );
    for runtime in &runtimes {
        assert!(failures(&runtime.outcomes).is_empty(), "{runtime:?}");
    }
    // ...counting each process's own calls, once.
    assert_eq!(log.ended.len(), 2, "{:?}", log.ended);
    let expected: BTreeMap<ProbeId, u64> = CUDART_PROBES.into_iter().map(|p| (p, CALLS)).collect();
    for ended in &log.ended {
        assert_eq!(ended.calls, expected, "pid {}", ended.pid);
    }
}

#[test]
fn a_kernel_without_the_uprobe_pmu_is_one_line_and_nothing_runs() {
    if !lens_tests::require_bpf("a_kernel_without_the_uprobe_pmu_is_one_line_and_nothing_runs") {
        return;
    }
    // Simulated with a mount namespace in which the uprobe PMU's sysfs directory is an
    // empty tmpfs: lens-probe sees exactly what a kernel without CONFIG_UPROBE_EVENTS
    // shows (no /sys/bus/event_source/devices/uprobe/type), and so does its BPF loader.
    let marker = std::env::temp_dir().join(format!("lens-variety-ran-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    for mode in [
        &["--exec", "--", "touch"][..],
        &["--node", "--duration", "1s"][..],
    ] {
        let mut command = Command::new(LENS_PROBE);
        command.args(mode);
        if mode[0] == "--exec" {
            command.arg(&marker);
        }
        let pmu = Path::new("/sys/bus/event_source/devices/uprobe");
        in_mount_namespace(&mut command, Path::new("tmpfs"), pmu, Some("tmpfs"));
        let output = command.output().unwrap();
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{mode:?}: {text}");
        assert_eq!(
            text,
            "lens-probe: this kernel has no uprobe support \
             (/sys/bus/event_source/devices/uprobe/type is missing): \
             CONFIG_UPROBE_EVENTS is required\n",
            "{mode:?}"
        );
    }
    assert!(!marker.exists(), "the command must not run");
    // Outside the namespace, nothing changed.
    assert!(Path::new("/sys/bus/event_source/devices/uprobe/type").exists());
}

/// The fixture libraries' entry byte as the file has it (`push %rbp`), and as a process
/// the kernel planted a uprobe in reads it (`int3`).
const PUSH_RBP: u8 = 0x55;
const BREAKPOINT: u8 = 0xcc;

/// The first byte of `symbol` in `library` as process `pid` has it in memory now, read
/// through `/proc/PID/mem`: the breakpoint (0xcc) where a uprobe is planted in that
/// process, the function's own first instruction elsewhere.
fn entry_byte(pid: u32, library: &Path, symbol: &str) -> u8 {
    use std::os::unix::fs::FileExt;
    let offset =
        lens_probe::sys::symbols::resolve_file_offsets(library, &[symbol]).unwrap()[symbol];
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let library = library.canonicalize().unwrap();
    let address = maps
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 6 || Path::new(fields[5]) != library {
                return None;
            }
            let (start, end) = fields[0].split_once('-')?;
            let start = u64::from_str_radix(start, 16).ok()?;
            let end = u64::from_str_radix(end, 16).ok()?;
            let file_offset = u64::from_str_radix(fields[2], 16).ok()?;
            (file_offset <= offset && offset < file_offset + (end - start))
                .then(|| start + offset - file_offset)
        })
        .unwrap_or_else(|| panic!("{symbol} not mapped in pid {pid}: {maps}"));
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut byte = [0u8];
    mem.read_exact_at(&mut byte, address).unwrap();
    byte[0]
}

#[test]
fn only_the_traced_process_gets_the_breakpoint_in_a_file_its_neighbour_maps_too() {
    if !lens_tests::require_bpf("only_the_traced_process_gets_the_breakpoint") {
        return;
    }
    // Two processes map the same libcudart file; lens-probe traces one by pid.
    let library = variant("twice").join("libcudart.so.12");
    let mut traced = waiting_caller(&library, None);
    let mut neighbour = waiting_caller(&library, None);
    let mut outputs = [wait_ready(&mut traced), wait_ready(&mut neighbour)];
    let (traced_pid, neighbour_pid) = (traced.id(), neighbour.id());
    let byte = |pid| entry_byte(pid, &library, "cudaLaunchKernel");
    // `push %rbp` in both before.
    assert_eq!(
        (byte(traced_pid), byte(neighbour_pid)),
        (PUSH_RBP, PUSH_RBP)
    );

    let mut session = Session::new(options()).unwrap();
    session.attach_pid(traced_pid).unwrap();
    // During: the breakpoint in the traced process's copy of the page alone.
    assert_eq!(byte(traced_pid), BREAKPOINT, "the traced process is probed");
    assert_eq!(
        byte(neighbour_pid),
        PUSH_RBP,
        "the untraced neighbour mapping the same file is not"
    );
    writeln!(traced.stdin.take().unwrap(), "go").unwrap();
    let mut log = EventLog::default();
    let report = session
        .run_blocking(&mut log, Some(Duration::from_secs(60)))
        .unwrap();
    assert!(traced.wait().unwrap().success());
    assert_eq!(report.losses.total(), 0, "{:?}", report.losses);
    // The traced process's calls were seen.
    assert_eq!(log.ended.len(), 1, "{:?}", log.ended);
    assert_eq!(
        log.ended[0].calls.get(&ProbeId::CudaLaunchKernel),
        Some(&CALLS)
    );
    drop(session);
    // After: the neighbour never had it, and runs its calls as it would untraced.
    assert_eq!(byte(neighbour_pid), PUSH_RBP);
    writeln!(neighbour.stdin.take().unwrap(), "go").unwrap();
    assert!(neighbour.wait().unwrap().success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut outputs[1], &mut rest).unwrap();
    assert!(
        rest.contains(&format!("cudaLaunchKernel {CALLS}")),
        "{rest}"
    );
}

#[test]
fn once_lens_probe_has_exited_the_process_it_traced_runs_unpatched() {
    if !lens_tests::require_bpf("once_lens_probe_has_exited_the_process_it_traced_runs_unpatched") {
        return;
    }
    let library = variant("twice").join("libcudart.so.12");
    let mut traced = waiting_caller(&library, None);
    let mut output = wait_ready(&mut traced);
    let pid = traced.id();
    let byte = || entry_byte(pid, &library, "cudaLaunchKernel");
    assert_eq!(byte(), PUSH_RBP);

    let mut probe = lens_tests::lens_probe_command(LENS_PROBE)
        .args(["--span-groups", "per_step"])
        .args(["--exporter", "file", "--export-file", "/dev/null"])
        .args(["--pid", &pid.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(probe.stderr.take().unwrap());
    let mut said = String::new();
    while !said.contains("lens-probe: tracing") {
        assert_ne!(stderr.read_line(&mut said).unwrap(), 0, "{said}");
    }
    assert_eq!(byte(), BREAKPOINT, "traced: {said}");
    // SAFETY: our own child.
    unsafe { libc::kill(probe.id() as i32, libc::SIGINT) };
    assert!(probe.wait().unwrap().success());
    // lens-probe is gone at once; a child of it closes the links, and the kernel takes the
    // breakpoint out of the process, which runs on meanwhile.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while byte() != PUSH_RBP {
        assert!(
            std::time::Instant::now() < deadline,
            "the breakpoint is still in pid {pid} 120 s after lens-probe exited"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    writeln!(traced.stdin.take().unwrap(), "go").unwrap();
    assert!(traced.wait().unwrap().success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut output, &mut rest).unwrap();
    assert!(
        rest.contains(&format!("cudaLaunchKernel {CALLS}")),
        "{rest}"
    );
}

#[test]
fn node_mode_patches_only_the_processes_its_filter_matches() {
    if !lens_tests::require_bpf("node_mode_patches_only_the_processes_its_filter_matches") {
        return;
    }
    // Two processes map the same libcudart file; one has the variable the filter asks for.
    let library = variant("twice").join("libcudart.so.12");
    let marker = format!("match-{}", std::process::id());
    let (mut matched, mut other, mut outputs) = matched_and_other(
        &library,
        waiting_caller_command(&library).env("LENS_MATCH_TEST", &marker),
    );
    let (matched_pid, other_pid) = (matched.id(), other.id());
    let byte = |pid| entry_byte(pid, &library, "cudaLaunchKernel");

    let mut session = Session::new(options()).unwrap();
    let running = session
        .watch_node(lens_probe::discovery::NodeFilter {
            environment: vec![("LENS_MATCH_TEST".into(), marker)],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(running, 1, "one running process matches");
    assert_eq!(
        byte(matched_pid),
        BREAKPOINT,
        "the matching process is probed"
    );
    assert_eq!(
        byte(other_pid),
        PUSH_RBP,
        "a process the filter leaves out, mapping the same file, is not"
    );
    drop(session);
    // Both run their calls as they would untraced.
    for (child, output) in [&mut matched, &mut other].into_iter().zip(&mut outputs) {
        writeln!(child.stdin.take().unwrap(), "go").unwrap();
        assert!(child.wait().unwrap().success());
        let mut rest = String::new();
        std::io::Read::read_to_string(output, &mut rest).unwrap();
        assert!(
            rest.contains(&format!("cudaLaunchKernel {CALLS}")),
            "{rest}"
        );
    }
}

/// A lens-probe that is killed if the test fails before it stops it (in node mode it
/// would otherwise go on tracing the machine for the rest of the suite).
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// lens-probe's standard error, line by line, from a thread: [`StderrLines::until`]
/// waits for a line with a deadline instead of blocking on the pipe.
struct StderrLines {
    lines: std::sync::mpsc::Receiver<String>,
    seen: String,
}

impl StderrLines {
    fn of(child: &mut Child) -> StderrLines {
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        StderrLines {
            lines,
            seen: String::new(),
        }
    }

    /// Waits (2 minutes at most: a loaded machine) for a line containing `needle`.
    fn until(&mut self, needle: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                    if line.contains(needle) {
                        return;
                    }
                }
                Err(e) => panic!(
                    "no line with {needle:?} ({e}); lens-probe said:\n{}",
                    self.seen
                ),
            }
        }
    }

    /// Everything up to lens-probe's exit (its stderr closed).
    fn rest(mut self) -> String {
        self.seen.extend(self.lines.iter().map(|line| line + "\n"));
        self.seen
    }
}

#[test]
fn node_mode_with_match_plants_breakpoints_in_the_matching_process_only() {
    if !lens_tests::require_bpf(
        "node_mode_with_match_plants_breakpoints_in_the_matching_process_only",
    ) {
        return;
    }
    // Two processes map the same libcudart file; only one's command line has the text
    // `--match` asks for (its argv[0], as a launcher's script name would).
    let library = variant("twice").join("libcudart.so.12");
    let marker = format!("lens-match-{}", std::process::id());
    let (mut matched, mut other, mut outputs) =
        matched_and_other(&library, waiting_caller_command(&library).arg0(&marker));
    let (matched_pid, other_pid) = (matched.id(), other.id());
    let byte = |pid| entry_byte(pid, &library, "cudaLaunchKernel");

    // lens-probe node-wide, as a DaemonSet runs it, with the default console exporter:
    // each traced process's spans on stderr when it ends.
    let mut probe = Running(
        lens_tests::lens_probe_command(LENS_PROBE)
            .args(["--node", "--match", &marker])
            .args(["--span-groups", "per_step"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut said = StderrLines::of(&mut probe.0);
    said.until("watching for new ones");
    assert!(
        said.seen
            .contains("1 training processes running now are traced"),
        "{}",
        said.seen
    );
    // During: the breakpoint in the matching process alone.
    assert_eq!(
        byte(matched_pid),
        BREAKPOINT,
        "the matching process is probed: {}",
        said.seen
    );
    assert_eq!(
        byte(other_pid),
        PUSH_RBP,
        "a process --match leaves out, mapping the same file, is not"
    );
    // The matching process's calls are seen: its job ends with its three stream syncs.
    writeln!(matched.stdin.take().unwrap(), "go").unwrap();
    assert!(matched.wait().unwrap().success());
    said.until(&format!("[pid {matched_pid}] train.job"));
    assert_eq!(
        byte(other_pid),
        PUSH_RBP,
        "still not, while lens-probe runs"
    );
    // SAFETY: our own child.
    unsafe { libc::kill(probe.0.id() as i32, libc::SIGINT) };
    assert!(probe.0.wait().unwrap().success());
    let said = said.rest();
    let syncs = said
        .lines()
        .filter(|l| l.contains(&format!("[pid {matched_pid}]")))
        .filter(|l| l.contains("cuda.stream_synchronize"))
        .count();
    assert_eq!(syncs, 3, "{said}");
    assert!(
        !said.contains(&format!("[pid {other_pid}]")),
        "the other process was traced: {said}"
    );
    assert!(said.contains("no events lost"), "{said}");

    // After lens-probe has exited: the other process never had the breakpoint, and runs
    // its calls as it would untraced.
    assert_eq!(byte(other_pid), PUSH_RBP);
    writeln!(other.stdin.take().unwrap(), "go").unwrap();
    assert!(other.wait().unwrap().success());
    for output in &mut outputs {
        let mut rest = String::new();
        std::io::Read::read_to_string(output, &mut rest).unwrap();
        assert!(
            rest.contains(&format!("cudaLaunchKernel {CALLS}")),
            "{rest}"
        );
    }
}
