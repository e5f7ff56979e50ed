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

/// Installs the global subscriber. Call once, at start, after `install_crypto`.
/// `instance_id` names this process among the service's (`service.instance.id`).
pub fn init(json_logs: bool, instance_id: &str) -> anyhow::Result<Telemetry> {
    let filter = || {
        EnvFilter::try_from_default_env().unwrap_or_else(|_| {
            EnvFilter::new("info,ractor=warn,sqlx=warn,sea_orm=warn,sea_orm_migration=warn,h2=warn,hyper=warn,reqwest=warn")
        })
    };
    type Base = tracing_subscriber::layer::Layered<EnvFilter, tracing_subscriber::Registry>;
    let mut layers: Vec<Box<dyn Layer<Base> + Send + Sync>> = Vec::new();
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    layers.push(if json_logs {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    });
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
