//! An agent's pre-tool-use hook (docs/api.md, "Agents"; issue 38): before a tool call the
//! rules did not deny runs, Bedrock POSTs it to the agent's hook, signed as Standard
//! Webhooks sign (HMAC-SHA256 over `id.timestamp.body`), under the node's egress policy
//! (the tenants' MCP servers' client). The hook answers `allow`, `deny` (with a message) or
//! `ask`, and may replace the call's input; the core plans the replaced call again, so its
//! rules still hold. A hook that does not answer in time, cannot be reached, or answers
//! something else decides by its `on_failure`. The decision is stored as a durable
//! `pre_tool_use_decision` system event with the call.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::model::{AgentRef, HookFailure, PreToolUseHook};
use crate::state_machine::{ConvContext, ToolUse};
use crate::webhooks::{hook_key, signature};

/// The most of a hook's answer that is read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// The most of a hook's `message` the LLM is given.
const MAX_MESSAGE_BYTES: usize = 2000;

/// What a tool run needs to ask its conversation's hook.
#[derive(Debug)]
pub struct HookRun {
    pub hook: Arc<PreToolUseHook>,
    /// The conversation's settings, to plan a call whose input the hook replaced.
    pub ctx: ConvContext,
    pub agent: Option<AgentRef>,
}

/// What the hook decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// The call does not run; the LLM gets this reason.
    Deny(String),
    /// The call runs: after a `confirm` request with `approval` (`None`: as the rules and
    /// `require_approval` decided), with `input` when the hook replaced it.
    Run {
        approval: Option<bool>,
        input: Option<Value>,
    },
}

/// Asks the hook about `tool` of `conversation_id`. Returns the verdict and what is
/// stored of it (the decision event's fields).
pub(super) async fn ask(
    client: &crate::egress::Client,
    run: &HookRun,
    conversation_id: &str,
    tool: &ToolUse,
) -> (Verdict, Value) {
    let hook = &run.hook;
    let answer = tokio::time::timeout(
        Duration::from_millis(hook.timeout_ms),
        call(client, run, conversation_id, tool),
    )
    .await
    .unwrap_or_else(|_| Err(format!("no answer within {} ms", hook.timeout_ms)));
    let mut stored = json!({"tool_use_id": tool.id, "tool_name": tool.name});
    let verdict = match answer {
        Ok(verdict) => {
            let (decision, replaced) = match &verdict {
                Verdict::Deny(_) => ("deny", false),
                Verdict::Run { approval, input } => (
                    if *approval == Some(true) {
                        "ask"
                    } else {
                        "allow"
                    },
                    input.is_some(),
                ),
            };
            stored["decision"] = json!(decision);
            stored["input_replaced"] = json!(replaced);
            if let Verdict::Deny(message) = &verdict {
                stored["message"] = json!(message);
            }
            verdict
        }
        Err(why) => {
            tracing::warn!(conversation = %conversation_id, tool = %tool.name, %why, "the pre-tool-use hook failed; its on_failure decides");
            stored["failed"] = json!(why);
            let (decision, verdict) = match hook.on_failure {
                HookFailure::Deny => (
                    "deny",
                    Verdict::Deny(format!(
                        "the pre-tool-use hook failed ({why}); its policy denies the call, so {} did not run",
                        tool.name
                    )),
                ),
                // As if there were no hook: a call the rules or require_approval ask about
                // is still asked about.
                HookFailure::Allow => (
                    "allow",
                    Verdict::Run {
                        approval: None,
                        input: None,
                    },
                ),
                HookFailure::Ask => (
                    "ask",
                    Verdict::Run {
                        approval: Some(true),
                        input: None,
                    },
                ),
            };
            stored["decision"] = json!(decision);
            verdict
        }
    };
    (verdict, stored)
}

async fn call(
    client: &crate::egress::Client,
    run: &HookRun,
    conversation_id: &str,
    tool: &ToolUse,
) -> Result<Verdict, String> {
    let hook = &run.hook;
    let url = url::Url::parse(&hook.url).map_err(|_| "its URL is not a URL".to_owned())?;
    let body = serde_json::to_vec(&json!({
        "type": "pre_tool_use",
        "conversation_id": conversation_id,
        "agent": run.agent.as_ref().map(|agent| json!({"name": agent.name, "version": agent.version})),
        "tool_use_id": tool.id,
        "tool": tool.name,
        "input": tool.input,
    }))
    .map_err(|e| e.to_string())?;
    let key = hook_key(&hook.secret).ok_or("its secret is not valid")?;
    let id = format!("msg_{}", uuid::Uuid::now_v7().simple());
    let timestamp = chrono::Utc::now().timestamp();
    let request = client
        .http()
        .post(url)
        .header("content-type", "application/json")
        .header("webhook-id", &id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature(&key, &id, timestamp, &body))
        .body(body)
        .build()
        .map_err(|e| e.to_string())?;
    let mut response = client.execute(request).await.map_err(|e| {
        format!(
            "it could not be reached: {}",
            crate::egress::Error::to_string(&e)
        )
    })?;
    if !response.status().is_success() {
        return Err(format!("it answered HTTP {}", response.status().as_u16()));
    }
    let mut answer = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
        answer.extend_from_slice(&chunk);
        if answer.len() > MAX_ANSWER_BYTES {
            return Err(format!("its answer is over {MAX_ANSWER_BYTES} bytes"));
        }
    }
    verdict(&answer)
}

/// The verdict of a hook's answer: `{"decision": "allow"|"deny"|"ask", "message"?,
/// "input"?}`.
fn verdict(answer: &[u8]) -> Result<Verdict, String> {
    let answer: Value =
        serde_json::from_slice(answer).map_err(|_| "its answer is not JSON".to_owned())?;
    let input = match answer.get("input") {
        None | Some(Value::Null) => None,
        Some(input @ Value::Object(_)) => Some(input.clone()),
        Some(_) => return Err("its answer's input is not an object".to_owned()),
    };
    match answer.get("decision").and_then(Value::as_str) {
        Some("allow") => Ok(Verdict::Run {
            approval: Some(false),
            input,
        }),
        Some("ask") => Ok(Verdict::Run {
            approval: Some(true),
            input,
        }),
        Some("deny") => {
            let message = answer
                .get("message")
                .and_then(Value::as_str)
                .map(|m| crate::tools::preview(m, MAX_MESSAGE_BYTES).to_owned())
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| "the pre-tool-use hook denied the call".to_owned());
            Ok(Verdict::Deny(message))
        }
        _ => Err("its answer has no decision of allow, deny or ask".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_strictly() {
        assert_eq!(
            verdict(br#"{"decision": "allow"}"#),
            Ok(Verdict::Run {
                approval: Some(false),
                input: None
            })
        );
        assert_eq!(
            verdict(br#"{"decision": "ask", "input": {"command": "ls"}}"#),
            Ok(Verdict::Run {
                approval: Some(true),
                input: Some(json!({"command": "ls"}))
            })
        );
        assert_eq!(
            verdict(br#"{"decision": "deny", "message": "no"}"#),
            Ok(Verdict::Deny("no".into()))
        );
        for bad in [
            &br#"{"decision": "maybe"}"#[..],
            br#"{}"#,
            br#"not json"#,
            br#"{"decision": "allow", "input": "rm -rf /"}"#,
        ] {
            assert!(verdict(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
