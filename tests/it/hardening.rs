//! The HTTP edge against hostile clients (the security issue, items 3, 5 and 6): slow and
//! idle clients, the connection cap, cross-site requests (content types, Origin, Host),
//! MCP sessions bound to their key, the operator listener, revoked keys.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bedrock::testkit::Reply as Llm;
use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::http;

use crate::support::ws::{Next, Ws};
use crate::support::{TestApp, TestDb, WAIT, eventually};

/// A raw HTTP/1.1 exchange: writes `request`, reads until the server closes; returns the
/// status and the body.
async fn raw(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut tcp = TcpStream::connect(addr).await.expect("connects");
    tcp.write_all(request.as_bytes()).await.expect("written");
    let mut out = Vec::new();
    tokio::time::timeout(WAIT, tcp.read_to_end(&mut out))
        .await
        .expect("an answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// A GET of `path` addressed to `host`, closing after the answer.
async fn get_with_host(addr: SocketAddr, path: &str, host: &str) -> (u16, String) {
    raw(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
    )
    .await
}

/// Whether the server closes `tcp` within `within` (EOF or reset, after any bytes).
async fn closed_within(tcp: &mut TcpStream, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// A counter's value (summed over the series that match `filter`) from the operator
/// listener's /metrics.
async fn counter(app: &TestApp, name: &str, filter: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", app.metrics_base))
        .await
        .expect("the operator listener answers")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A client that keeps no idle connection (so that the connections under test are the only
/// ones the server holds).
fn fresh_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()
        .expect("a client")
}

/// 2,000 connections that sent half a request line: /healthz and a real turn still answer
/// while they hang, and each is closed after the header timeout.
#[tokio::test]
async fn slow_clients_are_cut_off_and_the_server_answers_meanwhile() {
    const SLOW: usize = 2000;
    let timeout = Duration::from_secs(5);
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_SERVER__HEADER_READ_TIMEOUT_MS", "5000")]).await;
    let id = app.conversation().await;
    let started = Instant::now();
    let mut slow = Vec::with_capacity(SLOW);
    for _ in 0..SLOW {
        let mut tcp = TcpStream::connect(app.addr).await.expect("connects");
        tcp.write_all(b"GET /healthz HT")
            .await
            .expect("half a request line");
        slow.push(tcp);
    }
    let opened = started.elapsed();
    // While they hang, the server answers others: a probe and a whole turn.
    let health = fresh_client()
        .get(format!("{}/healthz", app.base))
        .send()
        .await
        .expect("/healthz answers");
    assert_eq!(health.status(), 200);
    app.llm.push([Llm::text("still here")]);
    app.send(&id, "hello").await;
    app.wait_kind(&id, "idle").await;
    let messages = app.messages(&id).await;
    assert_eq!(
        messages.last().expect("a reply")["content"]["text"],
        "still here"
    );
    if started.elapsed() < timeout - Duration::from_secs(1) {
        // Not cut before their time.
        let mut buf = [0u8; 16];
        let early = slow[SLOW - 1].try_read(&mut buf);
        assert!(
            matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a slow client was closed before the header timeout: {early:?}"
        );
    }
    // Every one is closed after the header timeout (with slack for a busy machine).
    let closed = futures::future::join_all(
        slow.iter_mut()
            .map(|tcp| closed_within(tcp, timeout + Duration::from_secs(20))),
    )
    .await;
    let still_open = closed.iter().filter(|c| !**c).count();
    assert_eq!(still_open, 0, "{still_open} slow connections still open");
    assert!(
        started.elapsed() >= timeout,
        "closed no sooner than the timeout"
    );
    let timed_out = counter(
        &app,
        "bedrock_connections_timed_out_total",
        "reason=\"header_timeout\"",
    )
    .await;
    assert!(
        timed_out >= SLOW as f64,
        "{timed_out} counted (opened in {opened:?})"
    );
    app.cleanup(db).await;
}

/// A body that trickles in past its time limit gets 408, and the connection closes.
#[tokio::test]
async fn a_slow_body_gets_408() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_SERVER__BODY_READ_TIMEOUT_MS", "1000")]).await;
    let started = Instant::now();
    let (status, body) = raw(
        app.addr,
        &format!(
            "POST /v1/conversations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{",
            app.key_a
        ),
    )
    .await;
    assert_eq!(status, 408, "{body}");
    assert!(body.contains("request_timeout"), "{body}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    app.cleanup(db).await;
}

/// A kept-alive connection with nothing in flight is closed after the keep-alive timeout.
#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_SERVER__KEEP_ALIVE_TIMEOUT_MS", "700")]).await;
    let mut tcp = TcpStream::connect(app.addr).await.expect("connects");
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("a request");
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(WAIT, tcp.read(&mut buf))
        .await
        .expect("an answer")
        .expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let answered = Instant::now();
    assert!(closed_within(&mut tcp, Duration::from_secs(10)).await);
    let idle = answered.elapsed();
    assert!(
        idle >= Duration::from_millis(600) && idle < Duration::from_secs(5),
        "{idle:?}"
    );
    app.cleanup(db).await;
}

/// Over the connection cap, a connection is closed as soon as it is accepted, the refusals
/// are counted, and the server serves again once connections close.
#[tokio::test]
async fn the_connection_cap_refuses_at_once_and_recovers() {
    const CAP: usize = 16;
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_SERVER__MAX_CONNECTIONS", "16"),
            ("BEDROCK_SERVER__HEADER_READ_TIMEOUT_MS", "60000"),
        ],
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..CAP {
        let mut tcp = TcpStream::connect(app.addr).await.expect("connects");
        tcp.write_all(b"GET /healthz HT").await.expect("written");
        held.push(tcp);
    }
    // Each one more is closed at once.
    for _ in 0..30 {
        let mut tcp = TcpStream::connect(app.addr)
            .await
            .expect("the kernel accepts");
        let _ = tcp
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await;
        assert!(
            closed_within(&mut tcp, Duration::from_secs(2)).await,
            "a connection over the cap is closed at once"
        );
    }
    assert!(
        fresh_client()
            .get(format!("{}/healthz", app.base))
            .send()
            .await
            .is_err(),
        "over the cap, no answer"
    );
    let refused = counter(
        &app,
        "bedrock_connections_refused_total",
        "reason=\"max_connections\"",
    )
    .await;
    assert!(refused >= 31.0, "{refused}");
    // The held connections are still served.
    assert!(!closed_within(&mut held[0], Duration::from_millis(200)).await);
    drop(held);
    eventually("the server to serve again", WAIT, || async {
        let response = fresh_client()
            .get(format!("{}/healthz", app.base))
            .send()
            .await
            .ok()?;
        (response.status() == 200).then_some(())
    })
    .await;
    app.cleanup(db).await;
}

/// A WebSocket that answers nothing is pinged, then closed; one that answers stays.
#[tokio::test]
async fn a_silent_websocket_is_closed() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_SERVER__WS_PING_INTERVAL_MS", "300"),
            ("BEDROCK_SERVER__WS_IDLE_TIMEOUT_MS", "1500"),
        ],
    )
    .await;
    let id = app.conversation().await;
    let mut alive = Ws::connect(&app.ws_url(&id, "")).await;
    let mut silent = Ws::connect(&app.ws_url(&id, "")).await;
    alive.frame().await;
    silent.frame().await;
    // The live client reads (and so answers the pings) for twice the idle timeout.
    // (Ws::next skips pings, and they come more often than its timeout: bound the whole.)
    let read = tokio::time::timeout(Duration::from_secs(3), alive.next(WAIT)).await;
    assert!(
        read.is_err(),
        "a client that answers pings stays connected: {read:?}"
    );
    alive.send(&json!({"type": "ping"})).await;
    assert_eq!(alive.frame().await["type"], "pong");
    // The silent one did not read, so it answered no ping.
    match silent.next(WAIT).await {
        Some(Next::Closed(Some(1001), reason)) => assert!(reason.starts_with("idle"), "{reason}"),
        other => panic!("expected an idle close, got {other:?}"),
    }
    app.cleanup(db).await;
}

