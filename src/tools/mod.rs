//! The built-in tools (../shared/tools.md): their definitions for the LLM and how they run.
//!
//! Every tool starts in the conversation's fixed cwd (REQ-BED-010) and reports a
//! [`ToolOutcome`]; a failure is an outcome the LLM sees, never an error of the server.
//! spawn_sub_agents and submit_result are settled by the core and the runtime, not here.

mod bash;
mod beneath;
mod fs;
mod patch;
mod search;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

pub use bash::{BashLimits, BashOutcome, OnLine, run_bash};
pub use fs::{PathError, relative_in};

use crate::sandbox::{Network, Sandbox};
use crate::state_machine::{SPAWN_SUB_AGENTS, SUBMIT_RESULT, ToolOutcome, ToolUse};
use crate::workspace::{Pinned, Workspaces};

/// Between an MCP server's name and its tool's in the name the LLM sees (`server__tool`);
/// a built-in tool's name never holds it.
pub const MCP_SEPARATOR: &str = "__";

/// Name of the tool that asks the user (user conversations only).
pub use crate::state_machine::ASK_USER;

/// A tool the LLM can call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolDefinition {
    pub name: &'static str,
    pub description: &'static str,
    pub parameters: Value,
}

/// What the tools may use: the server's limits, and the network of the run.
#[derive(Clone, Debug)]
pub struct ToolLimits {
    pub bash_timeout: Duration,
    pub bash_max_timeout: Duration,
    pub output_cap_bytes: usize,
    pub max_output_bytes: u64,
    pub search_max_results: usize,
    /// `None`: tools run unconfined (sandbox.mode = "off").
    pub sandbox: Option<Arc<Sandbox>>,
    pub network: Network,
    /// Where conversations' directories are opened.
    pub workspaces: Arc<Workspaces>,
}

impl ToolLimits {
    /// The limits of a bash run with `timeout`.
    pub fn bash(&self, timeout: Duration) -> BashLimits {
        BashLimits {
            timeout,
            output_cap: self.output_cap_bytes,
            max_output: self.max_output_bytes,
            sandbox: self.sandbox.clone(),
            network: self.network,
        }
    }

    /// Who files the server writes into a working directory belong to.
    fn owner(&self) -> Option<(u32, u32)> {
        self.sandbox.as_ref().and_then(|s| s.owner())
    }
}

/// The tools offered to a conversation: sub-agents get submit_result and never
/// spawn_sub_agents (REQ-BED-009).
/// The built-in tools' names, in [`definitions`]' order, made once.
pub fn names(is_sub_agent: bool) -> &'static [&'static str] {
    static NAMES: std::sync::LazyLock<[Vec<&'static str>; 2]> = std::sync::LazyLock::new(|| {
        [false, true].map(|sub| definitions(sub).into_iter().map(|tool| tool.name).collect())
    });
    &NAMES[usize::from(is_sub_agent)]
}

/// Every built-in tool's name, a user conversation's and a sub-agent's, sorted, once each.
pub fn all_names() -> &'static [&'static str] {
    static ALL: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
        let mut all: Vec<&'static str> = names(false).iter().chain(names(true)).copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    });
    &ALL
}

