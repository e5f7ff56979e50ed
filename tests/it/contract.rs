//! The contract seen from outside (issue 21): every route, taken from the OpenAPI document
//! the server derives from its own router, answers malformed input of every kind in the
//! contract's error shape; and the replies and frames of a scripted session (every route,
//! every frame type) are valid against the document's schemas.

use std::collections::{BTreeMap, BTreeSet};

use bedrock::testkit::Reply as Llm;
use reqwest::Method;
use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::{Value, json};

use crate::support::ws::{Next, Ws};
use crate::support::{TestApp, TestDb, WAIT, eventually};

/// The document the server serves.
async fn document(app: &TestApp) -> Value {
    let reply = app.request(Method::GET, "/openapi.json", None, None).await;
    reply.expect(200)
}

/// Every operation of the document: `(method, path template, operation)`.
fn operations(doc: &Value) -> Vec<(Method, String, Value)> {
    let mut all = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("a path item") {
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
            all.push((method, path.clone(), operation.clone()));
        }
    }
    all
}

/// `path` with each `{param}` replaced by the value `fill` gives for it.
fn fill(path: &str, fill: impl Fn(&str) -> String) -> String {
    let mut out = String::new();
    let mut rest = path;
    while let Some(open) = rest.find('{') {
        let close = rest[open..].find('}').expect("a closing brace") + open;
        out.push_str(&rest[..open]);
        out.push_str(&fill(&rest[open + 1..close]));
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

fn query_params(operation: &Value) -> Vec<(String, String)> {
    operation["parameters"]
        .as_array()
        .map(|params| {
            params
                .iter()
                .filter(|p| p["in"] == "query")
                .filter_map(|p| {
                    let name = p["name"].as_str()?.to_owned();
                    let kind = p["schema"]["type"].to_string();
                    Some((name, kind))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// What one malformed request got: its status and body, in the contract's shape or not.
#[derive(Debug)]
struct Answer {
    what: String,
    status: u16,
    content_type: String,
    body: Value,
}

impl Answer {
    #[track_caller]
    fn expect(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "{}: {self:?}", self.what);
        assert!(
            self.content_type.starts_with("application/json"),
            "{}: {self:?}",
            self.what
        );
        assert_eq!(self.body["error"]["code"], code, "{}: {self:?}", self.what);
        let message = self.body["error"]["message"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{}: {self:?}", self.what);
        assert_eq!(
            self.body.as_object().map(|o| o.len()),
            Some(1),
            "{}: only `error`: {self:?}",
            self.what
        );
    }
}

async fn send(
    app: &TestApp,
    what: String,
    method: Method,
    url: &str,
    headers: HeaderMap,
    body: Option<Vec<u8>>,
) -> Answer {
    let mut request = app
        .http
        .request(method, format!("{}{url}", app.base))
        .headers(headers);
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await.expect("a body");
    Answer {
        what,
        status,
        content_type,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
    }
}

fn auth(key: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {key}")).expect("a header"),
    );
    headers
}

/// Every route the router has, taken from the document it serves, answers each kind of
/// malformed request with a 4xx in the contract's error shape: a path parameter that is
/// not UTF-8, malformed query parameters, a body that is not JSON, not an object, with an
/// unknown field or too large, a missing, unknown or malformed key, a method the route does
/// not take, and a WebSocket route asked without an upgrade.
#[tokio::test]
async fn every_route_rejects_malformed_input_in_the_error_shape() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_SERVER__MAX_BODY_BYTES", "65536")]).await;
    let id = app.conversation().await;
    let doc = document(&app).await;
    let operations = operations(&doc);
    assert!(operations.len() >= 20, "{} operations", operations.len());
    let real = |name: &str| match name {
        "id" => id.clone(),
        _ => "0190a5b3-0000-7000-8000-000000000000".to_owned(),
    };
    let mut paths = BTreeMap::<String, BTreeSet<Method>>::new();
    for (method, template, operation) in &operations {
        paths
            .entry(template.clone())
            .or_default()
            .insert(method.clone());
        let v1 = template.starts_with("/v1/");
        let good = fill(template, real);
        let key = auth(&app.key_a);

        // A path parameter that is not UTF-8.
        if template.contains('{') {
            let bad = fill(template, |_| "%00%ff".to_owned());
            send(
                &app,
                format!("{method} {bad}"),
                method.clone(),
                &bad,
                key.clone(),
                None,
            )
            .await
            .expect(400, "invalid_request");
        }
        // Query parameters of the wrong type.
        let query = query_params(operation);
        let wrong: Vec<String> = query
            .iter()
            .filter(|(_, kind)| kind.contains("integer") || kind.contains("boolean"))
            .map(|(name, _)| format!("{name}=not-a-number"))
            .collect();
        if !wrong.is_empty() {
            let url = format!("{good}?{}", wrong.join("&"));
            send(
                &app,
                format!("{method} {url}"),
                method.clone(),
                &url,
                key.clone(),
                None,
            )
            .await
            .expect(400, "invalid_request");
        }
        // Bodies that are not what the route takes.
        if operation.get("requestBody").is_some() {
            for (label, body) in [
                ("not JSON", b"{\"text\": ".to_vec()),
                ("not an object", b"[1, 2]".to_vec()),
                ("an unknown field", b"{\"no_such_field\": 1}".to_vec()),
                ("not UTF-8", b"{\"text\": \"\xff\xfe\"}".to_vec()),
            ] {
                send(
                    &app,
                    format!("{method} {good} with a body {label}"),
                    method.clone(),
                    &good,
                    key.clone(),
                    Some(body),
                )
                .await
                .expect(400, "invalid_request");
            }
            let huge = format!("{{\"text\": \"{}\"}}", "x".repeat(70_000)).into_bytes();
            send(
                &app,
                format!("{method} {good} with a body over the limit"),
                method.clone(),
                &good,
                key.clone(),
                Some(huge),
            )
            .await
            .expect(413, "payload_too_large");
        }
        if v1 {
            // No key, an unknown key, a key in the wrong scheme, a header that is not text.
            let mut malformed = Vec::new();
            malformed.push(("no key", HeaderMap::new()));
            malformed.push(("an unknown key", auth("bk_not_a_key")));
            let mut basic = HeaderMap::new();
            basic.insert("authorization", HeaderValue::from_static("Basic YTpi"));
            malformed.push(("a Basic credential", basic));
            let mut binary = HeaderMap::new();
            binary.insert(
                "authorization",
                HeaderValue::from_bytes(b"Bearer \xff\xfe").expect("obs-text is a header value"),
            );
            malformed.push(("a key that is not UTF-8", binary));
            for (label, headers) in malformed {
                send(
                    &app,
                    format!("{method} {good} with {label}"),
                    method.clone(),
                    &good,
                    headers,
                    None,
                )
                .await
                .expect(401, "unauthorized");
            }
        }
        if template.ends_with("/ws") {
            send(
                &app,
                format!("{method} {good} without an upgrade"),
                method.clone(),
                &good,
                key.clone(),
                None,
            )
            .await
            .expect(400, "invalid_request");
            let mut half = key.clone();
            half.insert("connection", HeaderValue::from_static("upgrade"));
            half.insert("upgrade", HeaderValue::from_static("websocket"));
            send(
                &app,
                format!("{method} {good} with an upgrade that lacks its key"),
                method.clone(),
                &good,
                half,
                None,
            )
            .await
            .expect(400, "invalid_request");
        }
    }
    // A method no route takes, on every path.
    for (template, methods) in &paths {
        let good = fill(template, real);
        for method in [Method::PUT, Method::PATCH, Method::DELETE, Method::POST] {
            if !methods.contains(&method) {
                send(
                    &app,
                    format!("{method} {good}"),
                    method.clone(),
                    &good,
                    auth(&app.key_a),
                    None,
                )
                .await
                .expect(405, "method_not_allowed");
            }
        }
    }
    // No such route.
    for url in ["/v1/nothing", "/v1/conversations/x/y/z", "/%ff"] {
        send(
            &app,
            url.to_owned(),
            Method::GET,
            url,
            auth(&app.key_a),
            None,
        )
        .await
        .expect(404, "not_found");
    }
    app.cleanup(db).await;
}

/// Validates JSON against the document's schemas.
struct Schemas {
    doc: Value,
}

impl Schemas {
    /// Checks `instance` against the schema at `pointer` in the document (a `$ref` target or
    /// an inline schema), reporting every error.
    #[track_caller]
    fn check(&self, what: &str, schema: &Value, instance: &Value) {
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.doc["components"],
            "allOf": [schema],
        });
        let validator = jsonschema::validator_for(&root).expect("the document's schemas compile");
        let errors: Vec<String> = validator
            .iter_errors(instance)
            .map(|e| format!("{e} at {}", e.instance_path()))
            .collect();
        assert!(
            errors.is_empty(),
            "{what} does not match its schema: {errors:?}\n{instance}"
        );
    }

    fn named(&self, name: &str) -> Value {
        json!({"$ref": format!("#/components/schemas/{name}")})
    }

    /// Checks an HTTP reply against the operation's response schema for its status.
    #[track_caller]
    fn reply(&self, method: &str, template: &str, status: u16, body: &Value) {
        let operation = &self.doc["paths"][template][method.to_lowercase()];
        assert!(
            operation.is_object(),
            "{method} {template} is not documented"
        );
        let response = &operation["responses"][status.to_string()];
        assert!(
            response.is_object(),
            "{method} {template} answered {status}, which is not documented: {body}"
        );
        let schema = &response["content"]["application/json"]["schema"];
        if schema.is_object() {
            self.check(&format!("{method} {template} {status}"), schema, body);
        } else {
            assert!(
                body.is_null(),
                "{method} {template} {status} has a body: {body}"
            );
        }
    }
}

/// The replies of a scripted session on every route, and every frame type on the WebSocket
/// and SSE, are valid against the document's schemas; the frame types seen are exactly the
/// ones the document lists.
#[tokio::test]
async fn responses_and_frames_match_the_openapi_document() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_CONVERSATIONS__IDLE_TIMEOUT_MS", "600000"),
            // Frames go after a second: a resume from the start then gets a `gap`.
            ("BEDROCK_EVENTS__RETAIN", "1s"),
        ],
    )
    .await;
    let schemas = Schemas {
        doc: document(&app).await,
    };
    macro_rules! call {
        ($method:literal, $template:literal, $url:expr, $body:expr, $status:expr) => {{
            let method = Method::from_bytes($method.as_bytes()).expect("a method");
            let reply = app.request(method, &*$url, Some(&app.key_a), $body).await;
            assert_eq!(
                reply.status, $status,
                "{} {}: {}",
                $method, $url, reply.body
            );
            schemas.reply($method, $template, reply.status, &reply.body);
            reply.body
        }};
    }

    let created = call!(
        "POST",
        "/v1/conversations",
        "/v1/conversations",
        Some(
            json!({"slug": "contract", "require_approval": ["bash"], "client_tools": [{
                "name": "lookup",
                "description": "the client's dictionary",
                "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
            }]})
        ),
        201
    );
    let id = created["id"].as_str().expect("an id").to_owned();
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    let sse = app
        .http
        .get(format!("{}/v1/conversations/{id}/stream", app.base))
        .bearer_auth(&app.key_a)
        .send()
        .await
        .expect("the stream opens");
    assert_eq!(sse.status(), 200);

    // A turn with every kind of durable frame: a retry, a context warning, an approval (a
    // client request answered over REST), a question answered over the WebSocket, a
    // background task's progress and result, a client's system event.
    app.llm.usage(110_000, 10);
    app.llm.push([
        Llm::status(503, "overloaded"),
        Llm::tool(
            "call_bg",
            "bash",
            json!({"command": "echo one; sleep 0.2; echo two", "background": true}),
        ),
        Llm::tool(
            "call_ask",
            "ask_user",
            json!({"question": "Colour?", "kind": "select", "options": ["red", "blue"]}),
        ),
        Llm::tool("call_lookup", "lookup", json!({"q": "ferrous"})),
        Llm::tool(
            "call_spawn",
            "spawn_sub_agents",
            json!({"tasks": [{"prompt": "a sub task", "max_steps": 3}]}),
        ),
        Llm::text("all done"),
        Llm::text("the message queued over the WebSocket, done"),
        Llm::text("the message queued over REST, done"),
    ]);
    app.llm.route(
        "a sub task",
        [Llm::tool(
            "call_submit",
            "submit_result",
            json!({"result": "done"}),
        )],
    );
    ws.send(&json!({"type": "ping"})).await;
    ws.send_text("not json").await;
    ws.send(&json!({"type": "user_message", "text": "start"}))
        .await;
    let mut frames = Vec::new();
    let mut answered = BTreeSet::new();
    loop {
        let frame = match ws.next(WAIT).await {
            Some(Next::Frame(frame)) => frame,
            other => panic!("the WebSocket ended: {other:?}"),
        };
        if frame["type"] == "client_request" {
            let request_id = frame["request_id"]
                .as_str()
                .expect("a request id")
                .to_owned();
            if frame["request_type"].get("confirm").is_some() {
                let url = format!("/v1/conversations/{id}/requests/{request_id}");
                call!(
                    "POST",
                    "/v1/conversations/{id}/requests/{request_id}",
                    url,
                    Some(json!({"payload": {"confirmed": true}})),
                    200
                );
            } else {
                ws.send(&json!({"type": "respond", "request_id": request_id, "payload": {"selected": ["blue"]}}))
                    .await;
            }
            answered.insert(request_id);
        }
        if frame["type"] == "client_tool_call" {
            // While the turn waits, two messages wait for it: over the WebSocket (a `queued`
            // frame answers) and over REST (202 `{queued}`).
            ws.send(
                &json!({"type": "user_message", "text": "queued over ws", "if_busy": "enqueue"}),
            )
            .await;
            let url = format!("/v1/conversations/{id}/messages?if_busy=enqueue");
            call!(
                "POST",
                "/v1/conversations/{id}/messages",
                url,
                Some(json!({"text": "queued over rest"})),
                202
            );
            let url = format!("/v1/conversations/{id}/queue");
            call!("GET", "/v1/conversations/{id}/queue", url, None, 200);
            let call_id = frame["call_id"].as_str().expect("a call id").to_owned();
            let url = format!("/v1/conversations/{id}/tool_results/{call_id}");
            call!(
                "POST",
                "/v1/conversations/{id}/tool_results/{call_id}",
                url,
                Some(json!({"output": "iron"})),
                200
            );
            answered.insert(call_id);
        }
        let idle = frame["type"] == "state" && frame["state"]["kind"] == "idle";
        frames.push(frame);
        if idle && answered.len() == 3 {
            break;
        }
    }
    // The background task's result arrives after the turn.
    eventually("the background task's result", WAIT, || async {
        let url = format!("/v1/conversations/{id}/tasks");
        let tasks = call!("GET", "/v1/conversations/{id}/tasks", url, None, 200);
        (tasks["tasks"][0]["status"] != "running").then_some(())
    })
    .await;
    let url = format!("/v1/conversations/{id}/events");
    call!(
        "POST",
        "/v1/conversations/{id}/events",
        url,
        Some(json!({"event": {"type": "user_request", "request_id": "r1", "kind": "usage"}})),
        202
    );
    frames.extend(
        ws.frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "user_response")
            .await,
    );

    // The other routes.
    let url = format!("/v1/conversations/{id}/client_tool_calls");
    call!(
        "GET",
        "/v1/conversations/{id}/client_tool_calls",
        url,
        None,
        200
    );
    call!(
        "GET",
        "/v1/conversations",
        "/v1/conversations?limit=5",
        None,
        200
    );
    call!(
        "GET",
        "/v1/conversations/{id}",
        format!("/v1/conversations/{id}"),
        None,
        200
    );
    call!(
        "GET",
        "/v1/conversations/{id}/messages",
        format!("/v1/conversations/{id}/messages?after=0&limit=100"),
        None,
        200
    );
    call!(
        "GET",
        "/v1/conversations/{id}/children",
        format!("/v1/conversations/{id}/children"),
        None,
        200
    );
    call!(
        "POST",
        "/v1/conversations/{id}/fork",
        format!("/v1/conversations/{id}/fork"),
        Some(json!({"cwd": "share"})),
        201
    );
    call!(
        "POST",
        "/v1/conversations/{id}/fork",
        format!("/v1/conversations/{id}/fork"),
        Some(json!({"at_sequence_id": 2})),
        409
    );
    let task = call!(
        "GET",
        "/v1/conversations/{id}/tasks",
        format!("/v1/conversations/{id}/tasks"),
        None,
        200
    )["tasks"][0]["task_id"]
        .as_str()
        .expect("a task")
        .to_owned();
    call!(
        "POST",
        "/v1/conversations/{id}/tasks/{task_id}/cancel",
        format!("/v1/conversations/{id}/tasks/{task}/cancel"),
        None,
        202
    );
    app.llm.push([Llm::text("again")]);
    call!(
        "POST",
        "/v1/conversations/{id}/messages",
        format!("/v1/conversations/{id}/messages?if_busy=interrupt"),
        Some(json!({"text": "again", "message_id": "m-1"})),
        202
    );
    call!(
        "POST",
        "/v1/conversations/{id}/cancel",
        format!("/v1/conversations/{id}/cancel"),
        None,
        202
    );
    call!(
        "POST",
        "/v1/conversations/{id}/messages",
        format!("/v1/conversations/{id}/messages"),
        Some(json!({"text": "again", "message_id": "m-1"})),
        200
    );
    call!(
        "POST",
        "/v1/conversations/{id}/archive",
        format!("/v1/conversations/{id}/archive"),
        None,
        200
    );
    call!(
        "POST",
        "/v1/conversations/{id}/unarchive",
        format!("/v1/conversations/{id}/unarchive"),
        None,
        200
    );
    // Errors are documented too.
    call!(
        "GET",
        "/v1/conversations/{id}",
        "/v1/conversations/no-such",
        None,
        404
    );
    for (template, url) in [("/healthz", "/healthz"), ("/readyz", "/readyz")] {
        let reply = app.request(Method::GET, url, None, None).await;
        schemas.reply("GET", template, reply.status, &reply.body);
    }

    // The SSE stream saw the same durable frames; a shutdown closes it with `closing`.
    frames.extend(
        ws.frames_until(|f| f["type"] == "state" && f["state"]["kind"] == "idle")
            .await,
    );
    drop(ws);
    // A resume from before the retained frames: the snapshot, a gap, the messages.
    let resumed = eventually("the first frames to be removed", WAIT, || async {
        let mut ws = Ws::connect(&app.ws_url(&id, "&after_event_id=0")).await;
        let mut frames = vec![ws.frame().await];
        frames.push(ws.frame().await);
        if frames[1]["type"] != "gap" {
            return None;
        }
        while let Some(Next::Frame(frame)) = ws.next(std::time::Duration::from_millis(300)).await {
            frames.push(frame);
        }
        Some(frames)
    })
    .await;
    assert!(
        resumed[2..].iter().any(|f| f["type"] == "message"),
        "the messages stand for the removed frames: {resumed:?}"
    );
    frames.extend(resumed);
    let reader = tokio::spawn(async move { sse.text().await.expect("the stream's text") });
    let mut app = app;
    app.stop().await;
    let text = reader.await.expect("the reader");
    let mut sse_frames = Vec::new();
    for block in text.split("\n\n") {
        let data: String = block
            .lines()
            .filter_map(|line| line.strip_prefix("data: ").or(line.strip_prefix("data:")))
            .collect();
        if !data.is_empty() {
            sse_frames.push(serde_json::from_str::<Value>(&data).expect("SSE data is JSON"));
        }
    }
    assert!(
        sse_frames.iter().any(|f| f["type"] == "closing"),
        "the shutdown closes the SSE stream: {text}"
    );

    let server_frame = schemas.named("ServerFrame");
    let mut seen = BTreeSet::new();
    for frame in frames.iter().chain(&sse_frames) {
        schemas.check("a frame", &server_frame, frame);
        seen.insert(frame["type"].as_str().unwrap_or_default().to_owned());
    }
    let documented: BTreeSet<String> = schemas.doc["components"]["schemas"]["ServerFrame"]["oneOf"]
        .as_array()
        .expect("ServerFrame is a oneOf")
        .iter()
        .filter_map(|variant| variant["properties"]["type"]["enum"][0].as_str())
        .map(str::to_owned)
        .collect();
    assert_eq!(
        seen, documented,
        "every documented frame type, and no other"
    );
    app.cleanup(db).await;
}