/// The status of a WebSocket handshake with these extra headers (101: upgraded).
async fn ws_handshake(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut request = url.into_client_request().expect("a request");
    for (name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).expect("a name"),
            http::HeaderValue::from_str(value).expect("a value"),
        );
    }
    match tokio_tungstenite::connect_async(request).await {
        Ok((mut socket, response)) => {
            let _ = futures::SinkExt::close(&mut socket).await;
            (response.status().as_u16(), String::new())
        }
        Err(tungstenite::Error::Http(response)) => (
            response.status().as_u16(),
            String::from_utf8_lossy(response.body().as_deref().unwrap_or_default()).into_owned(),
        ),
        Err(other) => panic!("the handshake failed: {other}"),
    }
}

/// JSON bodies need a JSON content type (a page cannot send them as a "simple" request);
/// WebSockets and /mcp refuse foreign origins; a body-less POST needs no content type.
#[tokio::test]
async fn cross_site_requests_are_refused() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[(
            "BEDROCK_SERVER__ALLOWED_ORIGINS",
            "[\"https://app.example\"]",
        )],
    )
    .await;
    let post = |content_type: Option<&'static str>, body: &'static str| {
        let mut request = app
            .http
            .post(format!("{}/v1/conversations", app.base))
            .bearer_auth(&app.key_a)
            .body(body);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        async move {
            let response = request.send().await.expect("an answer");
            let status = response.status().as_u16();
            let body: Value = response.json().await.expect("JSON");
            crate::support::app::Reply { status, body }
        }
    };
    post(Some("text/plain"), "{}")
        .await
        .expect_error(415, "unsupported_media_type");
    post(Some("application/x-www-form-urlencoded"), "{}")
        .await
        .expect_error(415, "unsupported_media_type");
    post(None, "{}")
        .await
        .expect_error(415, "unsupported_media_type");
    post(Some("application/json; charset=utf-8"), "{}")
        .await
        .expect(201);
    post(Some("application/merge-patch+json"), "{}")
        .await
        .expect(201);
    // Where every field is optional, no body at all needs no content type.
    post(None, "").await.expect(201);
    let id = app.conversation().await;
    app.request(
        Method::POST,
        &format!("/v1/conversations/{id}/cancel"),
        Some(&app.key_a),
        None,
    )
    .await
    .expect(202);

    // WebSocket: a foreign origin is refused; the server's own, a configured one and none
    // are served.
    let url = app.ws_url(&id, "");
    let (status, body) = ws_handshake(&url, &[("origin", "https://evil.example")]).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("origin_not_allowed"), "{body}");
    let (status, _) = ws_handshake(&url, &[("origin", "null")]).await;
    assert_eq!(status, 403);
    let own = format!("http://{}", app.addr);
    assert_eq!(ws_handshake(&url, &[("origin", &own)]).await.0, 101);
    assert_eq!(
        ws_handshake(&url, &[("origin", "https://app.example")])
            .await
            .0,
        101
    );
    assert_eq!(ws_handshake(&url, &[]).await.0, 101);
    // The same name on another port is another origin.
    let other_port = format!("http://127.0.0.1:{}", app.addr.port().wrapping_add(1));
    assert_eq!(ws_handshake(&url, &[("origin", &other_port)]).await.0, 403);

    // /mcp: the MCP conformance suite's DNS-rebinding scenario sends a foreign Origin.
    let initialize = mcp_initialize();
    let mcp = |origin: Option<String>| {
        let mut request = app
            .http
            .post(format!("{}/mcp", app.base))
            .bearer_auth(&app.key_a)
            .header("accept", "application/json, text/event-stream")
            .json(&initialize);
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        async move { request.send().await.expect("an answer").status().as_u16() }
    };
    assert_eq!(mcp(Some("http://evil.example".into())).await, 403);
    assert_eq!(mcp(Some(own.clone())).await, 200);
    assert_eq!(mcp(None).await, 200);
    app.cleanup(db).await;
}