pub fn definitions(is_sub_agent: bool) -> Vec<ToolDefinition> {
    let mut tools = vec![
        ToolDefinition {
            name: "bash",
            description: "Runs a bash command in the conversation's working directory, in its own process group. stdout and stderr are merged and capped; a non-zero exit status is a failed result. `cd` does not persist between calls.",
            parameters: json!({
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command, run with bash -c."},
                    "timeout_ms": {"type": "integer", "minimum": 1, "description": "Kill the command after this many milliseconds."},
                    "background": {"type": "boolean", "description": "Run it as a background task: the call returns at once with a task id, output streams to the user, and the final result arrives later as a system message."},
                    "wake_on_result": {"type": "boolean", "description": "With background: start a new turn when the result arrives and the conversation is idle."},
                },
                "required": ["command"],
            }),
        },
        ToolDefinition {
            name: "patch",
            description: "Edits a file under the working directory: each edit replaces the one occurrence of old_text with new_text, in order. An edit with an empty old_text on a missing file creates it. Paths that leave the working directory are refused.",
            parameters: json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The file, relative to the working directory."},
                    "edits": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "old_text": {"type": "string"},
                                "new_text": {"type": "string"},
                            },
                            "required": ["old_text", "new_text"],
                        },
                    },
                },
                "required": ["path", "edits"],
            }),
        },
        ToolDefinition {
            name: "think",
            description: "Records your reasoning. Does nothing else.",
            parameters: json!({
                "type": "object",
                "properties": {"thoughts": {"type": "string"}},
                "required": ["thoughts"],
            }),
        },
        ToolDefinition {
            name: "keyword_search",
            description: "Finds lines that contain every word of the query (case-insensitive) in files under the working directory, honouring .gitignore. Output: path:line: text.",
            parameters: json!({
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "path": {"type": "string", "description": "A directory or file under the working directory to search in."},
                    "max_results": {"type": "integer", "minimum": 1},
                },
                "required": ["query"],
            }),
        },
    ];
    if is_sub_agent {
        tools.push(ToolDefinition {
            name: SUBMIT_RESULT,
            description: "Ends your task and hands the result to the conversation that started you. Call it exactly once, when you are done.",
            parameters: json!({
                "type": "object",
                "properties": {
                    "result": {"type": "string", "description": "The result, complete on its own."},
                    "success": {"type": "boolean", "description": "false if you could not do the task."},
                },
                "required": ["result"],
            }),
        });
    } else {
        tools.push(ToolDefinition {
            name: ASK_USER,
            description: "Asks the user a question and waits for the answer (or its timeout). kind confirm: a yes/no question; prompt: free text; select: one of the options.",
            parameters: json!({
                "type": "object",
                "properties": {
                    "question": {"type": "string"},
                    "kind": {"type": "string", "enum": ["confirm", "prompt", "select", "custom"]},
                    "options": {"type": "array", "items": {"type": "string"}, "description": "For select."},
                    "type_name": {"type": "string", "description": "For custom: what the client should show."},
                    "schema": {"type": "object", "description": "For custom: a JSON Schema of the expected answer."},
                    "timeout_ms": {"type": "integer", "minimum": 1},
                },
                "required": ["question", "kind"],
            }),
        });
        tools.push(ToolDefinition {
            name: SPAWN_SUB_AGENTS,
            description: "Starts one sub-agent per task, in parallel, in the same working directory. Each works independently and submits a result; the result of this tool is the list of {agent_id, success, result} in task order.",
            parameters: json!({
                "type": "object",
                "properties": {
                    "tasks": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "prompt": {"type": "string"},
                                "model": {"type": "string"},
                                "max_steps": {"type": "integer", "minimum": 1, "description": "LLM steps the sub-agent may take before it must submit (at most the server's limit, which is also the default)."},
                                "timeout_ms": {"type": "integer", "minimum": 1, "description": "Wall time before it must submit (at most the server's limit, which is also the default)."},
                            },
                            "required": ["prompt"],
                        },
                    },
                },
                "required": ["tasks"],
            }),
        });
    }
    tools
}

/// Opens a conversation's stored working directory for one tool run: the run works in the
/// directory found now, beneath the workspace root through no link; one a tool replaced by a
/// link is a failed result that says so.
pub fn pin(cwd: &Path, limits: &ToolLimits) -> Result<Pinned, ToolOutcome> {
    limits
        .workspaces
        .pin(cwd)
        .map_err(|e| failed(e.to_string()))
}

/// Runs one tool in `cwd` until it finishes, times out or `cancel` fires.
pub async fn run(
    tool: &ToolUse,
    cwd: PathBuf,
    limits: &ToolLimits,
    cancel: CancellationToken,
) -> ToolOutcome {
    if crate::state_machine::WORKSPACE_TOOLS.contains(&tool.name.as_str()) {
        match pin(&cwd, limits) {
            Ok(pinned) => run_in(tool, &pinned, limits, cancel).await,
            Err(refused) => refused,
        }
    } else {
        run_in_nowhere(tool)
    }
}

/// A tool that touches no file.
fn run_in_nowhere(tool: &ToolUse) -> ToolOutcome {
    let Some(input) = tool.input.as_object() else {
        return not_an_object(tool);
    };
    match tool.name.as_str() {
        "think" => match input.get("thoughts").and_then(Value::as_str) {
            Some(_) => ToolOutcome {
                ok: true,
                output: "ok".into(),
            },
            None => failed("invalid arguments: `thoughts` must be a string"),
        },
        other => failed(format!("unknown tool `{other}`")),
    }
}

