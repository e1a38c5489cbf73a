//! Statistics, formatting and the markdown table of `cargo xtask bench` (pure, tested).

use xtask::error::{Error, Result};

pub const BEGIN_MARKER: &str = "<!-- bench:begin -->";
pub const END_MARKER: &str = "<!-- bench:end -->";

/// The median (mean of the two middle values for an even count); `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

pub fn min_max(values: &[f64]) -> Option<(f64, f64)> {
    let v = values.iter().copied().filter(|x| x.is_finite());
    let min = v.clone().reduce(f64::min)?;
    let max = v.reduce(f64::max)?;
    Some((min, max))
}

/// `1.234 s`, `56.7 ms`, `890 µs`, `12 ns`.
pub fn fmt_duration(seconds: f64) -> String {
    let a = seconds.abs();
    if a >= 1.0 {
        format!("{seconds:.3} s")
    } else if a >= 1e-3 {
        format!("{:.1} ms", seconds * 1e3)
    } else if a >= 1e-6 {
        format!("{:.2} µs", seconds * 1e6)
    } else {
        format!("{:.0} ns", seconds * 1e9)
    }
}

/// `1.23×`.
pub fn fmt_ratio(ratio: f64) -> String {
    format!("{ratio:.3}×")
}

/// 1234567.8 → `1 234 568`.
pub fn fmt_count(n: f64) -> String {
    let digits = format!("{:.0}", n.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(' ');
        }
        out.push(c);
    }
    if n < 0.0 { format!("-{out}") } else { out }
}

/// Whether an issue 6 target is met.
#[derive(Clone, Debug, PartialEq)]
pub enum Met {
    Yes,
    No,
    /// No target for this row.
    NoTarget,
    /// Could not be measured: why.
    NotMeasured(String),
}

impl Met {
    pub fn from_bool(ok: bool) -> Met {
        if ok { Met::Yes } else { Met::No }
    }