/// Dev mode (no key needed) serves only requests addressed to loopback names or the
/// configured public host: a page cannot reach it through DNS rebinding.
#[tokio::test]
async fn dev_mode_refuses_foreign_hosts() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_AUTH", "dev"),
            ("BEDROCK_SERVER__PUBLIC_HOST", "bedrock.example"),
        ],
    )
    .await;
    let port = app.addr.port();
    for host in [
        "evil.example",
        "evil.example:80",
        "bedrock.example.evil",
        "10.0.0.1",
    ] {
        for path in ["/v1/conversations", "/healthz", "/mcp"] {
            let (status, body) = get_with_host(app.addr, path, host).await;
            assert_eq!(status, 403, "{host} {path}: {body}");
            assert!(body.contains("host_not_allowed"), "{body}");
        }
    }
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        "localhost".to_owned(),
        "bedrock.example".to_owned(),
        format!("bedrock.example:{port}"),
    ] {
        let (status, body) = get_with_host(app.addr, "/v1/conversations", &host).await;
        assert_eq!(status, 200, "{host}: {body}");
    }
    // The cross-site forms of dev mode's requests: a text/plain body, a foreign WebSocket.
    let (status, body) = raw(
        app.addr,
        &format!(
            "POST /v1/conversations HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        ),
    )
    .await;
    assert_eq!(status, 415, "{body}");
    let created = app
        .request(Method::POST, "/v1/conversations", None, Some(json!({})))
        .await
        .expect(201);
    let id = created["id"].as_str().expect("an id");
    let url = format!("ws://{}/v1/conversations/{id}/ws", app.addr);
    assert_eq!(
        ws_handshake(&url, &[("origin", "http://evil.example")])
            .await
            .0,
        403
    );
    assert_eq!(ws_handshake(&url, &[]).await.0, 101);
    // A body-less POST from another site (a "simple" request): refused by its Origin; the
    // server's own origin may.
    let (status, body) = raw(
        app.addr,
        &format!(
            "POST /v1/conversations/{id}/cancel HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: http://evil.example\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("origin_not_allowed"), "{body}");
    let (status, body) = raw(
        app.addr,
        &format!(
            "POST /v1/conversations HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nOrigin: http://127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    app.cleanup(db).await;
}

fn mcp_initialize() -> Value {
    json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "hardening", "version": "1"}
        }
    })
}

