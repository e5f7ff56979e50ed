//! The rule LLM APIs impose on a history: every tool_use is answered by exactly one
//! tool_result, right after the agent message that asked for it, in the same order.
//!
//! The property tests check every history the core produces against it, and the runtime
//! can check a history before it sends one.

use super::message::MessageContent;

/// How a history breaks the tool_use / tool_result rule.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("message {index}: a tool result for {tool_use_id} that no open tool_use asked for")]
    UnexpectedResult { index: usize, tool_use_id: String },
    #[error(
        "message {index}: tool_use {tool_use_id} is still unanswered when a {found} message comes"
    )]
    Unanswered {
        index: usize,
        tool_use_id: String,
        found: &'static str,
    },
    #[error("tool_use {tool_use_id} is never answered")]
    Dangling { tool_use_id: String },
}

/// Checks `messages` (in sequence order). With `allow_open_tail`, the last agent message may
/// still have unanswered tool uses (a turn in progress).
pub fn validate_chain<'a>(
    messages: impl IntoIterator<Item = &'a MessageContent>,
    allow_open_tail: bool,
) -> Result<(), ChainError> {
    // Tool uses of the last agent message that still wait for their result, in order.
    let mut open: std::collections::VecDeque<&str> = Default::default();
    for (index, message) in messages.into_iter().enumerate() {
        match message {
            MessageContent::Tool(result) => match open.pop_front() {
                Some(expected) if expected == result.tool_use_id => {}
                Some(_) | None => {
                    return Err(ChainError::UnexpectedResult {
                        index,
                        tool_use_id: result.tool_use_id.clone(),
                    });
                }
            },
            other @ (MessageContent::User { .. }
            | MessageContent::Agent { .. }
            | MessageContent::System { .. }
            | MessageContent::Error { .. }) => {
                if let Some(id) = open.front() {
                    return Err(ChainError::Unanswered {
                        index,
                        tool_use_id: (*id).to_owned(),
                        found: other.message_type().as_str(),
                    });
                }
                if let MessageContent::Agent { tool_uses, .. } = other {
                    open.extend(tool_uses.iter().map(|tool| tool.id.as_str()));
                }
            }
        }
    }
    match open.front() {
        Some(id) if !allow_open_tail => Err(ChainError::Dangling {
            tool_use_id: (*id).to_owned(),
        }),
        Some(_) | None => Ok(()),
    }
}

/// The lengths at which `messages` may be cut, as a fork does, ascending: the prefixes of
/// these lengths are valid chains with no tool_use left unanswered (0, the empty history,
/// always is). One pass; a broken chain has no point after its break.
pub fn fork_points(messages: &[MessageContent]) -> Vec<usize> {
    let mut points = vec![0];
    let mut open: std::collections::VecDeque<&str> = Default::default();
    for (index, message) in messages.iter().enumerate() {
        match message {
            MessageContent::Tool(result) => match open.pop_front() {
                Some(expected) if expected == result.tool_use_id => {}
                Some(_) | None => break,
            },
            other @ (MessageContent::User { .. }
            | MessageContent::Agent { .. }
            | MessageContent::System { .. }
            | MessageContent::Error { .. }) => {
                if !open.is_empty() {
                    break;
                }
                if let MessageContent::Agent { tool_uses, .. } = other {
                    open.extend(tool_uses.iter().map(|tool| tool.id.as_str()));
                }
            }
        }
        if open.is_empty() {
            points.push(index + 1);
        }
    }
    points
}

/// Whether a history may be cut after its first `n` messages (see [`fork_points`]).
pub fn is_fork_point(messages: &[MessageContent], n: usize) -> bool {
    fork_points(messages).contains(&n)
}

/// The longest prefix of `messages` at which it may be cut (see [`fork_points`]): a stored
/// history with a turn in progress ends before that turn's open tool calls.
pub fn last_fork_point(messages: &[MessageContent]) -> usize {
    fork_points(messages).last().copied().unwrap_or(0)
}
