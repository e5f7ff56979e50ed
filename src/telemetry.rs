//! Logs and traces. Logs go to stderr (JSON with BEDROCK_LOG_FORMAT=json); spans (a turn, its
//! LLM requests, tool runs and commits, with tenant and conversation attributes) are exported
//! over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set,
//! honouring the standard OTEL_* variables. Without them nothing is exported or buffered.

use std::sync::Arc;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::resource::{EnvResourceDetector, TelemetryResourceDetector};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::metrics::Metrics;

/// Keeps the exporters alive; `shutdown` flushes what is buffered.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    metrics: Arc<Metrics>,
}

impl Telemetry {
    /// The metrics: read at /metrics, and pushed over OTLP when that is configured.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Flushes and stops the exporters.
    pub fn shutdown(self) {
        self.metrics.shutdown();
        if let Some(provider) = self.provider
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(%e, "the trace exporter did not shut down cleanly");
        }
    }
}

/// The signals OTLP export can carry.
#[derive(Clone, Copy, Debug)]
enum Signal {
    Traces,
    Metrics,
}

/// Whether the process environment asks for OTLP export of `signal`: an endpoint for all
/// signals or for this one, the SDK not disabled, and the signal's exporter not `none`.
fn otlp_configured(signal: Signal) -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.is_empty());
    let (endpoint, exporter) = match signal {
        Signal::Traces => ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"),
        Signal::Metrics => (
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_METRICS_EXPORTER",
        ),
    };
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set(endpoint))
        && std::env::var("OTEL_SDK_DISABLED").map_or(true, |v| v != "true")
        && std::env::var(exporter).map_or(true, |v| v != "none")
}

/// What every span and metric of this process says of it: `service.name` (from
/// OTEL_SERVICE_NAME, else a `service.name` in OTEL_RESOURCE_ATTRIBUTES, else `bedrock`),
/// `service.version`, `service.instance.id` (`instance_id`), the SDK's own attributes, and
/// whatever OTEL_RESOURCE_ATTRIBUTES adds. The standard variables win over the defaults.
pub fn resource(instance_id: &str) -> Resource {
    let defaults = [
        KeyValue::new("service.name", "bedrock"),
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::new("service.instance.id", instance_id.to_owned()),
    ];
    let builder = Resource::builder_empty()
        .with_attributes(defaults)
        .with_detectors(&[
            Box::new(TelemetryResourceDetector),
            Box::new(EnvResourceDetector::new()),
        ]);
    match std::env::var("OTEL_SERVICE_NAME") {
        Ok(name) if !name.is_empty() => builder.with_service_name(name),
        _ => builder,
    }
    .build()
}

/// The target of the spans of a turn's steps (its transitions, commits, LLM requests and
/// tool runs) and of a webhook's deliveries: traced (exported over OTLP with their
/// attributes), but not given to the log layer, which would format each one's fields (and
/// format them again at each field recorded later) for the context of lines that are rarely
/// logged within them. A line logged within one carries the turn's span (tenant,
/// conversation, trace id) instead; a delivery's failure line names its webhook, event and
/// delivery itself.
pub const STEP: &str = "bedrock::step";

/// What the log layer sees: every event its level lets through, and the spans but the
/// steps' ([`STEP`]).
fn logged(metadata: &tracing::Metadata<'_>) -> bool {
    !metadata.is_span() || metadata.target() != STEP
}

/// What is logged and traced: RUST_LOG, or by default `info` with the chattier crates at
/// `warn`.
pub fn filter() -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,ractor=warn,sqlx=warn,sea_orm=warn,sea_orm_migration=warn,h2=warn,hyper=warn,reqwest=warn")
    })
}

/// The log layer: lines (JSON with `json_logs`) to `writer`, without the steps' spans.
pub fn log_layer<S, W>(json_logs: bool, writer: W) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let fmt = tracing_subscriber::fmt::layer().with_writer(writer);
    let logged = tracing_subscriber::filter::filter_fn(logged);
    if json_logs {
        fmt.json().with_filter(logged).boxed()
    } else {
        fmt.with_filter(logged).boxed()
    }
}

/// Installs the global subscriber. Call once, at start, after `install_crypto`.
/// `instance_id` names this process among the service's (`service.instance.id`).
pub fn init(json_logs: bool, instance_id: &str) -> anyhow::Result<Telemetry> {
    type Base = tracing_subscriber::layer::Layered<EnvFilter, tracing_subscriber::Registry>;
    let mut layers: Vec<Box<dyn Layer<Base> + Send + Sync>> = Vec::new();
    layers.push(log_layer(json_logs, std::io::stderr));
    let resource = resource(instance_id);
    let metrics = Arc::new(Metrics::new(
        if otlp_configured(Signal::Metrics) {
            Some(
                opentelemetry_otlp::MetricExporter::builder()
                    .with_http()
                    .build()?,
            )
        } else {
            None
        },
        resource.clone(),
    ));
    let provider = if otlp_configured(Signal::Traces) {
        // Endpoint, protocol (http/protobuf or http/json), headers and timeouts come from the
        // standard OTEL_* variables.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()?;
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build(),
        )
    } else {
        None
    };
    if let Some(provider) = &provider {
        layers.push(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("bedrock"))
                .boxed(),
        );
    }
    tracing_subscriber::registry()
        .with(filter())
        .with(layers)
        .try_init()?;
    Ok(Telemetry { provider, metrics })
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// Lines written to memory.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .expect("not poisoned")
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_logged_within_a_step_carries_its_turn_not_the_step() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber =
            tracing_subscriber::registry().with(log_layer(true, move || writer.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let turn = tracing::info_span!(
                "conversation.turn",
                tenant = "t1",
                conversation = "c1",
                outcome = tracing::field::Empty
            );
            let _turn = turn.enter();
            let step = tracing::info_span!(
                target: STEP,
                "llm.request",
                model = "m",
                input_tokens = tracing::field::Empty
            );
            let _step = step.enter();
            step.record("input_tokens", 5);
            tracing::warn!("a retry");
            let delivery = tracing::info_span!(target: STEP, "webhook delivery", webhook = "w1");
            let _delivery = delivery.enter();
            tracing::info!("within a delivery");
        });
        tracing::subscriber::with_default(
            tracing_subscriber::registry().with(log_layer(true, {
                let writer = lines.clone();
                move || writer.clone()
            })),
            || {
                let firing = tracing::info_span!("schedule firing", schedule = "s1");
                let _firing = firing.enter();
                tracing::info!("fired");
            },
        );
        let text = String::from_utf8(lines.0.lock().expect("not poisoned").clone()).expect("UTF-8");
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect();
        assert_eq!(lines.len(), 3, "{text}");
        // Other spans are logged as they were.
        assert_eq!(lines[2]["span"]["name"], "schedule firing", "{}", lines[2]);
        assert_eq!(lines[2]["span"]["schedule"], "s1", "{}", lines[2]);
        for line in &lines[..2] {
            assert_eq!(line["span"]["name"], "conversation.turn", "{line}");
            assert_eq!(line["span"]["tenant"], "t1", "{line}");
            assert_eq!(line["span"]["conversation"], "c1", "{line}");
            let spans = line["spans"].as_array().expect("the span list");
            assert_eq!(spans.len(), 1, "only the turn is logged: {line}");
        }
        assert_eq!(lines[0]["fields"]["message"], "a retry");
        assert_eq!(lines[0]["level"], "WARN");
    }
}
