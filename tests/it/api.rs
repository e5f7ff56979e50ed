//! The public API through a real server on port 0 (the API issue; REQ-BED-002, -011, -013).

use std::time::Duration;

use base64::Engine;
use bedrock::testkit::Reply as Llm;
use reqwest::Method;
use serde_json::{Value, json};

use crate::support::{TestApp, TestDb, WAIT, eventually, request_messages};

pub(crate) fn png_base64(width: u32, height: u32) -> String {
    let image = image::RgbImage::from_pixel(width, height, image::Rgb([10, 200, 10]));
    let mut out = Vec::new();
    image::DynamicImage::ImageRgb8(image)
        .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
        .expect("a png encodes");
    base64::engine::general_purpose::STANDARD.encode(out)
}

#[tokio::test]
async fn conversation_routes_succeed() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        // Create, with and without options.
        let plain = app.post("/v1/conversations", json!({})).await.expect(201);
        assert_eq!(plain["state"], json!({"kind": "idle"}));
        assert_eq!(plain["user_initiated"], true);
        assert_eq!(plain["parent_id"], Value::Null);
        assert_eq!(plain["model"], "fake-model");
        assert_eq!(plain["usage"]["context_window"], 128000);
        let custom = app
            .post(
                "/v1/conversations",
                json!({"cwd": "projects/one", "model": "other", "system_prompt": "be brief", "slug": "my-conv"}),
            )
            .await
            .expect(201);
        assert!(
            custom["cwd"]
                .as_str()
                .unwrap_or_default()
                .ends_with("/projects/one"),
            "{custom}"
        );
        assert!(std::path::Path::new(custom["cwd"].as_str().unwrap_or_default()).is_dir());
        let id = custom["id"].as_str().expect("an id").to_owned();
        // Get by id and by slug.
        assert_eq!(
            app.get(&format!("/v1/conversations/{id}"))
                .await
                .expect(200)["slug"],
            "my-conv"
        );
        assert_eq!(
            app.get("/v1/conversations/my-conv").await.expect(200)["id"],
            id.as_str()
        );
        app.post("/v1/conversations", json!({"slug": "my-conv"}))
            .await
            .expect_error(409, "slug_taken");
        // List, newest first, paged.
        let third = app.conversation().await;
        let page = app.get("/v1/conversations?limit=2").await.expect(200);
        let ids: Vec<&str> = page["conversations"]
            .as_array()
            .expect("a list")
            .iter()
            .filter_map(|c| c["id"].as_str())
            .collect();
        assert_eq!(ids, [third.as_str(), id.as_str()]);
        let cursor = page["next_cursor"].as_str().expect("a cursor").to_owned();
        let rest = app
            .get(&format!("/v1/conversations?limit=2&cursor={cursor}"))
            .await
            .expect(200);
        assert_eq!(rest["conversations"][0]["id"], plain["id"]);
        assert_eq!(rest["next_cursor"], Value::Null);
        // Send, and read the messages.
        app.llm.push([Llm::text("hi there")]);
        let sent = app
            .post(
                &format!("/v1/conversations/{id}/messages"),
                json!({"text": "hello"}),
            )
            .await
            .expect(202);
        assert_eq!(sent["message"]["sequence_id"], 1);
        assert_eq!(sent["message"]["message_type"], "user");
        assert_eq!(
            sent["message"]["content"],
            json!({"text": "hello", "images": []})
        );
        app.wait_kind(&id, "idle").await;
        eventually("the answer", WAIT, || async {
            (app.messages(&id).await.len() == 2).then_some(())
        })
        .await;
        let after = app
            .get(&format!("/v1/conversations/{id}/messages?after=1"))
            .await
            .expect(200);
        assert_eq!(after["messages"].as_array().map(Vec::len), Some(1));
        assert_eq!(after["messages"][0]["content"]["text"], "hi there");
        assert_eq!(after["messages"][0]["usage"]["input_tokens"], 100);
        // The system prompt reached the LLM.
        let request = &app.llm.requests()[0];
        assert!(
            request["messages"][0]["content"]
                .as_str()
                .unwrap_or_default()
                .contains("be brief")
        );
        assert_eq!(request["model"], "other");
        // Cancel when idle is fine.
        let cancelled = app
            .post(&format!("/v1/conversations/{id}/cancel"), json!({}))
            .await
            .expect(202);
        assert_eq!(cancelled["state"], json!({"kind": "idle"}));
        // Children (none), archive, unarchive.
        assert_eq!(
            app.get(&format!("/v1/conversations/{id}/children"))
                .await
                .expect(200)["conversations"],
            json!([])
        );
        assert_eq!(
            app.post(&format!("/v1/conversations/{id}/archive"), json!({}))
                .await
                .expect(200)["archived"],
            true
        );
        let listed = app.get("/v1/conversations").await.expect(200);
        assert!(
            !listed.to_string().contains(&id),
            "archived conversations are not listed by default"
        );
        let archived = app.get("/v1/conversations?archived=true").await.expect(200);
        assert_eq!(archived["conversations"][0]["id"], id.as_str());
        assert_eq!(
            app.post(&format!("/v1/conversations/{id}/unarchive"), json!({}))
                .await
                .expect(200)["archived"],
            false
        );
        // Delete removes it and its messages.
        let deleted = app
            .request(
                Method::DELETE,
                &format!("/v1/conversations/{id}"),
                Some(&app.key_a),
                None,
            )
            .await;
        assert_eq!(deleted.status, 204);
        app.get(&format!("/v1/conversations/{id}"))
            .await
            .expect_error(404, "not_found");
        app.get(&format!("/v1/conversations/{id}/messages"))
            .await
            .expect_error(404, "not_found");
        // Ops routes.
        assert_eq!(
            app.request(Method::GET, "/healthz", None, None)
                .await
                .expect(200)["status"],
            "ok"
        );
        assert_eq!(
            app.request(Method::GET, "/readyz", None, None)
                .await
                .expect(200)["status"],
            "ready"
        );
        let openapi = app
            .request(Method::GET, "/openapi.json", None, None)
            .await
            .expect(200);
        assert_eq!(openapi["openapi"], "3.1.0");
        // The contract's public metrics (without series per tenant), and all of them on the
        // operator listener.
        let public = app
            .http
            .get(format!("{}/metrics", app.base))
            .send()
            .await
            .expect("metrics");
        assert_eq!(public.status(), 200);
        let metrics = app
            .http
            .get(format!("{}/metrics", app.metrics_base))
            .send()
            .await
            .expect("metrics");
        assert_eq!(metrics.status(), 200);
        let text = metrics.text().await.expect("text");
        assert!(text.contains("bedrock_cancel_latency_seconds"), "{text}");
        app.cleanup(db).await;
    }
}

