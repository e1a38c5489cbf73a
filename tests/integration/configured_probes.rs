//! Configured probes (issue 8): a TOML file of rules naming a program's own functions —
//! plain C names, a demangled C++ name, a glob — and the span groups their calls become,
//! through real uprobes on `configured_trainer` and its `libmytrain.so`
//! (tests/README.md); a step rule taking steps over from torch's signals on the fake
//! libtorch; missing symbols and libraries as one warning each; bad files as one line,
//! exit status 2.
use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::Output,
    sync::Arc,
    time::Duration,
};

use lens_probe::{
    semconv,
    session::{Session, TraceOptions},
    settings::{groups::SpanGroups, probe_rules::ProbeRules},
    spans::{SpanBuilder, SpanLog, names},
};
use lens_tests::{assert_one_line_error, stderr_text};

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// The trainer's own functions, each named one way: a plain name with an integer
/// argument, a demangled C++ name, a glob (two functions), a C string argument.
const RULES: &str = r#"
[[probe]]
library = "libmytrain.so"
symbol = "my_train_step"
group = "step"
args = [{ index = 0, type = "int", attribute = "my.step" }]

[[probe]]
library = "libmytrain.so"
symbol = "my::Trainer::forward"
group = "forward_backward"
# A C++ function: its return probe is the user's word that no exception leaves it.
noexcept = true

[[probe]]
library = "libmytrain.so*"
symbol = "my_optimizer_*"
group = "optimizer"

[[probe]]
library = "libmytrain.so"
symbol = "my_evaluate"
group = "evaluate"

[[probe]]
library = "libmytrain.so"
symbol = "my_save_checkpoint"
group = "checkpoint"
args = [{ index = 0, type = "str", attribute = "nemo.checkpoint.path" }]
"#;

