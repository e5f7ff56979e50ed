//! Bedrock: a hosted, multi-tenant service that runs LLM agent conversations as supervised
//! actors. See README.md for the codemap and the architecture invariants.

pub mod state_machine;