#[tokio::test]
async fn errors_have_the_contract_shape() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_SERVER__MAX_BODY_BYTES", "200000"),
            ("BEDROCK_SERVER__MAX_TEXT_BYTES", "1000"),
        ],
    )
    .await;
    let id = app.conversation().await;
    let raw = |method: Method, path: &str, body: &str| {
        let request = app
            .http
            .request(method, format!("{}{path}", app.base))
            .bearer_auth(&app.key_a)
            .header("content-type", "application/json")
            .body(body.to_owned());
        async move {
            let response = request.send().await.expect("an answer");
            let status = response.status().as_u16();
            let body: Value = response.json().await.expect("a JSON error body");
            crate::support::app::Reply { status, body }
        }
    };
    raw(Method::POST, "/v1/conversations", "{not json")
        .await
        .expect_error(400, "invalid_request");
    raw(
        Method::POST,
        &format!("/v1/conversations/{id}/messages"),
        "{}",
    )
    .await
    .expect_error(400, "invalid_request");
    raw(
        Method::POST,
        &format!("/v1/conversations/{id}/messages"),
        r#"{"text": 5}"#,
    )
    .await
    .expect_error(400, "invalid_request");
    raw(Method::POST, "/v1/conversations", r#"{"cwd": ["x"]}"#)
        .await
        .expect_error(400, "invalid_request");
    let huge = format!(r#"{{"text": "{}"}}"#, "x".repeat(300_000));
    raw(
        Method::POST,
        &format!("/v1/conversations/{id}/messages"),
        &huge,
    )
    .await
    .expect_error(413, "payload_too_large");
    app.post(
        &format!("/v1/conversations/{id}/messages"),
        json!({"text": "y".repeat(2000)}),
    )
    .await
    .expect_error(413, "payload_too_large");
    app.post(
        &format!("/v1/conversations/{id}/messages"),
        json!({"text": "  "}),
    )
    .await
    .expect_error(400, "invalid_request");
    app.get("/v1/nothing-here")
        .await
        .expect_error(404, "not_found");
    app.request(Method::PUT, "/v1/conversations", Some(&app.key_a), None)
        .await
        .expect_error(405, "method_not_allowed");
    app.get("/v1/conversations/not-a-uuid")
        .await
        .expect_error(404, "not_found");
    app.get("/v1/conversations/01a1ffc8-5310-7779-a631-22160777ba45")
        .await
        .expect_error(404, "not_found");
    app.get("/v1/conversations?limit=abc")
        .await
        .expect_error(400, "invalid_request");
    app.get("/v1/conversations?limit=0")
        .await
        .expect_error(400, "invalid_request");
    app.request(Method::GET, "/v1/conversations", None, None)
        .await
        .expect_error(401, "unauthorized");
    app.request(Method::GET, "/v1/conversations", Some("bk_wrong"), None)
        .await
        .expect_error(401, "unauthorized");
    // cwd outside the workspace root: .., absolute, and a symlink planted inside.
    app.post("/v1/conversations", json!({"cwd": "../escape"}))
        .await
        .expect_error(400, "invalid_request");
    app.post("/v1/conversations", json!({"cwd": "/etc"}))
        .await
        .expect_error(400, "invalid_request");
    let tenant_root = app
        .cwd(&id)
        .await
        .parent()
        .expect("the tenant root")
        .to_path_buf();
    std::os::unix::fs::symlink("/tmp", tenant_root.join("link-out")).expect("a symlink");
    app.post("/v1/conversations", json!({"cwd": "link-out/x"}))
        .await
        .expect_error(400, "invalid_request");
    app.post("/v1/conversations", json!({"slug": "Bad Slug!"}))
        .await
        .expect_error(400, "invalid_request");
    // A create that is refused makes nothing: its fields are checked before its directory
    // is made (a tenant could otherwise fill the disk with directories of refused creates).
    for body in [
        json!({"cwd": "refused-slug", "slug": "Bad Slug!"}),
        json!({"cwd": "refused-model", "model": ""}),
        json!({"cwd": "refused-approvals", "require_approval": [""]}),
        json!({"cwd": "refused-budget", "budget_tokens": 0}),
    ] {
        let dir = body["cwd"].as_str().unwrap_or_default().to_owned();
        app.post("/v1/conversations", body)
            .await
            .expect_error(400, "invalid_request");
        assert!(
            !tenant_root.join(&dir).exists(),
            "a refused create made {dir}"
        );
    }
    // Images: too many, wrong type, bad base64, not an image.
    let img = |media_type: &str, data: &str| json!({"media_type": media_type, "data": data});
    let many: Vec<Value> = (0..9)
        .map(|_| img("image/png", &png_base64(2, 2)))
        .collect();
    app.post(
        &format!("/v1/conversations/{id}/messages"),
        json!({"text": "x", "images": many}),
    )
    .await
    .expect_error(400, "invalid_request");
    app.post(
        &format!("/v1/conversations/{id}/messages"),
        json!({"text": "x", "images": [img("image/tiff", &png_base64(2, 2))]}),
    )
    .await
    .expect_error(400, "invalid_request");
    app.post(
        &format!("/v1/conversations/{id}/messages"),
        json!({"text": "x", "images": [img("image/png", "%%%")]}),
    )
    .await
    .expect_error(400, "invalid_request");
    let not_png = base64::engine::general_purpose::STANDARD.encode("plain text");
    app.post(
        &format!("/v1/conversations/{id}/messages"),
        json!({"text": "x", "images": [img("image/png", &not_png)]}),
    )
    .await
    .expect_error(400, "invalid_request");
    // System events: server-only types are forbidden, unknown ones invalid.
    for server_only in [
        "system_notice",
        "system_error",
        "tool_progress",
        "tool_result",
        "approval_request",
    ] {
        app.post(
            &format!("/v1/conversations/{id}/events"),
            json!({"event": {"type": server_only}}),
        )
        .await
        .expect_error(400, "forbidden_event_type");
    }
    app.post(
        &format!("/v1/conversations/{id}/events"),
        json!({"event": {"type": "made_up"}}),
    )
    .await
    .expect_error(400, "invalid_request");
    app.post(
        &format!("/v1/conversations/{id}/requests/01a1ffc8-5310-7779-a631-22160777ba45"),
        json!({"payload": {"confirmed": true}}),
    )
    .await
    .expect_error(404, "not_found");
    // Nothing of this was stored, and the server is fine.
    assert!(app.messages(&id).await.is_empty());
    assert_eq!(
        app.request(Method::GET, "/healthz", None, None)
            .await
            .expect(200)["status"],
        "ok"
    );
    app.cleanup(db).await;
}

/// The busy check is atomic with acceptance: of concurrent sends exactly one is accepted.
#[tokio::test]
async fn concurrent_sends_accept_exactly_one() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let id = app.conversation().await;
        app.llm.latency(Duration::from_millis(1500));
        let path = format!("/v1/conversations/{id}/messages");
        let sends = (0..16).map(|i| app.post(&path, json!({"text": format!("message {i}")})));
        let replies = futures::future::join_all(sends).await;
        let accepted = replies.iter().filter(|r| r.status == 202).count();
        let busy: Vec<&crate::support::app::Reply> =
            replies.iter().filter(|r| r.status == 409).collect();
        assert_eq!(accepted, 1, "{replies:?}");
        assert_eq!(busy.len(), 15);
        for reply in busy {
            assert_eq!(reply.body["error"]["code"], "agent_busy");
            assert!(
                reply.body["error"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("cancel")
            );
        }
        app.wait_kind(&id, "idle").await;
        let messages = app.messages(&id).await;
        assert_eq!(
            messages
                .iter()
                .filter(|m| m["message_type"] == "user")
                .count(),
            1,
            "a refused send stores nothing"
        );
        app.cleanup(db).await;
    }
}

