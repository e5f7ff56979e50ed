//! Logs and traces. Logs go to stderr (JSON with BEDROCK_LOG_FORMAT=json); spans (a turn, its
//! LLM requests, tool runs and commits, with tenant and conversation attributes) are exported
//! over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set,
//! honouring the standard OTEL_* variables. Without them nothing is exported or buffered.

use std::sync::Arc;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
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

/// Whether the process environment asks for OTLP trace export.
fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var(name).is_ok_and(|v| !v.is_empty()))
        && std::env::var("OTEL_SDK_DISABLED").map_or(true, |v| v != "true")
}

/// Installs the global subscriber. Call once, at start, after `install_crypto`.
pub fn init(json_logs: bool) -> anyhow::Result<Telemetry> {
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
    let otlp = otlp_configured();
    let metrics = Arc::new(Metrics::new(if otlp {
        Some(
            opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .build()?,
        )
    } else {
        None
    }));
    let provider = if otlp {
        // Endpoint, protocol (http/protobuf or http/json), headers and timeouts come from the
        // standard OTEL_* variables.
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build()?;
        Some(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(Resource::builder().with_service_name("bedrock").build())
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
