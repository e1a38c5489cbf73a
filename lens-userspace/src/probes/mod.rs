//! What to attach and where: the probe catalog, the libraries it targets, their symbols,
//! and the attachment itself.
pub mod attach;
pub mod calibrate;
pub mod catalog;
pub mod file_probes;