fn not_an_object(tool: &ToolUse) -> ToolOutcome {
    failed(format!(
        "invalid arguments: expected a JSON object, got {}",
        preview(&tool.input.to_string(), 200)
    ))
}

/// Runs a tool that works in the directory `cwd` was opened as.
async fn run_in(
    tool: &ToolUse,
    cwd: &Pinned,
    limits: &ToolLimits,
    cancel: CancellationToken,
) -> ToolOutcome {
    let Some(input) = tool.input.as_object() else {
        return not_an_object(tool);
    };
    match tool.name.as_str() {
        "bash" => {
            let Some(command) = input.get("command").and_then(Value::as_str) else {
                return failed("invalid arguments: `command` must be a string");
            };
            let timeout = match input.get("timeout_ms") {
                None | Some(Value::Null) => limits.bash_timeout,
                Some(value) => match value.as_u64().filter(|ms| *ms > 0) {
                    Some(ms) => Duration::from_millis(ms).min(limits.bash_max_timeout),
                    None => {
                        return failed(
                            "invalid arguments: `timeout_ms` must be a positive integer",
                        );
                    }
                },
            };
            run_bash(command, cwd, &limits.bash(timeout), cancel, None)
                .await
                .into_outcome()
        }
        "patch" => {
            let (input, cwd) = (input.clone(), cwd.clone());
            let owner = limits.owner();
            blocking(move || patch::apply(&cwd, &input, owner)).await
        }
        "keyword_search" => {
            let (input, cwd) = (input.clone(), cwd.clone());
            let max = limits.search_max_results;
            let cap = limits.output_cap_bytes;
            blocking(move || search::search(&cwd, &input, max, cap)).await
        }
        other => failed(format!("unknown tool `{other}`")),
    }
}

async fn blocking(work: impl FnOnce() -> ToolOutcome + Send + 'static) -> ToolOutcome {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| failed(format!("the tool crashed: {e}")))
}

pub(crate) fn failed(output: impl Into<String>) -> ToolOutcome {
    ToolOutcome::failed(output)
}

/// `output` cut to `cap` bytes (on a character boundary), saying so at its end.
pub(crate) fn cap_output(mut output: String, cap: usize) -> String {
    if output.len() > cap {
        let total = output.len();
        output.truncate(preview(&output, cap).len());
        output.push_str(&format!("\n[output truncated: {total} bytes, {cap} kept]"));
    }
    output
}

/// At most `max` bytes of `text`, cut on a character boundary.
pub(crate) fn preview(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Runs a trivial command through the sandbox (with each network setting in use) and fails,
/// with the reason, unless it works: the kernel may refuse a step the checks above cannot see.
pub async fn sandbox_self_test(
    sandbox: &Arc<Sandbox>,
    settings: &crate::config::Settings,
) -> Result<(), crate::sandbox::SandboxError> {
    use crate::sandbox::SandboxError;
    let cwd = settings.sandbox.dir(&settings.data).join("self-test");
    std::fs::create_dir_all(&cwd)
        .map_err(|e| SandboxError(format!("cannot create {}: {e}", cwd.display())))?;
    let cwd = Pinned::trusted(&cwd)
        .map_err(|e| SandboxError(format!("cannot open {}: {e}", cwd.display())))?;
    let mut networks = vec![Network::Off];
    if !settings.sandbox.network.tenants.is_empty()
        || !settings.sandbox.network.per_conversation_tenants.is_empty()
    {
        networks.push(Network::On);
    }
    for network in networks {
        let limits = BashLimits {
            timeout: Duration::from_secs(30),
            output_cap: 4096,
            max_output: 4096,
            sandbox: Some(sandbox.clone()),
            network,
        };
        let outcome = run_bash(
            "echo sandbox-ok",
            &cwd,
            &limits,
            CancellationToken::new(),
            None,
        )
        .await;
        if !outcome.ok() || outcome.output.trim() != "sandbox-ok" {
            return Err(SandboxError(format!(
                "the self-test (network {network:?}) failed: {}",
                outcome.into_outcome().output.trim()
            )));
        }
    }
    Ok(())
}