/// Traces `argv` with these rules and `spec` groups, through the library API.
fn trace(rules: &str, spec: &str, argv: &[OsString]) -> (SpanLog, Session) {
    let rules = Arc::new(ProbeRules::parse(rules).unwrap());
    let mut session = Session::new(TraceOptions {
        span_groups: spec.parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    session.set_rules(rules.clone());
    session.exec(argv).unwrap();
    let mut builder = SpanBuilder::new(spec.parse().unwrap(), SpanLog::default()).with_rules(rules);
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    (builder.into_exporter(), session)
}

fn trainer(args: &[&str]) -> Vec<OsString> {
    std::iter::once(lens_tests::configured_trainer().into_os_string())
        .chain(args.iter().map(OsString::from))
        .collect()
}

const KEYS: &[&str] = &[
    semconv::DL_ITERATION,
    "my.step",
    "nemo.checkpoint.path",
    semconv::NEMO_SPAN_TRUNCATED,
];

fn step(iteration: u32) -> String {
    format!(
        "  train.step dl.iteration={iteration} my.step={iteration}\n    train.forward_backward\n    \
         train.optimizer\n    train.optimizer\n"
    )
}

#[test]
fn rules_give_steps_evaluations_and_checkpoints_nested_as_called() {
    if !lens_tests::require_bpf("rules_give_steps_evaluations_and_checkpoints_nested_as_called") {
        return;
    }
    let (log, session) = trace(RULES, "all", &trainer(&["4", "2", "3"]));
    let expected = [
        "train.job\n  train.model_init\n".to_string(),
        step(0),
        step(1),
        "  train.evaluate\n".into(),
        step(2),
        "  train.checkpoint nemo.checkpoint.path=ckpt/step-3.pt\n".into(),
        step(3),
        "  train.evaluate\n".into(),
    ]
    .concat();
    assert_eq!(log.outline(KEYS), expected);
    assert!(log.misnested().is_empty(), "{:#?}", log.misnested());
    // Steps one after another, each at least as long as what it calls (3 ms of sleeps).
    let steps: Vec<_> = log.named(names::STEP).collect();
    for pair in steps.windows(2) {
        assert!(pair[0].end_ns <= pair[1].start_ns);
    }
    for step in &steps {
        assert!(step.duration_ns() >= 3_000_000, "{step:?}");
        assert_eq!(step.attr(semconv::NEMO_SPAN_GROUP), Some(&"step".into()));
    }
    let checkpoint = log.named(names::CHECKPOINT).next().unwrap();
    assert!(checkpoint.duration_ns() >= 3_000_000);
    // The demangled rule and the glob (two functions) were attached, entry and return.
    let attached: Vec<String> = session
        .attacher()
        .attachments()
        .iter()
        .flat_map(|a| a.attached().map(str::to_string).collect::<Vec<_>>())
        .collect();
    for symbol in [
        "_ZN2my7Trainer7forwardEi",
        "my_optimizer_step",
        "my_optimizer_zero_grad",
        "my_train_step",
    ] {
        assert_eq!(
            attached.iter().filter(|s| *s == symbol).count(),
            2,
            "{symbol}: {attached:?}"
        );
    }
    assert!(
        session
            .attacher()
            .unmatched_rules(&"all".parse().unwrap())
            .is_empty()
    );
}

#[test]
fn a_rule_of_a_disabled_group_is_not_attached_and_its_spans_are_not_shown() {
    if !lens_tests::require_bpf("a_rule_of_a_disabled_group_is_not_attached") {
        return;
    }
    // default = job, checkpoint, evaluate: the step, forward and optimizer rules stay out.
    let (log, session) = trace(RULES, "default", &trainer(&["4", "2", "3"]));
    assert_eq!(
        log.outline(KEYS),
        "train.job\n  train.evaluate\n  train.checkpoint \
         nemo.checkpoint.path=ckpt/step-3.pt\n  train.evaluate\n"
    );
    let attached: Vec<&str> = session
        .attacher()
        .attachments()
        .iter()
        .flat_map(|a| a.attached())
        .collect();
    assert!(!attached.contains(&"my_train_step"), "{attached:?}");
}

#[test]
fn a_step_rule_takes_steps_over_from_torch_signals() {
    if !lens_tests::require_bpf("a_step_rule_takes_steps_over_from_torch_signals") {
        return;
    }
    // Each backward pass of the fake libtorch (by its demangled name, overloads and all)
    // is a step: 2 steps of 2 microbatches give 4, and torch's own step machine (which
    // would give 2 steps with forward_backward and optimizer) is off.
    let rules = r#"
        [[probe]]
        library = "libtorch_cpu.so"
        symbol = "torch::autograd::Engine::execute"
        group = "step"
        name = "my.backward_step"
        noexcept = true   # the fake's never throws (the real one can: see docs/probes.md)
    "#;
    let argv: Vec<OsString> = std::iter::once(lens_tests::torch_trainer().into_os_string())
        .chain(["2", "2", "0", "0"].map(OsString::from))
        .collect();
    let (log, _) = trace(rules, "per_step", &argv);
    let steps: String = (0..4)
        .map(|i| format!("  my.backward_step dl.iteration={i}\n"))
        .collect();
    assert_eq!(
        log.outline(KEYS),
        format!("train.job\n  train.model_init\n{steps}")
    );
}

/// A config file in a fresh directory, removed on drop.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn new(name: &str, text: &str) -> ConfigFile {
        let dir =
            std::env::temp_dir().join(format!("lens-configured-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lens.toml");
        std::fs::write(&path, text).unwrap();
        ConfigFile(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn lens_probe(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = lens_tests::lens_probe_command(LENS_PROBE);
    command.args(args).envs(env.iter().copied());
    command.output().unwrap()
}

#[test]
fn a_missing_symbol_or_library_is_one_warning_and_the_other_rules_work() {
    if !lens_tests::require_bpf("a_missing_symbol_or_library_is_one_warning") {
        return;
    }
    let config = ConfigFile::new(
        "missing",
        &format!(
            "{RULES}
            [[probe]]
            library = \"libmytrain.so\"
            symbol = \"my_missing_function\"
            group = \"step\"

            [[probe]]
            library = \"libnope.so\"
            symbol = \"nope\"
            group = \"evaluate\"

            [[probe]]
            python = \"megatron.training.training:train_step\"
            group = \"step\"
            "
        ),
    );
    let trainer = lens_tests::configured_trainer();
    let output = lens_probe(
        &[
            "--exec",
            "--span-groups",
            "all",
            "--exporter",
            "console",
            "--config",
            &config.path().to_string_lossy(),
            "--",
            &trainer.to_string_lossy(),
            "4",
            "2",
            "3",
        ],
        &[],
    );
    let stderr = stderr_text(&output);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("lens-probe: warning:"))
        .collect();
    let with = |needle: &str| warnings.iter().filter(|w| w.contains(needle)).count();
    assert_eq!(with("my_missing_function"), 1, "{warnings:#?}");
    assert_eq!(with("libnope.so"), 1, "{warnings:#?}");
    // The Python rule: the trainer is no CPython.
    assert_eq!(
        with(
            "python = \"megatron.training.training:train_step\": no traced process runs a CPython"
        ),
        1,
        "{warnings:#?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("rule 6 (line") && w.contains("no symbol matches it")),
        "{warnings:#?}"
    );
    assert_eq!(warnings.len(), 3, "{warnings:#?}");
    // The other rules work: four steps, two evaluations, a checkpoint.
    let count = |name: &str| {
        stderr
            .lines()
            .filter(|line| line.split_whitespace().any(|word| word == name))
            .count()
    };
    assert_eq!(count("train.step"), 4, "{stderr}");
    assert_eq!(count("train.evaluate"), 2, "{stderr}");
    assert_eq!(count("train.checkpoint"), 1, "{stderr}");
    assert_eq!(count("train.optimizer"), 8, "{stderr}");
}

#[test]
fn bad_config_files_are_one_line_naming_the_file_rule_and_field_exit_2() {
    // Checked before anything is loaded: no root needed (pid 1 is never traced).
    let cases: &[(&str, &str, &[&str])] = &[
        ("toml", "[[probe]\n", &["not valid TOML", "line 1"]),
        (
            "group",
            "[[probe]]\nlibrary = \"libx.so\"\nsymbol = \"f\"\ngroup = \"steps\"\n",
            &[
                "rule 1 (line 1): group: unknown group \"steps\"",
                "valid: checkpoint, evaluate",
            ],
        ),
        (
            "field",
            "[[probe]]\npython = \"m:f\"\ngroup = \"step\"\n\n[[probe]]\nlibrary = \"libx.so\"\nsym = \"f\"\ngroup = \"step\"\n",
            &[
                "rule 2 (line 5): unknown field \"sym\"",
                "valid: args, group, library",
            ],
        ),
        (
            "nothing",
            "[[probe]]\ngroup = \"step\"\n",
            &[
                "rule 1 (line 1): names no function",
                "symbol (with library)",
                "python",
            ],
        ),
        (
            "args",
            "[[probe]]\nlibrary = \"libx.so\"\nsymbol = \"f\"\ngroup = \"step\"\nargs = [{ index = 0, type = \"double\" }]\n",
            &[
                "args[0].type: unknown type \"double\"",
                "valid: bool, int, long, ptr",
            ],
        ),
        (
            "key",
            "[probe]\nx = 1\n",
            &["probe must be an array of tables"],
        ),
    ];
    for (name, text, needles) in cases {
        let config = ConfigFile::new(name, text);
        let file = config.path().to_string_lossy().into_owned();
        for output in [
            lens_probe(&["--pid", "1", "--config", &file], &[]),
            lens_probe(&["--pid", "1"], &[("NEMO_LENS_CONFIG", &file)]),
        ] {
            assert_one_line_error(&output, 2, &format!("invalid config {file}: "));
            for needle in *needles {
                assert_one_line_error(&output, 2, needle);
            }
        }
    }
    let output = lens_probe(&["--pid", "1", "--config", "/nonexistent/lens.toml"], &[]);
    assert_one_line_error(
        &output,
        2,
        "invalid config /nonexistent/lens.toml: cannot read it",
    );
    let output = lens_probe(&["--pid", "1", "--profile", "deepspeed"], &[]);
    assert_one_line_error(
        &output,
        2,
        "invalid value \"deepspeed\" for --profile: unknown profile; valid: pytorch, megatron, nemo-rl",
    );
    let output = lens_probe(&["--pid", "1"], &[("LENS_PROBE_PROFILE", "x")]);
    assert_one_line_error(&output, 2, "for LENS_PROBE_PROFILE: unknown profile");
}

#[test]
fn a_std_string_argument_is_read_and_a_checkpoint_rule_takes_checkpoints_over() {
    if !lens_tests::require_bpf("a_std_string_argument_is_read") {
        return;
    }
    // The fake libtorch's PyTorchStreamWriter constructor (this, const std::string& name,
    // ...) by its demangled name: the file name is read through the std::string in rsi.
    // Checkpoints come from the rule now, not from the writer/destructor signals.
    let rules = r#"
        [[probe]]
        library = "libtorch_cpu.so"
        symbol = "caffe2::serialize::PyTorchStreamWriter::PyTorchStreamWriter"
        noexcept = true   # the fake's never throws (the real one can)
        group = "checkpoint"
        args = [{ index = 1, type = "std::string", attribute = "nemo.checkpoint.path" }]
    "#;
    let argv = lens_tests::torch_trainer_argv(&[], &["3", "1", "0", "3"]);
    let (log, _) = trace(rules, "per_step", &argv);
    let torch_step = |i: u32| {
        format!("  train.step dl.iteration={i}\n    train.forward_backward\n    train.optimizer\n")
    };
    assert_eq!(
        log.outline(KEYS),
        [
            "train.job\n  train.model_init\n".to_string(),
            torch_step(0),
            torch_step(1),
            torch_step(2),
            "  train.checkpoint nemo.checkpoint.path=ckpt/step3.pt\n".into(),
        ]
        .concat()
    );
}

#[test]
fn configured_spans_count_the_launches_made_inside_them() {
    if !lens_tests::require_bpf("configured_spans_count_the_launches_made_inside_them") {
        return;
    }
    // my_train_step makes 5 launches (fake libcudart) before calling forward and the
    // optimizer: each step counts them, its children none. The rule events are launch
    // marks of their own, so the counts are exact.
    let argv: Vec<OsString> = ["env", "CONFIGURED_LAUNCHES=5"]
        .into_iter()
        .map(OsString::from)
        .chain(trainer(&["3", "0", "0"]))
        .collect();
    let (log, _) = trace(RULES, "all", &argv);
    let steps: Vec<_> = log.named(names::STEP).collect();
    assert_eq!(steps.len(), 3);
    for step in steps {
        assert_eq!(
            step.int_attr(semconv::CUDA_LAUNCH_COUNT),
            Some(5),
            "{step:?}"
        );
        for child in log.children(step) {
            assert_eq!(
                child.int_attr(semconv::CUDA_LAUNCH_COUNT),
                Some(0),
                "{child:?}"
            );
        }
    }
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.int_attr(semconv::CUDA_LAUNCH_COUNT), Some(15));
}

#[test]
fn attaching_to_a_running_loop_by_pid_gives_whole_steps() {
    if !lens_tests::require_bpf("attaching_to_a_running_loop_by_pid_gives_whole_steps") {
        return;
    }
    // A process that maps only a configured library is accepted by --pid; the step in
    // progress at the attach (its entry unseen) is left out, the others are whole and
    // count from 0. The loop holds in the middle of step 29 until the attach is done.
    let mut child = std::process::Command::new(lens_tests::configured_trainer())
        .args(["60", "0", "0"])
        .env("CONFIGURED_HOLD_STEP", "29")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut held = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut held,
    )
    .unwrap();
    assert_eq!(held.trim(), "held");
    let rules = Arc::new(ProbeRules::parse(RULES).unwrap());
    let mut session = Session::new(TraceOptions {
        span_groups: "all".parse::<SpanGroups>().unwrap(),
        kernel_logs: false,
        overhead_budget: None,
        uprobe_links: Default::default(),
    })
    .unwrap();
    session.set_rules(rules.clone());
    session.attach_pid(child.id()).unwrap();
    // SAFETY: a plain signal to the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    let mut builder =
        SpanBuilder::new("all".parse().unwrap(), SpanLog::default()).with_rules(rules);
    session
        .run_blocking(&mut builder, Some(Duration::from_secs(60)))
        .unwrap();
    assert!(child.wait().unwrap().success());
    let log = builder.into_exporter();
    let steps: Vec<_> = log.named(names::STEP).collect();
    // Steps 30..59: step 29's entry came before the attach.
    assert_eq!(steps.len(), 30, "{steps:?}");
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step.int_attr(semconv::DL_ITERATION), Some(i as i64));
        assert_eq!(step.int_attr("my.step"), Some(30 + i as i64));
        assert!(!step.truncated(), "{step:?}");
        assert_eq!(log.children(step).len(), 3, "{step:?}");
    }
    let job = log.named(names::JOB).next().unwrap();
    assert_eq!(job.attr(semconv::NEMO_ATTACHED_MID_RUN), Some(&true.into()));
}
