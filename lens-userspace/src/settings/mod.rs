//! What the user asked for, as plain values: the command line (`cli`), the configured
//! probe rules (`config`) and the built-in ones (`profiles`), and the span groups
//! (`groups`). Export settings stay with the exporters (`export::config`).
pub mod cli;
pub mod config;
pub mod groups;
pub mod links;
pub mod profiles;

crate::error::reason_error! {
    /// A value the user gave that lens-probe cannot take: what is wrong, and what it takes.
    pub struct BadValue;
}