/// A repeat with the same message_id returns the original message and stores nothing.
#[tokio::test]
async fn idempotent_resend() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let first = app
        .post(
            &format!("/v1/conversations/{id}/messages"),
            json!({"text": "once", "message_id": "client-1"}),
        )
        .await
        .expect(202);
    assert_eq!(first["message"]["message_id"], "client-1");
    app.wait_kind(&id, "idle").await;
    let again = app
        .post(
            &format!("/v1/conversations/{id}/messages"),
            json!({"text": "once", "message_id": "client-1"}),
        )
        .await
        .expect(200);
    assert_eq!(again["message"]["id"], first["message"]["id"]);
    let count = app.messages(&id).await.len();
    assert_eq!(count, 2, "the repeat stored nothing");
    assert_eq!(app.llm.requests().len(), 1, "the repeat started no turn");
    app.cleanup(db).await;
}

/// A conversation of another tenant is a 404 on every route, the WebSocket included.
#[tokio::test]
async fn tenants_are_isolated() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let b = Some(app.key_b.as_str());
    let routes: Vec<(Method, String, Option<Value>)> = vec![
        (Method::GET, format!("/v1/conversations/{id}"), None),
        (
            Method::GET,
            format!("/v1/conversations/{id}/messages"),
            None,
        ),
        (
            Method::GET,
            format!("/v1/conversations/{id}/children"),
            None,
        ),
        (
            Method::POST,
            format!("/v1/conversations/{id}/messages"),
            Some(json!({"text": "hi"})),
        ),
        (
            Method::POST,
            format!("/v1/conversations/{id}/cancel"),
            Some(json!({})),
        ),
        (
            Method::POST,
            format!("/v1/conversations/{id}/events"),
            Some(json!({"event": {"type": "user_request", "kind": "usage"}})),
        ),
        (
            Method::POST,
            format!("/v1/conversations/{id}/requests/x"),
            Some(json!({"payload": {"confirmed": true}})),
        ),
        (
            Method::POST,
            format!("/v1/conversations/{id}/archive"),
            Some(json!({})),
        ),
        (
            Method::POST,
            format!("/v1/conversations/{id}/unarchive"),
            Some(json!({})),
        ),
        (Method::DELETE, format!("/v1/conversations/{id}"), None),
        (Method::GET, format!("/v1/conversations/{id}/stream"), None),
        (Method::GET, format!("/v1/conversations/{id}/ws"), None),
        (
            Method::GET,
            format!("/v1/conversations/{id}/images/x"),
            None,
        ),
    ];
    for (method, path, body) in routes {
        let reply = app.request(method.clone(), &path, b, body).await;
        assert_eq!(
            (reply.status, reply.body["error"]["code"].clone()),
            (404, json!("not_found")),
            "{method} {path}"
        );
    }
    let ws = tokio_tungstenite::connect_async(format!(
        "ws://{}/v1/conversations/{id}/ws?access_token={}",
        app.addr, app.key_b
    ))
    .await;
    match ws {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 404)
        }
        other => panic!("the handshake must fail with 404, got {other:?}"),
    }
    let listed = app
        .request(Method::GET, "/v1/conversations", b, None)
        .await
        .expect(200);
    assert_eq!(listed["conversations"], json!([]));
    // Tenant a still sees it, untouched.
    assert_eq!(app.state(&id).await["kind"], "idle");
    app.cleanup(db).await;
}

