//! What the user asked for, as plain values: the command line (`cli`), the configured
//! probe rules (`config`) and the built-in ones (`profiles`), and the span groups
//! (`groups`). Export settings stay with the exporters (`export::config`).
pub mod cli;
pub mod groups;
pub mod links;
pub mod probe_rules;
pub mod profiles;

crate::error::reason_error! {
    /// A value the user gave that lens-probe cannot take: what is wrong, and what it takes.
    pub struct BadValue;
}

/// A size as people write it: `1GiB`, `500MiB`, `64M`, `4096` (bytes); K/M/G/T are
/// binary multiples with or without `iB`/`B`.
pub fn parse_size(text: &str) -> Result<u64, BadValue> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| "expected a size such as 1GiB, 500MiB or 4096 (bytes)".to_string())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!("unknown unit {unit:?}; expected KiB, MiB, GiB or TiB").into());
        }
    };
    let bytes = number
        .checked_mul(1 << shift)
        .ok_or_else(|| "too large".to_string())?;
    if bytes < 1 << 20 {
        return Err("at least 1MiB (a spool's batch of spans can take several hundred KiB)".into());
    }
    Ok(bytes)
}

/// A size for people to read: `1.5 GiB`, `12.0 MiB`, `3.2 KiB`, `512 B`.
pub fn format_size(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / f64::from(1u32 << 30)),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}
