//! A user turn's tracing: its span (the parent of its transitions, LLM requests and tool
//! runs), the span of each transition and of its commit, and the turn's end in the metrics.

use opentelemetry::trace::TraceContextExt as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::metrics::Metrics;
use crate::model::{ConversationCommit, ConversationRecord};
use crate::state_machine::ConvState;

/// A user turn in progress: its trace span and when it started.
#[derive(Debug)]
pub(super) struct Turn {
    pub(super) span: tracing::Span,
    started: std::time::Instant,
}

impl Turn {
    /// A turn of `conv` starts now, in a trace of its own.
    pub(super) fn start(conv: &ConversationRecord) -> Turn {
        let span = tracing::info_span!(
            parent: None,
            "conversation.turn",
            tenant = %conv.tenant_id,
            conversation = %conv.id,
            model = %conv.model,
            outcome = tracing::field::Empty,
            trace_id = tracing::field::Empty,
        );
        // Log lines of the turn carry its trace id, so a log line leads to its trace.
        let context = span.context().span().span_context().clone();
        if context.is_valid() {
            span.record("trace_id", context.trace_id().to_string());
        }
        Turn {
            span,
            started: std::time::Instant::now(),
        }
    }

    /// Records the turn's end: its outcome on its span and in the metrics.
    pub(super) fn finish(self, metrics: &Metrics, outcome: &'static str) {
        metrics.turn_finished(outcome, self.started.elapsed().as_secs_f64());
        self.span.record("outcome", outcome);
        tracing::info!(parent: &self.span, outcome, "turn finished");
    }
}

/// The span of storing `commit`: a child of its transition's, itself a child of the turn's
/// (when one runs).
pub(super) fn commit_span(
    turn: Option<&Turn>,
    conv: &ConversationRecord,
    commit: &ConversationCommit,
) -> tracing::Span {
    let from = conv.state.kind();
    let transition = tracing::info_span!(
        target: crate::telemetry::STEP,
        parent: turn.and_then(|turn| turn.span.id()),
        "conversation.transition",
        tenant = %conv.tenant_id,
        conversation = %conv.id,
        from,
        to = commit.state.as_ref().map_or(from, ConvState::kind),
    );
    tracing::info_span!(
        target: crate::telemetry::STEP,
        parent: &transition,
        "persistence.commit",
        conversation = %conv.id,
        messages = commit.messages.len(),
        events = commit.events.len(),
    )
}