/// A flood of bad input: every request gets a contract 4xx and the server stays healthy.
#[tokio::test]
async fn a_flood_of_bad_input_leaves_the_server_healthy() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let bodies = [
        "",
        "null",
        "[]",
        "\"text\"",
        "{\"text\": null}",
        "{\"text\": \"x\", \"images\": \"no\"}",
        "{\"text\": \"x\", \"images\": [{\"media_type\": 1}]}",
        "{\"text\": \"x\", \"message_id\": 7}",
        "\u{0}\u{1}\u{2}",
        "{\"text\": \"\\ud800\"}",
        "{{{{",
        "{\"text\": \"x\"} trailing",
    ];
    let paths = [
        format!("/v1/conversations/{id}/messages"),
        "/v1/conversations".into(),
        format!("/v1/conversations/{id}/events"),
        format!("/v1/conversations/{id}/requests/abc"),
        "/v1/conversations/..%2F..%2Fetc%2Fpasswd/messages".into(),
        "/v1/conversations/%00/cancel".into(),
    ];
    let mut count = 0;
    for path in &paths {
        for body in bodies {
            if body.is_empty() && path == "/v1/conversations" {
                continue; // every field of a new conversation is optional
            }
            let response = app
                .http
                .post(format!("{}{path}", app.base))
                .bearer_auth(&app.key_a)
                .header("content-type", "application/json")
                .body(body.to_owned())
                .send()
                .await
                .expect("never a dropped connection");
            let status = response.status().as_u16();
            let json: Value = response.json().await.expect("a JSON error body");
            assert!(
                (400..500).contains(&status),
                "{path} {body:?} -> {status} {json}"
            );
            assert!(json["error"]["code"].is_string(), "{json}");
            count += 1;
        }
    }
    assert_eq!(count, paths.len() * bodies.len() - 1);
    assert_eq!(
        app.request(Method::GET, "/healthz", None, None)
            .await
            .expect(200)["status"],
        "ok"
    );
    assert!(app.messages(&id).await.is_empty());
    app.cleanup(db).await;
}