/// One MCP request over HTTP: status, the session id the answer names, the body's text.
async fn mcp_call(
    app: &TestApp,
    method: Method,
    key: &str,
    session: Option<&str>,
    body: Option<Value>,
) -> (u16, Option<String>, String) {
    let mut request = fresh_client()
        .request(method, format!("{}/mcp", app.base))
        .bearer_auth(key)
        .header("accept", "application/json, text/event-stream");
    if let Some(session) = session {
        request = request.header("mcp-session-id", session);
    }
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("an answer");
    let status = response.status().as_u16();
    let session = response
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // An answer is a JSON body or an event stream that ends after the answer.
    let text = tokio::time::timeout(Duration::from_secs(10), response.text())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    (status, session, text)
}

/// An MCP session answers only to the key that opened it: another tenant's requests with
/// its id are 404 (GET, POST, DELETE), and the session goes on for its owner.
#[tokio::test]
async fn mcp_sessions_belong_to_their_key() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        let (status, session, body) =
            mcp_call(&app, Method::POST, &app.key_a, None, Some(mcp_initialize())).await;
        assert_eq!(status, 200, "{body}");
        let session = session.expect("a session id");
        let (status, _, body) = mcp_call(
            &app,
            Method::POST,
            &app.key_a,
            Some(&session),
            Some(json!({"jsonrpc": "2.0", "method": "notifications/initialized"})),
        )
        .await;
        assert_eq!(status, 202, "{body}");
        let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
        // Tenant b, with tenant a's session id.
        for (method, body) in [
            (Method::POST, Some(list.clone())),
            (Method::GET, None),
            (Method::DELETE, None),
        ] {
            let (status, _, text) =
                mcp_call(&app, method.clone(), &app.key_b, Some(&session), body).await;
            assert_eq!(status, 404, "{method} by another tenant: {text}");
        }
        // An unknown session looks the same.
        let (status, _, _) = mcp_call(
            &app,
            Method::POST,
            &app.key_b,
            Some("not-a-session"),
            Some(list.clone()),
        )
        .await;
        assert_eq!(status, 404);
        // The owner's session is untouched.
        let (status, _, text) =
            mcp_call(&app, Method::POST, &app.key_a, Some(&session), Some(list)).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("send_message"), "{text}");
        let (status, _, text) =
            mcp_call(&app, Method::DELETE, &app.key_a, Some(&session), None).await;
        assert!((200..300).contains(&status), "{status} {text}");
        app.cleanup(db).await;
    }
}