    fn cell(&self) -> String {
        match self {
            Met::Yes => "yes".into(),
            Met::No => "**no**".into(),
            Met::NoTarget => "—".into(),
            Met::NotMeasured(why) => format!("not measured: {why}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub what: String,
    pub median: String,
    /// `min – max` over the rounds.
    pub spread: String,
    pub ratio: String,
    pub target: String,
    pub met: Met,
}

impl Row {
    pub fn not_measured(what: impl Into<String>, target: &str, why: &str) -> Row {
        Row {
            what: what.into(),
            median: "—".into(),
            spread: "—".into(),
            ratio: "—".into(),
            target: target.into(),
            met: Met::NotMeasured(why.into()),
        }
    }
}

/// Builds a row from per-round values: median, min–max, formatted with `fmt`.
pub fn row(
    what: impl Into<String>,
    values: &[f64],
    fmt: impl Fn(f64) -> String,
    ratio: Option<f64>,
    target: &str,
    met: Met,
) -> Row {
    let what = what.into();
    let Some(m) = median(values) else {
        return Row::not_measured(what, target, "no value");
    };
    let spread = match min_max(values) {
        Some((lo, hi)) if values.len() > 1 => format!("{} – {}", fmt(lo), fmt(hi)),
        _ => "—".into(),
    };
    Row {
        what,
        median: fmt(m),
        spread,
        ratio: ratio.map(fmt_ratio).unwrap_or_else(|| "—".into()),
        target: target.into(),
        met,
    }
}

pub struct Section {
    pub title: String,
    pub rows: Vec<Row>,
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// One markdown table; each section starts with a bold row of its own.
pub fn table(sections: &[Section]) -> String {
    let mut out = String::from(
        "| what | median | rounds (min – max) | ratio | issue 6 target | met |\n\
         |---|---|---|---|---|---|\n",
    );
    for section in sections {
        out.push_str(&format!("| **{}** | | | | | |\n", cell(&section.title)));
        for r in &section.rows {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                cell(&r.what),
                cell(&r.median),
                cell(&r.spread),
                cell(&r.ratio),
                cell(&r.target),
                cell(&r.met.cell())
            ));
        }
    }
    out
}

/// `doc` with the text between the bench markers replaced by `generated` (markers kept).
/// Without markers, they are appended with `generated` between them.
pub fn replace_between_markers(doc: &str, generated: &str) -> Result<String> {
    let generated = generated.trim_matches('\n');
    match (doc.find(BEGIN_MARKER), doc.find(END_MARKER)) {
        (Some(b), Some(e)) if b < e => {
            let before = &doc[..b + BEGIN_MARKER.len()];
            let after = &doc[e..];
            Ok(format!("{before}\n{generated}\n{after}"))
        }
        (None, None) => {
            let mut out = doc.trim_end_matches('\n').to_owned();
            out.push_str(&format!("\n\n{BEGIN_MARKER}\n{generated}\n{END_MARKER}\n"));
            Ok(out)
        }
        _ => Err(Error::Msg(format!(
            "the markers `{BEGIN_MARKER}` and `{END_MARKER}` are not both there, in order"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spread() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[f64::NAN, 2.0]), Some(2.0));
        assert_eq!(min_max(&[2.0, -1.0, 7.5]), Some((-1.0, 7.5)));
        assert_eq!(min_max(&[]), None);
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_duration(1.23456), "1.235 s");
        assert_eq!(fmt_duration(0.0567), "56.7 ms");
        assert_eq!(fmt_duration(0.000_001_5), "1.50 µs");
        assert_eq!(fmt_duration(12e-9), "12 ns");
        assert_eq!(fmt_duration(-0.0002), "-200.00 µs");
        assert_eq!(fmt_ratio(1.0049), "1.005×");
        assert_eq!(fmt_count(1_234_567.8), "1 234 568");
        assert_eq!(fmt_count(999.0), "999");
        assert_eq!(fmt_count(1000.0), "1 000");
        assert_eq!(fmt_count(-12345.0), "-12 345");
    }

    #[test]
    fn rows_and_table() {
        let r = row(
            "a|b",
            &[1.0, 3.0, 2.0],
            fmt_duration,
            Some(1.5),
            "≤ 1 s",
            Met::No,
        );
        assert_eq!(r.median, "2.000 s");
        assert_eq!(r.spread, "1.000 s – 3.000 s");
        assert_eq!(r.ratio, "1.500×");
        let single = row("x", &[2.0], fmt_duration, None, "", Met::Yes);
        assert_eq!(single.spread, "—");
        assert_eq!(single.ratio, "—");
        let none = row("x", &[], fmt_duration, None, "t", Met::Yes);
        assert_eq!(none.met, Met::NotMeasured("no value".into()));
        let t = table(&[Section {
            title: "1. S".into(),
            rows: vec![r, Row::not_measured("y", "≥ 1", "no bpftrace")],
        }]);
        assert_eq!(
            t,
            "| what | median | rounds (min – max) | ratio | issue 6 target | met |\n\
             |---|---|---|---|---|---|\n\
             | **1. S** | | | | | |\n\
             | a\\|b | 2.000 s | 1.000 s – 3.000 s | 1.500× | ≤ 1 s | **no** |\n\
             | y | — | — | — | ≥ 1 | not measured: no bpftrace |\n"
        );
    }

    #[test]
    fn markers() {
        let doc =
            "# P\n\nintro\n<!-- bench:begin -->\nold\nstuff\n<!-- bench:end -->\n\n## Hand\nkept\n";
        assert_eq!(
            replace_between_markers(doc, "\nnew\n").unwrap(),
            "# P\n\nintro\n<!-- bench:begin -->\nnew\n<!-- bench:end -->\n\n## Hand\nkept\n"
        );
        assert_eq!(
            replace_between_markers("# P\n\n", "new").unwrap(),
            "# P\n\n<!-- bench:begin -->\nnew\n<!-- bench:end -->\n"
        );
        assert!(replace_between_markers("<!-- bench:end --> <!-- bench:begin -->", "x").is_err());
        assert!(replace_between_markers("<!-- bench:begin -->", "x").is_err());
    }
}
