//! Metrics, exposed at GET /metrics in the Prometheus text format.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ToolLabels {
    pub tool: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    pub tenant: String,
    pub model: String,
    pub direction: String,
}

/// Every metric of the service.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub turns_started: Counter,
    pub turns_finished: Family<OutcomeLabel, Counter>,
    pub llm_requests: Family<OutcomeLabel, Counter>,
    pub llm_duration: Histogram,
    pub retries: Counter,
    pub tokens: Family<TokenLabels, Counter>,
    pub tool_runs: Family<ToolLabels, Counter>,
    pub cancel_latency: Histogram,
    pub commit_latency: Histogram,
    pub commit_batch: Histogram,
    pub websocket_connections: Gauge,
    pub conversations_active: Family<StateLabel, Gauge>,
    pub conversations_running: Gauge,
    pub db_pool_connections: Gauge,
}

fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("bedrock");
        let metrics = Metrics {
            turns_started: Counter::default(),
            turns_finished: Family::default(),
            llm_requests: Family::default(),
            llm_duration: seconds(),
            retries: Counter::default(),
            tokens: Family::default(),
            tool_runs: Family::default(),
            cancel_latency: seconds(),
            commit_latency: seconds(),
            commit_batch: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            websocket_connections: Gauge::default(),
            conversations_active: Family::default(),
            conversations_running: Gauge::default(),
            db_pool_connections: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "turns_started",
            "User turns started",
            metrics.turns_started.clone(),
        );
        registry.register(
            "turns_finished",
            "User turns finished, by the state they ended in",
            metrics.turns_finished.clone(),
        );
        registry.register(
            "llm_requests",
            "LLM requests, by outcome (ok or error kind)",
            metrics.llm_requests.clone(),
        );
        registry.register(
            "llm_request_duration_seconds",
            "LLM request duration",
            metrics.llm_duration.clone(),
        );
        registry.register(
            "llm_retries",
            "LLM retries scheduled",
            metrics.retries.clone(),
        );
        registry.register(
            "tokens",
            "Tokens by tenant, model and direction (input/output)",
            metrics.tokens.clone(),
        );
        registry.register(
            "tool_runs",
            "Tool runs by tool and outcome",
            metrics.tool_runs.clone(),
        );
        registry.register(
            "cancel_latency_seconds",
            "From the cancel call to the stored idle state",
            metrics.cancel_latency.clone(),
        );
        registry.register(
            "commit_latency_seconds",
            "Persistence commit latency (group commit)",
            metrics.commit_latency.clone(),
        );
        registry.register(
            "commit_batch_size",
            "Transitions written per transaction",
            metrics.commit_batch.clone(),
        );
        registry.register(
            "websocket_connections",
            "Open WebSocket connections",
            metrics.websocket_connections.clone(),
        );
        registry.register(
            "conversations_active",
            "Conversations with a running actor, by state",
            metrics.conversations_active.clone(),
        );
        registry.register(
            "conversations_running",
            "Conversations with a running actor",
            metrics.conversations_running.clone(),
        );
        registry.register(
            "db_pool_connections",
            "Connections in the database pool",
            metrics.db_pool_connections.clone(),
        );
        Metrics {
            registry,
            ..metrics
        }
    }
}

impl Metrics {
    /// A conversation actor moved from state `from` to state `to` (`None`: started/stopped).
    pub fn conversation_state(&self, from: Option<&str>, to: Option<&str>) {
        if let Some(from) = from {
            self.conversations_active
                .get_or_create(&StateLabel {
                    state: from.to_owned(),
                })
                .dec();
        }
        if let Some(to) = to {
            self.conversations_active
                .get_or_create(&StateLabel {
                    state: to.to_owned(),
                })
                .inc();
        }
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(%e, "metrics encoding failed");
        }
        out
    }
}