/// The public `/metrics` (the contract's ops route) has no series per tenant: one tenant
/// learns nothing of another's use there. The operator listener has every series; it can be
/// turned off.
#[tokio::test]
async fn metrics_per_tenant_are_on_the_operator_listener_only() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    // A turn, so that token usage is counted per tenant.
    let id = app.conversation().await;
    app.llm.push([bedrock::testkit::Reply::text("counted")]);
    app.send(&id, "count me").await;
    app.wait_kind(&id, "idle").await;
    let full = reqwest::get(format!("{}/metrics", app.metrics_base))
        .await
        .expect("the operator listener answers");
    assert_eq!(full.status(), 200);
    let full = full.text().await.expect("text");
    assert!(full.contains("bedrock_http_connections"), "{full}");
    assert!(
        full.contains("tenant=\""),
        "per tenant on the operator listener: {full}"
    );
    let public = app
        .http
        .get(format!("{}/metrics", app.base))
        .send()
        .await
        .expect("the public port answers");
    assert_eq!(public.status(), 200);
    let public = public.text().await.expect("text");
    assert!(public.contains("bedrock_http_connections"), "{public}");
    assert!(
        !public
            .lines()
            .any(|l| !l.starts_with('#') && l.contains("tenant=")),
        "no series per tenant on the public port: {public}"
    );
    let ready = app
        .request(Method::GET, "/readyz", None, None)
        .await
        .expect(200);
    assert_eq!(
        ready["sandbox"]
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["mode".to_owned()]),
        "{ready}"
    );
    let openapi = app
        .request(Method::GET, "/openapi.json", None, None)
        .await
        .expect(200);
    assert!(openapi["paths"].get("/metrics").is_some());
    app.cleanup(db).await;
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &[("BEDROCK_METRICS__LISTEN", "off")]).await;
    assert!(app.metrics_base.is_empty(), "no operator listener");
    app.cleanup(db).await;
}

