//! Permission rules (issue 38): an agent's ordered list of what its conversations' tool
//! calls may do. The first rule that matches a call decides it: `allow` runs it (no approval
//! asked), `deny` refuses it without running (its result says why), `ask` asks the client
//! first (a `confirm` request, as `require_approval` does). A call no rule matches is
//! decided as before rules: approval exactly when `require_approval` names its tool.
//!
//! A rule's `tool` is a pattern of the tool's name (`*` any run of characters, `?` one):
//! built-in tools, MCP tools (`server__*`) and client tools alike. Its `input` names string
//! fields of the call's input, each with a pattern the field's whole value must match. A
//! field that is absent matches no rule; one that is present and not a string (a list, an
//! object: what a model may send to dodge a pattern) matches every `deny` and `ask` rule
//! that names it and no `allow` rule: the rules fail closed.
//!
//! Patterns match text, not meaning (`./x` and `x` are two paths to them): they are a
//! policy, not a sandbox. The sandbox confines what a call that runs can do.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use wildmatch::WildMatch;

/// What a rule does with a call it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PermissionAction {
    Allow,
    Deny,
    Ask,
}

/// One rule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionRule {
    /// A pattern of tool names.
    pub tool: String,
    /// String fields of the input and the pattern each must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub input: BTreeMap<String, String>,
    pub action: PermissionAction,
    /// With `deny`: what the LLM is told (default: that the rules deny it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl PermissionRule {
    /// Whether the rule applies to a call of `tool` with `input`.
    pub fn matches(&self, tool: &str, input: &Value) -> bool {
        WildMatch::new(&self.tool).matches(tool)
            && self
                .input
                .iter()
                .all(|(field, pattern)| match input.get(field) {
                    None => false,
                    Some(Value::String(value)) => WildMatch::new(pattern).matches(value),
                    Some(_) => self.action != PermissionAction::Allow,
                })
    }
}

/// How the rules decide a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Permission {
    /// No rule matched: `require_approval` decides.
    Unruled,
    /// Run it without asking.
    Allowed,
    /// Ask the client first.
    Ask,
    /// Refuse it; the result the LLM gets.
    Denied(String),
}

/// The first of `rules` that matches a call of `tool` with `input` decides it.
pub fn decide(rules: &[PermissionRule], tool: &str, input: &Value) -> Permission {
    match rules.iter().find(|rule| rule.matches(tool, input)) {
        None => Permission::Unruled,
        Some(rule) => match rule.action {
            PermissionAction::Allow => Permission::Allowed,
            PermissionAction::Ask => Permission::Ask,
            PermissionAction::Deny => {
                Permission::Denied(rule.message.clone().unwrap_or_else(|| {
                    format!("the agent's permission rules deny this call of {tool}; it did not run")
                }))
            }
        },
    }
}