/// REQ-BED-013: images are checked, resized to the model's limit, stored, referenced from the
/// message, and sent to the LLM as data URLs.
#[tokio::test]
async fn images_are_resized_stored_and_sent() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_MODELS__DEFAULT__MAX_IMAGE_PX", "64")]).await;
    let id = app.conversation().await;
    let sent = app
        .post(
            &format!("/v1/conversations/{id}/messages"),
            json!({"text": "look", "images": [{"media_type": "image/png", "data": png_base64(256, 128)}]}),
        )
        .await
        .expect(202);
    let images = sent["message"]["content"]["images"]
        .as_array()
        .expect("image refs")
        .clone();
    assert_eq!(images.len(), 1);
    assert_eq!(images[0]["media_type"], "image/png");
    app.wait_kind(&id, "idle").await;
    let request = &app.llm.requests()[0];
    let user = request_messages(request)
        .iter()
        .find(|m| m["role"] == "user")
        .expect("the user message");
    let url = user["content"][1]["image_url"]["url"]
        .as_str()
        .expect("an image part")
        .to_owned();
    assert!(url.starts_with("data:image/png;base64,"));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&url["data:image/png;base64,".len()..])
        .expect("base64");
    let decoded = image::load_from_memory(&bytes).expect("an image");
    assert_eq!((decoded.width(), decoded.height()), (64, 32));
    // The stored image, for clients' thumbnails: the bytes the LLM got, with their type;
    // another tenant's or an unknown id is 404.
    let image_id = images[0]["id"].as_str().expect("an image id");
    let path = format!("/v1/conversations/{id}/images/{image_id}");
    let response = app
        .http
        .get(format!("{}{path}", app.base))
        .bearer_auth(&app.key_a)
        .send()
        .await
        .expect("the server answers");
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(response.headers()["content-type"], "image/png");
    assert_eq!(
        response.bytes().await.expect("the bytes").as_ref(),
        &bytes[..]
    );
    app.request(Method::GET, &path, Some(&app.key_b), None)
        .await
        .expect_error(404, "not_found");
    app.get(&format!(
        "/v1/conversations/{id}/images/01a2136f-0000-7000-8000-000000000000"
    ))
    .await
    .expect_error(404, "not_found");
    app.cleanup(db).await;
}

