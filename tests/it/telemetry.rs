//! Traces and metrics reach a real OTLP receiver with the right names, attributes and
//! parents, and the operator listener's /metrics serves what the dashboard queries (the operations issue). The
//! receiver takes OTLP/HTTP with the protocol's JSON encoding.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use bedrock::testkit::{FakeLlm, Reply as Llm};
use serde_json::{Value, json};

use crate::support::process::{Server, command};
use crate::support::{TestDb, WAIT, eventually};

type Received = Arc<Mutex<Vec<Value>>>;

async fn receive(State(received): State<Received>, body: axum::body::Bytes) -> axum::Json<Value> {
    if let Ok(value) = serde_json::from_slice::<Value>(&body) {
        received
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(value);
    }
    axum::Json(json!({}))
}

/// A real OTLP/HTTP receiver on a loopback port: what it received on /v1/traces and on
/// /v1/metrics, and its address.
async fn collector() -> (Received, Received, std::net::SocketAddr) {
    let (traces, metrics): (Received, Received) = (Arc::default(), Arc::default());
    let app = Router::new()
        .route("/v1/traces", post(receive).with_state(traces.clone()))
        .route("/v1/metrics", post(receive).with_state(metrics.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (traces, metrics, addr)
}

/// A resource's string attributes, as a map.
fn resource_attributes(resource: &Value) -> Value {
    let map: serde_json::Map<String, Value> = resource["attributes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|kv| {
                    Some((
                        kv["key"].as_str()?.to_owned(),
                        kv["value"]["stringValue"].clone(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    Value::Object(map)
}

/// A flat list of every span received, with its attributes as a map.
fn spans(received: &Received) -> Vec<Value> {
    let batches = received.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut spans = Vec::new();
    for batch in batches {
        for resource in batch["resourceSpans"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            let service = resource_attributes(&resource["resource"]);
            for scope in resource["scopeSpans"]
                .as_array()
                .cloned()
                .unwrap_or_default()
            {
                for span in scope["spans"].as_array().cloned().unwrap_or_default() {
                    let attributes: serde_json::Map<String, Value> = span["attributes"]
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|kv| {
                                    let value = &kv["value"];
                                    let value = value
                                        .get("stringValue")
                                        .or(value.get("intValue"))
                                        .or(value.get("boolValue"))
                                        .cloned()?;
                                    Some((kv["key"].as_str()?.to_owned(), value))
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    spans.push(json!({
                        "name": span["name"],
                        "trace": span["traceId"],
                        "id": span["spanId"],
                        "parent": span["parentSpanId"],
                        "service": service,
                        "attributes": attributes,
                    }));
                }
            }
        }
    }
    spans
}

#[tokio::test]
async fn a_turn_is_exported_as_one_trace() {
    bedrock::install_crypto();
    let (received, metrics, collector) = collector().await;

    let db = TestDb::sqlite();
    let llm = FakeLlm::start().await;
    let workspace = crate::support::db::temp_dir("ws");
    let mut cmd = command(&db, &llm, &workspace);
    cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{collector}"))
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("OTEL_METRIC_EXPORT_INTERVAL", "200")
        // The standard variables win over Bedrock's defaults (OTEL_SERVICE_NAME over a
        // service.name in OTEL_RESOURCE_ATTRIBUTES).
        .env("OTEL_SERVICE_NAME", "bedrock-under-test")
        .env(
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.name=overridden,deployment.environment.name=ci",
        )
        .env_remove("RUST_LOG");
    let server = Server::start_with(cmd);
    let created = server.conversation().await;
    let id = created["id"].as_str().expect("an id").to_owned();
    llm.push([Llm::bash("call_1", "echo traced"), Llm::text("done")]);
    server.send(&id, "go").await;
    eventually("the turn to end", WAIT, || async {
        let conv = server.get(&format!("/conversations/{id}")).await?;
        (conv["state"]["kind"] == "idle" && llm.requests().len() == 2).then_some(())
    })
    .await;
    let logs = server.logs.clone();
    // The receiver runs on this test's runtime: wait for the exit off it.
    let status = tokio::task::spawn_blocking(move || server.terminate())
        .await
        .expect("the wait");
    assert!(status.success(), "a clean exit flushes the exporter");

    let spans = spans(&received);
    let names: Vec<&str> = spans.iter().filter_map(|s| s["name"].as_str()).collect();
    let named = |name: &str| {
        spans
            .iter()
            .filter(|s| s["name"] == name)
            .cloned()
            .collect::<Vec<_>>()
    };
    let turn = named("conversation.turn");
    assert_eq!(turn.len(), 1, "one turn: {names:?}");
    let turn = &turn[0];
    let service = &turn["service"];
    assert_eq!(service["service.name"], "bedrock-under-test", "{service}");
    assert_eq!(service["deployment.environment.name"], "ci", "{service}");
    assert_eq!(
        service["service.version"],
        env!("CARGO_PKG_VERSION"),
        "{service}"
    );
    let instance = service["service.instance.id"].as_str().unwrap_or_default();
    assert!(uuid::Uuid::parse_str(instance).is_ok(), "{service}");
    assert_eq!(turn["attributes"]["conversation"], id.as_str());
    assert!(turn["attributes"]["tenant"].is_string());
    let llm_spans = named("llm.request");
    assert_eq!(llm_spans.len(), 2);
    for span in llm_spans
        .iter()
        .chain(named("tool.run").iter())
        .chain(named("conversation.transition").iter())
    {
        assert_eq!(
            span["trace"], turn["trace"],
            "every part of the turn is in its trace: {span}"
        );
        assert_eq!(
            span["parent"], turn["id"],
            "and a child of the turn: {span}"
        );
        assert_eq!(span["attributes"]["conversation"], id.as_str());
    }
    assert!(
        llm_spans
            .iter()
            .all(|s| s["attributes"]["outcome"] == "ok" && s["attributes"]["model"].is_string())
    );
    let tools = named("tool.run");
    assert_eq!(tools.len(), 1);
    assert_eq!(tools[0]["attributes"]["tool"], "bash");
    assert_eq!(tools[0]["attributes"]["ok"], true);
    let commits = named("persistence.commit");
    assert!(!commits.is_empty());
    let transitions = named("conversation.transition");
    let transition_ids: Vec<&Value> = transitions.iter().map(|s| &s["id"]).collect();
    assert!(
        commits
            .iter()
            .filter(|c| c["trace"] == turn["trace"])
            .all(|c| transition_ids.contains(&&c["parent"])),
        "commits are children of transitions"
    );
    // The turn's log line carries its trace id.
    let finished = logs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| line["fields"]["message"] == "turn finished")
        .expect("a 'turn finished' log line");
    assert_eq!(finished["span"]["trace_id"], turn["trace"], "{finished}");

    // The turn's metrics arrived too, with their attributes, from the same resource.
    let batches = metrics.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for resource in batches
        .iter()
        .flat_map(|b| b["resourceMetrics"].as_array().cloned().unwrap_or_default())
    {
        assert_eq!(
            &resource_attributes(&resource["resource"]),
            service,
            "metrics and spans name the same process"
        );
    }
    let exported: Vec<Value> = batches
        .iter()
        .flat_map(|b| b["resourceMetrics"].as_array().cloned().unwrap_or_default())
        .flat_map(|r| r["scopeMetrics"].as_array().cloned().unwrap_or_default())
        .flat_map(|s| s["metrics"].as_array().cloned().unwrap_or_default())
        .collect();
    let metric_names: std::collections::BTreeSet<&str> =
        exported.iter().filter_map(|m| m["name"].as_str()).collect();
    for name in [
        "bedrock.turns_started",
        "bedrock.turns_finished",
        "bedrock.turn_duration",
        "bedrock.llm_requests",
        "bedrock.llm_request_duration",
        "bedrock.tokens",
        "bedrock.tool_runs",
        "bedrock.commit_latency",
    ] {
        assert!(
            metric_names.contains(name),
            "{name} not exported: {metric_names:?}"
        );
    }
    let of = |name: &str| {
        exported
            .iter()
            .filter(|m| m["name"] == name)
            .map(Value::to_string)
            .collect::<String>()
    };
    let tokens = of("bedrock.tokens");
    assert!(
        tokens.contains("\"tenant\"") && tokens.contains("\"model\"") && tokens.contains("input"),
        "{tokens}"
    );
    assert!(of("bedrock.tool_runs").contains("bash"));
    crate::support::process::remove_workspace(&workspace);
    db.drop_db().await;
}

/// Every series the Grafana dashboard queries is one that /metrics serves, once a turn with
/// a retry, a tool, a cancel and a WebSocket client have happened (the dashboard and the
/// code agree).
#[tokio::test]
async fn the_dashboard_queries_only_served_metrics() {
    let db = TestDb::sqlite();
    let app = crate::support::TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let mut ws = crate::support::ws::Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    app.llm.push([
        Llm::status(503, "down"), // one retry
        Llm::bash("call_1", "echo hi"),
        Llm::text("done"),
    ]);
    app.send(&id, "one").await;
    app.wait_kind(&id, "idle").await;
    app.llm.push([Llm::bash("call_2", "sleep 300")]);
    app.send(&id, "two").await;
    app.wait_kind(&id, "tool_executing").await;
    app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
        .await
        .expect(202);
    app.wait_kind(&id, "idle").await;

    let dashboard: Value =
        serde_json::from_str(include_str!("../../deploy/grafana/dashboards/bedrock.json"))
            .expect("the dashboard is JSON");
    let mut queried = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("an expression");
            for (start, _) in expr.match_indices("bedrock_") {
                let name: String = expr[start..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                queried.insert(name);
            }
        }
    }
    assert!(queried.len() >= 10, "{queried:?}");
    let text = eventually("the metrics to be served", WAIT, || async {
        let response = app
            .http
            .get(format!("{}/metrics", app.metrics_base))
            .send()
            .await;
        let text = response.ok()?.text().await.ok()?;
        text.contains("bedrock_cancel_latency_seconds_bucket")
            .then_some(text)
    })
    .await;
    let served: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split(['{', ' ']).next())
        .collect();
    for name in &queried {
        assert!(
            served.contains(name.as_str()),
            "{name} is not served: {served:?}"
        );
    }
    drop(ws);
    app.cleanup(db).await;
}

/// Without OTEL_SERVICE_NAME, a `service.name` in OTEL_RESOURCE_ATTRIBUTES names the
/// service; with neither, it is `bedrock`.
#[tokio::test]
async fn the_service_name_comes_from_the_standard_variables() {
    bedrock::install_crypto();
    for (attributes, expected) in [
        (
            Some("service.name=from-attributes,team=agents"),
            "from-attributes",
        ),
        (None, "bedrock"),
    ] {
        let (_, metrics, collector) = collector().await;
        let db = TestDb::sqlite();
        let llm = FakeLlm::start().await;
        let workspace = crate::support::db::temp_dir("ws");
        let mut cmd = command(&db, &llm, &workspace);
        cmd.env(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            format!("http://{collector}/v1/metrics"),
        )
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .env("OTEL_METRIC_EXPORT_INTERVAL", "200");
        if let Some(attributes) = attributes {
            cmd.env("OTEL_RESOURCE_ATTRIBUTES", attributes);
        }
        let server = Server::start_with(cmd);
        // Something to export: /metrics (the operator listener's) sets the gauges.
        let served = reqwest::get(format!("{}/metrics", server.metrics_base)).await;
        assert!(served.is_ok_and(|r| r.status() == 200));
        let resource = eventually("a metrics export", WAIT, || async {
            let batches = metrics.lock().unwrap_or_else(|e| e.into_inner()).clone();
            batches
                .iter()
                .flat_map(|b| b["resourceMetrics"].as_array().cloned().unwrap_or_default())
                .map(|r| resource_attributes(&r["resource"]))
                .next()
        })
        .await;
        assert_eq!(resource["service.name"], expected, "{resource}");
        if attributes.is_some() {
            assert_eq!(resource["team"], "agents", "{resource}");
        }
        let status = tokio::task::spawn_blocking(move || server.terminate())
            .await
            .expect("the wait");
        assert!(status.success());
        crate::support::process::remove_workspace(&workspace);
        db.drop_db().await;
    }
}
