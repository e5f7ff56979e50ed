//! Metrics as OpenTelemetry instruments: exported over OTLP when configured, and readable at
//! GET /metrics on the operator listener (`[metrics] listen`) in the Prometheus text format.
//!
//! Names are chosen so the Prometheus names are `bedrock_*` (counters get `_total`,
//! instruments in seconds `_seconds`).

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, MeterProvider as _, UpDownCounter};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use prometheus::{Encoder, TextEncoder};

/// Bucket bounds for durations in seconds: 0.5 ms to about 65 s.
fn second_bounds() -> Vec<f64> {
    (0..18).map(|i| 0.0005 * 2f64.powi(i)).collect()
}

/// Every metric of the service.
#[derive(Debug)]
pub struct Metrics {
    registry: prometheus::Registry,
    provider: SdkMeterProvider,
    turns_started: Counter<u64>,
    turns_finished: Counter<u64>,
    turn_duration: Histogram<f64>,
    llm_requests: Counter<u64>,
    llm_duration: Histogram<f64>,
    retries: Counter<u64>,
    history_reads: Counter<u64>,
    chunks_skipped: Counter<u64>,
    tokens: Counter<u64>,
    budget_used: Gauge<u64>,
    rejections: Counter<u64>,
    tool_runs: Counter<u64>,
    cancel_latency: Histogram<f64>,
    commit_latency: Histogram<f64>,
    commit_batch: Histogram<u64>,
    websocket_connections: UpDownCounter<i64>,
    http_connections: UpDownCounter<i64>,
    connections_refused: Counter<u64>,
    connections_closed: Counter<u64>,
    conversations_active: UpDownCounter<i64>,
    conversations_running: Gauge<i64>,
    db_pool_connections: Gauge<u64>,
    tasks_alive: Gauge<u64>,
    webhook_attempts: Counter<u64>,
    webhook_latency: Histogram<f64>,
    webhook_backlog: Gauge<u64>,
    schedule_firings: Counter<u64>,
    schedule_lag: Histogram<f64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(None, opentelemetry_sdk::Resource::builder_empty().build())
    }
}

