//! The scripted OpenAI-compatible fake LLM as a process, for tools that drive a real
//! server from outside. By default (tests/schemathesis.sh) it answers every request: a tool
//! result with text, anything else with a `think` tool call, so turns end after one tool.
//! With `--follow` (the console's browser tests, tests/console) turns do what their user
//! message says: `call <tool> <JSON args>`, `slowly <text>`, `flaky <text>`, or anything else for a short
//! answer (`FakeLlm::follow_instructions`).
//! Prints its base URL (for BEDROCK_LLM_BASE_URL) on the first line, then serves until
//! killed.
//!
//!     cargo run --example fake_llm [-- --follow]

#![allow(clippy::print_stdout)]

use std::io::Write as _;

#[tokio::main]
async fn main() {
    let llm = bedrock::testkit::FakeLlm::start().await;
    llm.forget_requests();
    if std::env::args().any(|a| a == "--follow") {
        llm.follow_instructions();
    } else {
        llm.auto_tool_turns("think", serde_json::json!({"thoughts": "one tool call"}));
    }
    println!("{}", llm.base_url);
    let _ = std::io::stdout().flush();
    std::future::pending::<()>().await;
}
