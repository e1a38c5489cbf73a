//! Export: finished spans (and metrics) to where users look, with OpenTelemetry's
//! wire format. Which backend and which ranks export is [`config`]; what describes the
//! traced process (resource attributes, read from the target, not from lens-probe) is
//! [`resource`]; the rank decision is [`strategy`]; the OTLP and file pipelines are
//! [`otlp`].
pub mod config;
pub mod metrics;
pub mod otlp;
pub mod resource;
pub mod spool;
pub mod strategy;