fn build(meter: &Meter, registry: prometheus::Registry, provider: SdkMeterProvider) -> Metrics {
    Metrics {
        turns_started: meter
            .u64_counter("bedrock.turns_started")
            .with_description("User turns started")
            .build(),
        turns_finished: meter
            .u64_counter("bedrock.turns_finished")
            .with_description("User turns finished, by the state they ended in")
            .build(),
        turn_duration: meter
            .f64_histogram("bedrock.turn_duration")
            .with_unit("s")
            .with_description("User turn duration, from the message to the end of the turn")
            .with_boundaries(second_bounds())
            .build(),
        llm_requests: meter
            .u64_counter("bedrock.llm_requests")
            .with_description("LLM requests, by outcome (ok, an error kind, aborted)")
            .build(),
        llm_duration: meter
            .f64_histogram("bedrock.llm_request_duration")
            .with_unit("s")
            .with_description("LLM request duration")
            .with_boundaries(second_bounds())
            .build(),
        webhook_attempts: meter
            .u64_counter("bedrock.webhook_attempts")
            .with_description(
                "Webhook delivery attempts, by outcome (delivered, retry, failed, refused)",
            )
            .build(),
        webhook_latency: meter
            .f64_histogram("bedrock.webhook_attempt_duration")
            .with_unit("s")
            .with_description("A webhook delivery attempt's time, to its answer or failure")
            .with_boundaries(second_bounds())
            .build(),
        webhook_backlog: meter
            .u64_gauge("bedrock.webhook_backlog")
            .with_description(
                "Webhook events waiting: in the outbox (stage=outbox) and deliveries not yet \
                 made (stage=pending)",
            )
            .build(),
        schedule_firings: meter
            .u64_counter("bedrock.schedule_firings")
            .with_description(
                "Schedules' firings, by outcome (started, queued, skipped, missed, failed)",
            )
            .build(),
        schedule_lag: meter
            .f64_histogram("bedrock.schedule_lag")
            .with_unit("s")
            .with_description("From a firing's time to the start of its work")
            .with_boundaries(second_bounds())
            .build(),
        retries: meter
            .u64_counter("bedrock.llm_retries")
            .with_description("LLM retries scheduled")
            .build(),
        chunks_skipped: meter
            .u64_counter("bedrock.llm_chunks_skipped")
            .with_description(
                "Chunks of LLM streams that could not be read at all and were skipped (the \
                 reply goes on without them)",
            )
            .build(),
        history_reads: meter
            .u64_counter("bedrock.history_reads")
            .with_description(
                "LLM requests whose history was read from the database (a cold cache, or \
                 messages the conversation did not hand over)",
            )
            .build(),
        tokens: meter
            .u64_counter("bedrock.tokens")
            .with_description("Tokens by tenant, model and direction (input/output)")
            .build(),
        budget_used: meter
            .u64_gauge("bedrock.budget_used_tokens")
            .with_description("Tokens of its budget a tenant has used this period, by tenant")
            .build(),
        rejections: meter
            .u64_counter("bedrock.rejections")
            .with_description("Requests refused by a limit, by reason (rate_limited, budget)")
            .build(),
        tool_runs: meter
            .u64_counter("bedrock.tool_runs")
            .with_description("Tool runs by tool and outcome")
            .build(),
        cancel_latency: meter
            .f64_histogram("bedrock.cancel_latency")
            .with_unit("s")
            .with_description("From the cancel call to the stored idle state")
            .with_boundaries(second_bounds())
            .build(),
        commit_latency: meter
            .f64_histogram("bedrock.commit_latency")
            .with_unit("s")
            .with_description("Persistence commit latency (one group commit)")
            .with_boundaries(second_bounds())
            .build(),
        commit_batch: meter
            .u64_histogram("bedrock.commit_batch_size")
            .with_description("Transitions written per transaction")
            .with_boundaries((0..11).map(|i| f64::from(1u32 << i)).collect())
            .build(),
        websocket_connections: meter
            .i64_up_down_counter("bedrock.websocket_connections")
            .with_description("Open WebSocket connections")
            .build(),
        http_connections: meter
            .i64_up_down_counter("bedrock.http_connections")
            .with_description("Open client connections (WebSockets and streams included)")
            .build(),
        connections_refused: meter
            .u64_counter("bedrock.connections_refused")
            .with_description(
                "Connections closed at accept, by listener and reason (max_connections: over \
                 the connection cap)",
            )
            .build(),
        connections_closed: meter
            .u64_counter("bedrock.connections_timed_out")
            .with_description(
                "Connections closed by the server for slowness, by listener and reason \
                 (header_timeout, idle)",
            )
            .build(),
        conversations_active: meter
            .i64_up_down_counter("bedrock.conversations_active")
            .with_description("Conversations with a running actor, by state")
            .build(),
        conversations_running: meter
            .i64_gauge("bedrock.conversations_running")
            .with_description("Conversations with a running actor")
            .build(),
        tasks_alive: meter
            .u64_gauge("bedrock.runtime_tasks_alive")
            .with_description("Tasks alive in the async runtime (a leak shows as growth)")
            .build(),
        db_pool_connections: meter
            .u64_gauge("bedrock.db_pool_connections")
            .with_description("Connections in the database pool")
            .build(),
        registry,
        provider,
    }
}

impl Metrics {
    /// The instruments, read for /metrics and, with an exporter, pushed over OTLP with
    /// `resource` (the process's: telemetry::resource).
    pub fn new(
        otlp: Option<opentelemetry_otlp::MetricExporter>,
        resource: opentelemetry_sdk::Resource,
    ) -> Metrics {
        let registry = prometheus::Registry::new();
        let mut builder = SdkMeterProvider::builder().with_resource(resource);
        match opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .build()
        {
            Ok(reader) => builder = builder.with_reader(reader),
            Err(e) => {
                tracing::error!(%e, "the Prometheus exporter could not start; /metrics will be empty")
            }
        }
        if let Some(exporter) = otlp {
            builder = builder.with_reader(PeriodicReader::builder(exporter).build());
        }
        let provider = builder.build();
        let meter = provider.meter("bedrock");
        build(&meter, registry, provider)
    }

    pub fn turn_started(&self) {
        self.turns_started.add(1, &[]);
    }

    pub fn turn_finished(&self, outcome: &'static str, seconds: f64) {
        let attributes = [KeyValue::new("outcome", outcome)];
        self.turns_finished.add(1, &attributes);
        self.turn_duration.record(seconds, &attributes);
    }

    pub fn llm_request(&self, outcome: &'static str, seconds: f64) {
        self.llm_requests
            .add(1, &[KeyValue::new("outcome", outcome)]);
        self.llm_duration.record(seconds, &[]);
    }

    pub fn llm_chunk_skipped(&self) {
        self.chunks_skipped.add(1, &[]);
    }

    pub fn history_read(&self) {
        self.history_reads.add(1, &[]);
    }

    /// A webhook delivery attempt's outcome and time.
    pub fn webhook_attempt(&self, outcome: &'static str, seconds: f64) {
        self.webhook_attempts
            .add(1, &[KeyValue::new("outcome", outcome)]);
        self.webhook_latency.record(seconds, &[]);
    }