/// Keys are created, listed and revoked with the `bedrock tenant key` commands; a revoked
/// key is refused with 401 within `server.key_cache_ms`.
#[tokio::test]
async fn a_revoked_key_is_refused() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[("BEDROCK_SERVER__KEY_CACHE_MS", "300")]).await;
        let settings = app.settings();
        let created = bedrock::app::create_key(&settings, "a")
            .await
            .expect("a new key");
        let key = created["api_key"].as_str().expect("a key").to_owned();
        let key_id = created["key_id"].as_str().expect("an id").to_owned();
        app.request(Method::GET, "/v1/conversations", Some(&key), None)
            .await
            .expect(200);
        let listed = bedrock::app::list_keys(&settings, "a").await.expect("keys");
        let keys = listed["keys"].as_array().expect("keys");
        assert_eq!(keys.len(), 2, "{listed}");
        assert!(keys.iter().all(|k| k["revoked_at"].is_null()), "{listed}");
        assert!(
            !listed.to_string().contains(&key) && !listed.to_string().contains(&app.key_a),
            "a listing never shows a key"
        );
        // A WebSocket open with the key is closed when the key is revoked (1008).
        let id = app.conversation().await;
        let mut ws = Ws::connect(&format!(
            "ws://{}/v1/conversations/{id}/ws?access_token={key}",
            app.addr
        ))
        .await;
        // Revoke the new key by id; the old one by its prefix.
        let revoked = bedrock::app::revoke_key(&settings, "a", &key_id)
            .await
            .expect("revoked");
        assert!(revoked["key"]["revoked_at"].is_string(), "{revoked}");
        let revoked_at = Instant::now();
        eventually("the revoked key to be refused", WAIT, || async {
            let reply = app
                .request(Method::GET, "/v1/conversations", Some(&key), None)
                .await;
            (reply.status == 401).then_some(())
        })
        .await;
        assert!(
            revoked_at.elapsed() < Duration::from_secs(5),
            "refused within the cache's bound: {:?}",
            revoked_at.elapsed()
        );
        app.request(Method::GET, "/v1/conversations", Some(&key), None)
            .await
            .expect_error(401, "unauthorized");
        let closed = loop {
            match ws.next(Duration::from_secs(10)).await {
                Some(Next::Frame(_)) => {}
                other => break other,
            }
        };
        assert!(
            matches!(&closed, Some(Next::Closed(Some(1008), reason)) if reason.contains("revoked")),
            "the open WebSocket is closed: {closed:?}"
        );
        app.get("/v1/conversations").await.expect(200);
        let prefix: String = app.key_a.chars().take(10).collect();
        bedrock::app::revoke_key(&settings, "a", &prefix)
            .await
            .expect("revoked by prefix");
        eventually("the first key to be refused", WAIT, || async {
            (app.get("/v1/conversations").await.status == 401).then_some(())
        })
        .await;
        // Another tenant's key is untouched; an unknown key is an error.
        app.request(Method::GET, "/v1/conversations", Some(&app.key_b), None)
            .await
            .expect(200);
        assert!(
            bedrock::app::revoke_key(&settings, "a", "bk_nothing")
                .await
                .is_err()
        );
        let listed = bedrock::app::list_keys(&settings, "a").await.expect("keys");
        assert!(
            listed["keys"]
                .as_array()
                .expect("keys")
                .iter()
                .all(|k| k["revoked_at"].is_string()),
            "{listed}"
        );
        app.cleanup(db).await;
    }
}

/// A browser's WebSocket carries its key as the subprotocol `bearer.<key>` beside `bedrock`,
/// never in the URL: the server answers `bedrock` (not the key), and a wrong key is 401.
#[tokio::test]
async fn a_websocket_key_travels_as_a_subprotocol() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let id = app.conversation().await;
    let url = format!("ws://{}/v1/conversations/{id}/ws", app.addr);
    let mut request = url.as_str().into_client_request().expect("a request");
    request.headers_mut().insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        http::HeaderValue::from_str(&format!("bedrock, bearer.{}", app.key_a)).expect("a value"),
    );
    let (socket, response) = tokio_tungstenite::connect_async(request)
        .await
        .expect("the WebSocket connects");
    assert_eq!(
        response
            .headers()
            .get(http::header::SEC_WEBSOCKET_PROTOCOL)
            .and_then(|v| v.to_str().ok()),
        Some("bedrock"),
        "the server answers bedrock, never the key"
    );
    let mut ws = Ws { socket };
    match ws.next(WAIT).await {
        Some(Next::Frame(frame)) => assert_eq!(frame["type"], "snapshot", "{frame}"),
        other => panic!("expected the snapshot, got {other:?}"),
    }
    // Another tenant's key over the same route: 404, as everywhere; a bad key: 401.
    let (status, _) = ws_handshake(
        &url,
        &[(
            "sec-websocket-protocol",
            &format!("bedrock, bearer.{}", app.key_b),
        )],
    )
    .await;
    assert_eq!(status, 404);
    let (status, _) = ws_handshake(
        &url,
        &[("sec-websocket-protocol", "bedrock, bearer.bk_wrong")],
    )
    .await;
    assert_eq!(status, 401);
    app.cleanup(db).await;
}