/// `dev` auth: a request without a key acts as tenant `default`, only on loopback.
#[tokio::test]
async fn dev_auth_mode() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_AUTH", "dev")]).await;
    let created = app
        .request(Method::POST, "/v1/conversations", None, Some(json!({})))
        .await
        .expect(201);
    let id = created["id"].as_str().expect("an id");
    app.request(Method::GET, &format!("/v1/conversations/{id}"), None, None)
        .await
        .expect(200);
    // A key still selects its own tenant.
    app.get(&format!("/v1/conversations/{id}"))
        .await
        .expect_error(404, "not_found");
    assert!(
        bedrock::api::resolve_auth(
            bedrock::config::AuthMode::Dev,
            "0.0.0.0:8080".parse().expect("an address")
        )
        .is_err()
    );
    assert_eq!(
        bedrock::api::resolve_auth(
            bedrock::config::AuthMode::Auto,
            "0.0.0.0:8080".parse().expect("an address")
        ),
        Ok(false)
    );
    assert_eq!(
        bedrock::api::resolve_auth(
            bedrock::config::AuthMode::Auto,
            "127.0.0.1:8080".parse().expect("an address")
        ),
        Ok(true)
    );
    app.cleanup(db).await;
}

/// SIGTERM-style shutdown: live clients get a close frame, the running tool is stopped and
/// recorded as interrupted, and the server exits in bounded time.
#[tokio::test]
async fn graceful_shutdown_interrupts_running_work() {
    use crate::support::ws::{Next, Ws, is_state};
    let db = TestDb::sqlite();
    let mut app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame().await;
    let sleep = crate::support::unique_sleep();
    app.llm
        .push([Llm::bash("call_long", &format!("touch started; {sleep}"))]);
    app.send(&id, "long").await;
    ws.frames_until(|f| is_state(f, "tool_executing")).await;
    app.written(&id, "started").await;
    crate::support::wait_running(&sleep).await;
    let started = std::time::Instant::now();
    app.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown is bounded: {:?}",
        started.elapsed()
    );
    // The client saw the interruption, then a going-away close.
    let mut closed = None;
    while let Some(next) = ws.next(WAIT).await {
        if let Next::Closed(code, _) = next {
            closed = code;
            break;
        }
    }
    assert_eq!(closed, Some(1001));
    eventually("the tool's process to be killed", WAIT, || async {
        (!crate::support::running(&sleep)).then_some(())
    })
    .await;
    app.start().await;
    assert_eq!(app.state(&id).await, json!({"kind": "idle"}));
    let messages = app.messages(&id).await;
    let tool = messages
        .iter()
        .find(|m| m["message_type"] == "tool")
        .expect("a tool result");
    assert_eq!(tool["content"]["output"], "interrupted by server shutdown");
    assert_eq!(
        app.llm.requests().len(),
        1,
        "no LLM request started after the shutdown began"
    );
    app.cleanup(db).await;
}