    /// Webhook events waiting in the outbox, and deliveries pending.
    pub fn webhook_backlog(&self, outbox: u64, pending: u64) {
        self.webhook_backlog
            .record(outbox, &[KeyValue::new("stage", "outbox")]);
        self.webhook_backlog
            .record(pending, &[KeyValue::new("stage", "pending")]);
    }

    /// A schedule's firing: its outcome and how late its work started.
    pub fn schedule_firing(&self, outcome: &'static str, lag_seconds: f64) {
        self.schedule_firings
            .add(1, &[KeyValue::new("outcome", outcome)]);
        if outcome != "missed" {
            self.schedule_lag.record(lag_seconds.max(0.0), &[]);
        }
    }

    pub fn retry(&self) {
        self.retries.add(1, &[]);
    }

    pub fn tokens(&self, tenant: &str, model: &str, direction: &'static str, tokens: u64) {
        self.tokens.add(
            tokens,
            &[
                KeyValue::new("tenant", tenant.to_owned()),
                KeyValue::new("model", model.to_owned()),
                KeyValue::new("direction", direction),
            ],
        );
    }

    /// A tenant's budget as last seen: its tokens used this period.
    pub fn budget_used(&self, tenant: &str, used: u64) {
        self.budget_used
            .record(used, &[KeyValue::new("tenant", tenant.to_owned())]);
    }

    /// A request refused by a limit (`rate_limited`, `budget`).
    pub fn rejected(&self, reason: &'static str) {
        self.rejections.add(1, &[KeyValue::new("reason", reason)]);
    }

    /// A tool run, labelled by the built-in tool's name; tenants' MCP tools (names a tenant
    /// chose) and unknown names are `mcp` and `other`, so that no tenant's names reach the
    /// metrics and their number stays bounded.
    pub fn tool_run(&self, tool: &str, ok: bool) {
        const BUILT_IN: [&str; 7] = [
            "bash",
            "patch",
            "think",
            "keyword_search",
            "ask_user",
            "spawn_sub_agents",
            "submit_result",
        ];
        let label = if BUILT_IN.contains(&tool) {
            tool
        } else if tool.contains(crate::tools::MCP_SEPARATOR) {
            "mcp"
        } else {
            "other"
        };
        self.tool_runs.add(
            1,
            &[
                KeyValue::new("tool", label.to_owned()),
                KeyValue::new("outcome", if ok { "ok" } else { "failed" }),
            ],
        );
    }

    pub fn cancel_latency(&self, seconds: f64) {
        self.cancel_latency.record(seconds, &[]);
    }

    pub fn commit(&self, seconds: f64, batch: usize) {
        self.commit_latency.record(seconds, &[]);
        self.commit_batch.record(batch as u64, &[]);
    }

    pub fn websocket(&self, opened: bool) {
        self.websocket_connections
            .add(if opened { 1 } else { -1 }, &[]);
    }

    /// A client connection opened or closed.
    pub fn connection(&self, opened: bool) {
        self.http_connections.add(if opened { 1 } else { -1 }, &[]);
    }

    /// A connection closed at accept (`reason`: `max_connections`).
    pub fn connection_refused(&self, listener: &'static str, reason: &'static str) {
        self.connections_refused.add(
            1,
            &[
                KeyValue::new("listener", listener),
                KeyValue::new("reason", reason),
            ],
        );
    }

    /// A connection closed for slowness (`reason`: `header_timeout`, `idle`).
    pub fn connection_closed(&self, listener: &'static str, reason: &'static str) {
        self.connections_closed.add(
            1,
            &[
                KeyValue::new("listener", listener),
                KeyValue::new("reason", reason),
            ],
        );
    }

    /// A conversation actor moved from state `from` to state `to` (`None`: started/stopped).
    pub fn conversation_state(&self, from: Option<&'static str>, to: Option<&'static str>) {
        if let Some(from) = from {
            self.conversations_active
                .add(-1, &[KeyValue::new("state", from)]);
        }
        if let Some(to) = to {
            self.conversations_active
                .add(1, &[KeyValue::new("state", to)]);
        }
    }

    /// Refreshes the gauges read at scrape time.
    pub fn gauges(&self, running: usize, pool: u32) {
        self.conversations_running
            .record(i64::try_from(running).unwrap_or(i64::MAX), &[]);
        self.db_pool_connections.record(u64::from(pool), &[]);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let alive = runtime.metrics().num_alive_tasks();
            self.tasks_alive
                .record(u64::try_from(alive).unwrap_or(u64::MAX), &[]);
        }
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(%e, "metrics encoding failed");
        }
        String::from_utf8(out).unwrap_or_default()
    }

    /// Pushes what is left to the OTLP exporter, if any.
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown();
    }
}
