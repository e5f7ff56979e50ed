//! The one integration-test binary: a module per capability. Every test gets a fresh
//! database (SQLite always; Postgres too where BEDROCK_TEST_DATABASE_URL is set) and a
//! scripted OpenAI-compatible fake LLM; nothing reaches the internet.

// A test matches the one variant it expects and fails on any other.
#![allow(clippy::wildcard_enum_match_arm)]

mod support;

mod agents;
mod anthropic;
mod api;
mod architecture;
mod backends;
mod chaos;
mod client_tools;
mod cluster;
mod console;
mod continuation;
mod contract;
mod control;
mod hardening;
mod hitl;
mod hooks;
mod limits;
mod llama;
mod mcp;
mod mcp_servers;
mod persistence;
mod queue;
mod replay;
mod runtime;
mod sandbox;
mod schedules;
mod stream;
mod telemetry;
mod tenancy;
mod webhooks;
