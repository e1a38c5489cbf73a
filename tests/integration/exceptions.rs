//! Exception safety (issue 33): a C++ exception that the traced program catches must
//! leave it exactly as it would have been untraced. A return probe replaces the probed
//! function's return address with the kernel's trampoline, which has no unwind
//! information: an exception unwinding through such a frame ends in `std::terminate`.
//! So no built-in return probe sits on a function an exception can leave, and a
//! configured rule does not put one on a C++ function unless it says `noexcept = true`.
//!
//! Checked on `throwing_trainer` (C++ libraries under libtorch's probed names whose
//! functions throw, caught by the program) under every preset and with configured rules,
//! and on real PyTorch: a backward that raises, a gloo collective that raises, a
//! `torch.load` of a corrupt file, each caught by the script. The traced run's exit
//! status and output are the untraced run's.
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use lens_tests::{assert_one_line_error, stderr_text};

const LENS_PROBE: &str = env!("CARGO_BIN_EXE_lens-probe");

/// A fresh directory for one run's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lens-exceptions-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// lens-probe in a clean environment, its spans going to `dir/spans.jsonl` (the
/// program's standard output stays its own).
fn lens_probe(dir: &Path, args: &[&str]) -> Command {
    let mut command = lens_tests::lens_probe_command(LENS_PROBE);
    command
        .args(["--exporter", "file", "--export-file"])
        .arg(dir.join("spans.jsonl"))
        .args(args);
    command
}

fn stdout_text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The traced run ended as the untraced one did and printed the same.
fn assert_same_as_untraced(untraced: &Output, traced: &Output, what: &str) {
    assert_eq!(
        traced.status.code(),
        untraced.status.code(),
        "{what}: exit status {:?} (untraced {:?}); lens-probe said:\n{}",
        traced.status,
        untraced.status,
        stderr_text(traced)
    );
    assert_eq!(stdout_text(traced), stdout_text(untraced), "{what}");
}

/// The calls column of the exit summary's line for `name` (`gloo.all_reduce  6 …`).
fn summary_calls(stderr: &str, name: &str) -> Option<u64> {
    stderr.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        (fields.next() == Some(name)).then(|| fields.next()?.parse().ok())?
    })
}