/// The admin API on the operator listener: a tenant's keys listed, made and revoked over
/// HTTP with the admin token; a wrong or missing token is 401; without a token configured
/// there is no admin API.
#[tokio::test]
async fn keys_are_managed_over_the_admin_api() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(
            &db,
            &[
                ("BEDROCK_METRICS__ADMIN_TOKEN", "operator-secret"),
                ("BEDROCK_SERVER__KEY_CACHE_MS", "300"),
            ],
        )
        .await;
        let http = reqwest::Client::new();
        let admin = |method: Method, path: &str, token: Option<&str>| {
            let mut request = http.request(method, format!("{}{path}", app.metrics_base));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            request.send()
        };
        let status = |r: reqwest::Response| r.status().as_u16();
        assert_eq!(
            status(
                admin(Method::GET, "/admin/tenants/a/keys", None)
                    .await
                    .expect("answers")
            ),
            401
        );
        assert_eq!(
            status(
                admin(Method::GET, "/admin/tenants/a/keys", Some("wrong"))
                    .await
                    .expect("answers")
            ),
            401
        );
        let listed: Value = admin(
            Method::GET,
            "/admin/tenants/a/keys",
            Some("operator-secret"),
        )
        .await
        .expect("answers")
        .json()
        .await
        .expect("JSON");
        assert_eq!(listed["keys"].as_array().map(Vec::len), Some(1), "{listed}");
        let created = admin(
            Method::POST,
            "/admin/tenants/a/keys",
            Some("operator-secret"),
        )
        .await
        .expect("answers");
        assert_eq!(created.status().as_u16(), 201);
        let created: Value = created.json().await.expect("JSON");
        let key = created["api_key"]
            .as_str()
            .expect("the key, once")
            .to_owned();
        app.request(Method::GET, "/v1/conversations", Some(&key), None)
            .await
            .expect(200);
        let key_id = created["key_id"].as_str().expect("an id");
        let revoked = admin(
            Method::DELETE,
            &format!("/admin/tenants/a/keys/{key_id}"),
            Some("operator-secret"),
        )
        .await
        .expect("answers");
        assert_eq!(revoked.status().as_u16(), 200);
        eventually("the revoked key refused", WAIT, || async {
            let reply = app
                .request(Method::GET, "/v1/conversations", Some(&key), None)
                .await;
            (reply.status == 401).then_some(())
        })
        .await;
        assert_eq!(
            status(
                admin(
                    Method::GET,
                    "/admin/tenants/nobody/keys",
                    Some("operator-secret")
                )
                .await
                .expect("answers")
            ),
            404
        );
        // What a tenant tries first: its own key as the admin token, the admin routes on the
        // public listener, and another tenant's key revoked under its own name.
        assert_eq!(
            status(
                admin(Method::GET, "/admin/tenants/b/keys", Some(&app.key_a))
                    .await
                    .expect("answers")
            ),
            401
        );
        let public = http
            .get(format!("{}/admin/tenants/a/keys", app.base))
            .bearer_auth("operator-secret")
            .send()
            .await
            .expect("answers");
        assert_eq!(public.status().as_u16(), 404, "not on the public listener");
        let b_keys: Value = admin(
            Method::GET,
            "/admin/tenants/b/keys",
            Some("operator-secret"),
        )
        .await
        .expect("answers")
        .json()
        .await
        .expect("JSON");
        let b_key = b_keys["keys"][0]["key_id"].as_str().expect("b's key id");
        assert_eq!(
            status(
                admin(
                    Method::DELETE,
                    &format!("/admin/tenants/a/keys/{b_key}"),
                    Some("operator-secret")
                )
                .await
                .expect("answers")
            ),
            404,
            "a key is revoked only under its own tenant"
        );
        app.request(Method::GET, "/v1/conversations", Some(&app.key_b), None)
            .await
            .expect(200);
        app.cleanup(db).await;
    }
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let off = reqwest::Client::new()
        .get(format!("{}/admin/tenants/a/keys", app.metrics_base))
        .bearer_auth("")
        .send()
        .await
        .expect("answers");
    assert_eq!(off.status().as_u16(), 404, "no admin API without a token");
    app.cleanup(db).await;
}
