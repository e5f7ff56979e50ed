//! Bedrock: a hosted, multi-tenant service that runs LLM agent conversations as supervised
//! actors. See README.md for the codemap and the architecture invariants.

pub mod api;
pub mod app;
pub mod cluster;
pub mod config;
pub mod crash;
pub mod egress;
pub mod hub;
pub mod llm;
pub mod mcp_client;
pub mod metrics;
pub mod model;
pub mod node;
pub mod notice;
pub mod origin;
pub mod persistence;
pub mod quotas;
pub mod replay;
pub mod runtime;
pub mod sandbox;
pub mod schedules;
pub mod server;
pub mod state_machine;
pub mod store;
pub mod telemetry;
pub mod testkit;
pub mod tools;
pub mod webhooks;
pub mod wire;
pub mod workspace;

/// Installs ring as the process's TLS crypto provider (reqwest and sqlx share rustls). Safe to
/// call more than once.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