fn span_names(dir: &Path) -> Vec<String> {
    lens_tests::otlp_file_spans(&dir.join("spans.jsonl"))
        .into_iter()
        .map(|(_, span)| span["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn count(names: &[String], name: &str) -> usize {
    names.iter().filter(|n| *n == name).count()
}

#[test]
fn caught_cpp_exceptions_cross_every_presets_probes_and_the_program_goes_on() {
    if !lens_tests::require_bpf("caught_cpp_exceptions_cross_every_presets_probes") {
        return;
    }
    let trainer = lens_tests::throwing_trainer();
    let untraced = Command::new(&trainer).arg("3").output().unwrap();
    assert!(untraced.status.success(), "{untraced:?}");
    assert!(stdout_text(&untraced).ends_with("done: 3 rounds\n"));
    for preset in ["default", "per_step", "all"] {
        let dir = scratch(preset);
        let traced = lens_probe(&dir, &["--span-groups", preset, "--exec", "--"])
            .arg(&trainer)
            .arg("3")
            .output()
            .unwrap();
        assert_same_as_untraced(&untraced, &traced, preset);
        let stderr = stderr_text(&traced);
        if preset != "default" {
            // The probes were in while the exceptions crossed them: each round makes two
            // all-reduces (one raising) and one all-gather (raising).
            assert_eq!(
                summary_calls(&stderr, "gloo.all_reduce"),
                Some(6),
                "{stderr}"
            );
            assert_eq!(
                summary_calls(&stderr, "gloo.all_gather"),
                Some(3),
                "{stderr}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_rule_on_a_cpp_function_is_refused_and_a_glob_leaves_cpp_matches_out() {
    if !lens_tests::require_bpf("a_rule_on_a_cpp_function_is_refused") {
        return;
    }
    let trainer = lens_tests::throwing_trainer();
    let dir = scratch("rules");
    // Named as C++: refused before anything starts, one line saying what to do.
    let config = dir.join("cpp.toml");
    std::fs::write(
        &config,
        "[[probe]]\nlibrary = \"throwing_trainer\"\nsymbol = \"my::Trainer::fails\"\n\
         group = \"step\"\n",
    )
    .unwrap();
    let refused = lens_probe(
        &dir,
        &["--config", config.to_str().unwrap(), "--exec", "--"],
    )
    .arg(&trainer)
    .output()
    .unwrap();
    assert_one_line_error(&refused, 2, "names a C++ function");
    assert!(stdout_text(&refused).is_empty(), "the program never ran");

    // A glob that reaches the C++ function's mangled name too: that one is left out (one
    // warning), the C function is probed, and the program runs as it does untraced.
    let config = dir.join("glob.toml");
    std::fs::write(
        &config,
        "[[probe]]\nlibrary = \"throwing_trainer\"\nsymbol = \"*Trainer*fails*\"\n\
         group = \"evaluate\"\n\n\
         [[probe]]\nlibrary = \"throwing_trainer\"\nsymbol = \"my_c_step\"\ngroup = \"step\"\n\
         name = \"my.c_step\"\n",
    )
    .unwrap();
    let untraced = Command::new(&trainer).arg("3").output().unwrap();
    let traced = lens_probe(
        &dir,
        &[
            "--span-groups",
            "all",
            "--config",
            config.to_str().unwrap(),
            "--exec",
            "--",
        ],
    )
    .arg(&trainer)
    .arg("3")
    .output()
    .unwrap();
    assert_same_as_untraced(&untraced, &traced, "with rules");
    let stderr = stderr_text(&traced);
    let left_out: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("_ZN2my7Trainer5failsEi") && l.contains("a C++ function, left out"))
        .collect();
    assert_eq!(left_out.len(), 1, "{stderr}");
    assert!(left_out[0].contains("noexcept = true"), "{}", left_out[0]);
    // The C function's calls are spans.
    let names = span_names(&dir);
    assert_eq!(count(&names, "my.c_step"), 3, "{names:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn real_torch_exceptions_caught_by_the_script_leave_it_as_it_runs_untraced() {
    let test = "real_torch_exceptions_caught_by_the_script";
    if !lens_tests::require_bpf(test) {
        return;
    }
    let Some(venv) = lens_tests::torch_venv(test) else {
        return;
    };
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/torch/exceptions.py");
    let run_dir = scratch("torch-untraced");
    let untraced = Command::new(&venv.python)
        .arg(&script)
        .arg(&run_dir)
        .env("GLOO_SOCKET_IFNAME", "lo")
        .output()
        .unwrap();
    assert!(untraced.status.success(), "{untraced:?}");
    let text = stdout_text(&untraced);
    // What each step catches: the script's own words, checked so the runs compare
    // something.
    for needle in [
        "step 2: backward: caught: backward raised",
        "step 2: all_gather: caught RuntimeError",
        "step 2: load: caught RuntimeError",
        "step 2: trained",
    ] {
        assert!(text.contains(needle), "{needle:?} not in {text}");
    }
    for preset in ["per_step", "all"] {
        let dir = scratch(&format!("torch-{preset}"));
        let traced = lens_probe(&dir, &["--span-groups", preset, "--exec", "--"])
            .arg(&venv.python)
            .arg(&script)
            .arg(&dir)
            .env("GLOO_SOCKET_IFNAME", "lo")
            .output()
            .unwrap();
        assert_same_as_untraced(&untraced, &traced, preset);
        // Traced, not merely alive: the raising all-gathers, the gradients' all-reduces
        // (two parameters a step) and the backwards were seen.
        let names = span_names(&dir);
        assert_eq!(count(&names, "gloo.all_gather"), 3, "{names:?}");
        assert_eq!(count(&names, "gloo.all_reduce"), 6, "{names:?}");
        assert!(count(&names, "train.forward_backward") >= 3, "{names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&run_dir);
}
