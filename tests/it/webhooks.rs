//! Tenants' webhooks (issue 39; docs/api.md, "Webhooks"). The receiver is a real HTTP
//! server on loopback (allowed by the operator's egress list) that verifies every request
//! with the Standard Webhooks specification's own library, and fails, hangs or answers as
//! a test tells it. On SQLite and Postgres, through the real server (and the real binary,
//! killed with SIGKILL, for durability).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use serde_json::{Value, json};

use crate::support::process::Server;
use crate::support::{TestApp, TestDb, WAIT, eventually};
use bedrock::testkit::{FakeLlm, Reply as Llm};

const ALLOW_LOOPBACK: (&str, &str) = ("BEDROCK_EGRESS__ALLOW", r#"["127.0.0.1"]"#);
const FAST: [(&str, &str); 4] = [
    ALLOW_LOOPBACK,
    ("BEDROCK_WEBHOOKS__POLL_MS", "50"),
    ("BEDROCK_WEBHOOKS__RETRY_INITIAL_MS", "100"),
    ("BEDROCK_WEBHOOKS__RETRY_MAX_DELAY_MS", "200"),
];

/// One request the receiver got.
#[derive(Clone, Debug)]
struct Got {
    id: String,
    body: Value,
    /// Verified with the current secret; with the secret before the rotation.
    verified: bool,
    verified_old: bool,
    signature: String,
    /// What it answered.
    answered: u16,
}

#[derive(Default)]
struct Receiver {
    got: Mutex<Vec<Got>>,
    secret: Mutex<Option<String>>,
    old_secret: Mutex<Option<String>>,
    /// Answer 500 to this many requests first.
    fail_first: AtomicUsize,
    /// Answer 500 to everything.
    always_fail: AtomicBool,
    /// Do not answer the next request for a long time.
    hang_next: AtomicBool,
    /// Take this long over every answer (milliseconds).
    slow_ms: AtomicUsize,
}

impl Receiver {
    fn got(&self) -> Vec<Got> {
        self.got.lock().expect("the log").clone()
    }

    fn of_type(&self, kind: &str) -> Vec<Got> {
        self.got()
            .into_iter()
            .filter(|g| g.body["type"] == kind)
            .collect()
    }
}

fn verifies(secret: &Option<String>, headers: &HeaderMap, body: &str) -> bool {
    secret.as_ref().is_some_and(|secret| {
        standardwebhooks::Webhook::new(secret)
            .expect("a Standard Webhooks secret")
            .verify(body.as_bytes(), headers)
            .is_ok()
    })
}

async fn receive(
    State(receiver): State<Arc<Receiver>>,
    headers: HeaderMap,
    body: String,
) -> axum::response::Response {
    let secret = receiver.secret.lock().expect("the secret").clone();
    let old = receiver.old_secret.lock().expect("the old secret").clone();
    let hang = receiver.hang_next.swap(false, Ordering::SeqCst);
    let fail = receiver.always_fail.load(Ordering::SeqCst)
        || receiver
            .fail_first
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
    let answered = if hang {
        0
    } else if fail {
        500
    } else {
        200
    };
    receiver.got.lock().expect("the log").push(Got {
        id: headers["webhook-id"]
            .to_str()
            .unwrap_or_default()
            .to_owned(),
        body: serde_json::from_str(&body).unwrap_or_default(),
        verified: verifies(&secret, &headers, &body),
        verified_old: verifies(&old, &headers, &body),
        signature: headers["webhook-signature"]
            .to_str()
            .unwrap_or_default()
            .to_owned(),
        answered,
    });
    if hang {
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
    let slow = receiver.slow_ms.load(Ordering::SeqCst);
    if slow > 0 {
        tokio::time::sleep(Duration::from_millis(slow as u64)).await;
    }
    if fail {
        return (StatusCode::INTERNAL_SERVER_ERROR, "not now").into_response();
    }
    (StatusCode::OK, "thanks").into_response()
}

async fn serve_receiver() -> (SocketAddr, Arc<Receiver>) {
    let state = Arc::new(Receiver::default());
    let router = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("an address");
    tokio::spawn(async move { axum::serve(listener, router).await });
    (addr, state)
}

/// Makes an endpoint for `events` and gives the receiver its secret; returns its id.
async fn subscribe(app: &TestApp, addr: SocketAddr, receiver: &Receiver, events: Value) -> String {
    let made = app
        .post(
            "/v1/webhooks",
            json!({"url": format!("http://{addr}/hook"), "events": events, "description": "ours"}),
        )
        .await
        .expect(201);
    let secret = made["secret"].as_str().expect("the secret, once");
    assert!(secret.starts_with("whsec_"), "{made}");
    *receiver.secret.lock().expect("the secret") = Some(secret.to_owned());
    made["id"].as_str().expect("an id").to_owned()
}

/// A new conversation of the tenant whose key is `key`.
async fn conversation_of(app: &TestApp, key: Option<&str>) -> String {
    let made = app
        .request(
            reqwest::Method::POST,
            "/v1/conversations",
            key,
            Some(json!({})),
        )
        .await
        .expect(201);
    made["id"].as_str().expect("an id").to_owned()
}

async fn one_turn(app: &TestApp, text: &str) -> String {
    let id = app.conversation().await;
    app.llm.push([Llm::text(text)]);
    app.send(&id, "hi").await;
    app.wait_kind(&id, "idle").await;
    id
}

/// A tenant allowed one attempt in flight whose endpoint is slow: the node claims several of
/// its deliveries at once and sends them one after another, each as the one before ends,
/// without waiting for its claims to run out (`claim_ms`, two minutes here) when a cycle
/// claims nothing new and nothing is in flight.
#[tokio::test]
async fn deliveries_held_over_a_tenants_limit_go_out_as_the_last_ends() {
    for db in TestDb::each().await {
        let settings = [
            ALLOW_LOOPBACK,
            ("BEDROCK_WEBHOOKS__POLL_MS", "50"),
            ("BEDROCK_WEBHOOKS__PER_TENANT", "1"),
            ("BEDROCK_WEBHOOKS__CLAIM_MS", "120000"),
        ];
        let app = TestApp::spawn_with(&db, &settings).await;
        let (addr, receiver) = serve_receiver().await;
        receiver.slow_ms.store(300, Ordering::SeqCst);
        subscribe(&app, addr, &receiver, json!(["turn.completed"])).await;
        let mut ids = Vec::new();
        for n in 0..4 {
            ids.push(one_turn(&app, &format!("turn {n}")).await);
        }
        let got = eventually(
            "the four deliveries, well before the claims run out",
            Duration::from_secs(20),
            || async {
                let got = receiver.of_type("turn.completed");
                (got.len() >= 4).then_some(got)
            },
        )
        .await;
        let mut to: Vec<String> = got
            .iter()
            .map(|g| {
                g.body["data"]["conversation_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        to.sort();
        ids.sort();
        assert_eq!(to, ids, "each conversation's turn once: {got:?}");
        app.cleanup(db).await;
    }
}

/// REQ-BED-002 told to a backend with no socket: a turn's end reaches the endpoint signed
/// (verified by the Standard Webhooks library), is retried after failures with the same
/// `webhook-id`, and every attempt is in the delivery's log; a retry sends it again. The
/// secret is shown once; another tenant sees none of it.
#[tokio::test]
async fn webhooks_are_signed_retried_and_logged() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &FAST).await;
        let (addr, receiver) = serve_receiver().await;
        receiver.fail_first.store(2, Ordering::SeqCst);
        let hook = subscribe(&app, addr, &receiver, json!(["turn.completed"])).await;

        let listed = app.get("/v1/webhooks").await.expect(200);
        assert_eq!(listed["webhooks"][0]["id"], hook.as_str());
        assert_eq!(listed["webhooks"][0]["events"], json!(["turn.completed"]));
        assert!(listed["webhooks"][0].get("secret").is_none(), "{listed}");
        let one = app.get(&format!("/v1/webhooks/{hook}")).await.expect(200);
        assert!(one.get("secret").is_none(), "{one}");

        let id = one_turn(&app, "hello").await;
        let delivered = eventually("the delivery to succeed", WAIT, || async {
            let got = receiver.of_type("turn.completed");
            got.iter().any(|g| g.answered == 200).then_some(got)
        })
        .await;
        assert_eq!(
            delivered.len(),
            3,
            "two failures, then the delivery: {delivered:?}"
        );
        assert!(delivered.iter().all(|g| g.verified), "{delivered:?}");
        assert!(
            delivered.iter().all(|g| g.id == delivered[0].id),
            "{delivered:?}"
        );
        let data = &delivered[0].body["data"];
        assert_eq!(data["conversation_id"], id.as_str());
        assert_eq!(data["state"], "idle");
        assert!(
            data["turn_id"].is_string() && data["event_id"].is_i64(),
            "{data}"
        );

        let deliveries = eventually("the log to show the success", WAIT, || async {
            let page = app
                .get(&format!("/v1/webhooks/{hook}/deliveries"))
                .await
                .expect(200);
            (page["deliveries"][0]["status"] == "succeeded").then_some(page)
        })
        .await;
        let delivery = &deliveries["deliveries"][0];
        assert_eq!(delivery["id"], delivered[0].id.as_str());
        assert_eq!(delivery["attempts"], 3);
        let statuses: Vec<&Value> = delivery["attempt_log"]
            .as_array()
            .expect("the attempts")
            .iter()
            .map(|a| &a["status"])
            .collect();
        assert_eq!(statuses, [&json!(500), &json!(500), &json!(200)]);
        assert_eq!(delivery["attempt_log"][2]["excerpt"], "thanks");
        assert_eq!(delivery["last_status"], 200);
        assert!(delivery["next_attempt_at"].is_null(), "{delivery}");

        // Sent again on request, with the same id.
        let delivery_id = delivered[0].id.clone();
        app.post(
            &format!("/v1/webhooks/{hook}/deliveries/{delivery_id}/retry"),
            json!({}),
        )
        .await
        .expect(202);
        eventually("the retried delivery", WAIT, || async {
            (receiver.of_type("turn.completed").len() == 4).then_some(())
        })
        .await;

        // Another tenant: nothing of it, 404 everywhere.
        let b = Some(app.key_b.as_str());
        let get = reqwest::Method::GET;
        let listed_b = app
            .request(get.clone(), "/v1/webhooks", b, None)
            .await
            .expect(200);
        assert_eq!(listed_b["webhooks"], json!([]));
        for (method, path) in [
            (get.clone(), format!("/v1/webhooks/{hook}")),
            (get.clone(), format!("/v1/webhooks/{hook}/deliveries")),
            (reqwest::Method::DELETE, format!("/v1/webhooks/{hook}")),
            (
                reqwest::Method::POST,
                format!("/v1/webhooks/{hook}/rotate_secret"),
            ),
            (
                reqwest::Method::POST,
                format!("/v1/webhooks/{hook}/deliveries/{delivery_id}/retry"),
            ),
        ] {
            app.request(method, &path, b, Some(json!({})))
                .await
                .expect_error(404, "not_found");
        }
        app.request(
            reqwest::Method::PATCH,
            &format!("/v1/webhooks/{hook}"),
            b,
            Some(json!({"enabled": false})),
        )
        .await
        .expect_error(404, "not_found");
        // Tenant b's turns tell tenant a's endpoint nothing.
        let before = receiver.got().len();
        let conv_b = conversation_of(&app, b).await;
        app.llm.push([Llm::text("b's")]);
        app.request(
            reqwest::Method::POST,
            &format!("/v1/conversations/{conv_b}/messages"),
            b,
            Some(json!({"text": "hi"})),
        )
        .await
        .expect(202);
        eventually("b's turn to end", WAIT, || async {
            let state = app
                .request(get.clone(), &format!("/v1/conversations/{conv_b}"), b, None)
                .await
                .expect(200);
            (state["state"]["kind"] == "idle").then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(receiver.got().len(), before);

        app.cleanup(db).await;
    }
}

/// What a hostile tenant tries first against its endpoints: a flood of changes to one of
/// them (events switched back and forth, its secret rotated), all at once. Each is answered
/// (no 5xx); another tenant's events keep reaching its own endpoint, once each; and the
/// flooding tenant's last change counts at once on this node (its next turn's event goes by
/// it), so a change reads only the changing tenant's endpoints, never every tenant's.
#[tokio::test]
async fn a_flood_of_endpoint_changes_costs_other_tenants_nothing() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &FAST).await;
        let b = Some(app.key_b.as_str());
        let (addr_a, receiver_a) = serve_receiver().await;
        let (addr_b, receiver_b) = serve_receiver().await;
        let hook_a = subscribe(&app, addr_a, &receiver_a, json!(["turn.completed"])).await;
        let made_b = app
            .request(
                reqwest::Method::POST,
                "/v1/webhooks",
                b,
                Some(json!({"url": format!("http://{addr_b}/hook"), "events": ["turn.completed"]})),
            )
            .await
            .expect(201);
        *receiver_b.secret.lock().expect("the secret") =
            made_b["secret"].as_str().map(str::to_owned);

        let conv_b = conversation_of(&app, b).await;
        app.llm.push([Llm::text("b's")]);
        let flood = (0..40).map(|i| {
            let (method, path, body) = if i % 5 == 4 {
                (
                    reqwest::Method::POST,
                    format!("/v1/webhooks/{hook_a}/rotate_secret"),
                    None,
                )
            } else {
                let events = if i % 2 == 0 {
                    json!(["turn.failed"])
                } else {
                    json!(["turn.completed", "turn.failed"])
                };
                (
                    reqwest::Method::PATCH,
                    format!("/v1/webhooks/{hook_a}"),
                    Some(json!({ "events": events })),
                )
            };
            let key = app.key_a.clone();
            let app = &app;
            async move { app.request(method, &path, Some(&key), body).await.status }
        });
        let to_b = format!("/v1/conversations/{conv_b}/messages");
        let send_b = app.request(reqwest::Method::POST, &to_b, b, Some(json!({"text": "hi"})));
        let (statuses, sent) = tokio::join!(futures::future::join_all(flood), send_b);
        sent.expect(202);
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
        eventually("b's event at b's endpoint", WAIT, || async {
            (receiver_b.of_type("turn.completed").len() == 1).then_some(())
        })
        .await;

        // The flood's last word counts at once: unsubscribed, a's turn tells a nothing;
        // subscribed again, its next turn is told.
        let subscribe = |event: &'static str| {
            let (app, path) = (&app, format!("/v1/webhooks/{hook_a}"));
            async move {
                let events = json!({ "events": [event] });
                app.request(
                    reqwest::Method::PATCH,
                    &path,
                    Some(&app.key_a),
                    Some(events),
                )
                .await
                .expect(200);
            }
        };
        subscribe("turn.failed").await;
        let before = receiver_a.of_type("turn.completed").len();
        one_turn(&app, "not told").await;
        subscribe("turn.completed").await;
        let told = one_turn(&app, "told").await;
        let got = eventually("a's event after the flood", WAIT, || async {
            let got = receiver_a.of_type("turn.completed");
            (got.len() > before).then_some(got)
        })
        .await;
        assert_eq!(got.len(), before + 1, "only the subscribed turn is told");
        assert_eq!(got[before].body["data"]["conversation_id"], told.as_str());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(receiver_b.of_type("turn.completed").len(), 1, "b's once");
        app.cleanup(db).await;
    }
}

/// A request to the client (`request.created`, naming the request and the call), a
/// cancelled turn, a failed one and a spent budget are each told, as subscribed; an
/// unsubscribed event is not.
#[tokio::test]
async fn requests_cancels_failures_and_budgets_are_told() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &FAST).await;
        let (addr, receiver) = serve_receiver().await;
        subscribe(
            &app,
            addr,
            &receiver,
            json!([
                "request.created",
                "turn.cancelled",
                "turn.failed",
                "budget.exhausted"
            ]),
        )
        .await;
        let conv = app
            .post("/v1/conversations", json!({"require_approval": ["bash"]}))
            .await
            .expect(201);
        let id = conv["id"].as_str().expect("an id").to_owned();
        app.llm.push([Llm::bash("call_1", "echo hi")]);
        app.send(&id, "run it").await;
        let asked = eventually("request.created", WAIT, || async {
            receiver.of_type("request.created").pop()
        })
        .await;
        let data = &asked.body["data"];
        assert_eq!(data["conversation_id"], id.as_str());
        assert_eq!(data["kind"], "confirm");
        assert_eq!(data["tool_use_id"], "call_1");
        assert!(data["request_id"].is_string(), "{data}");

        app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
            .await
            .expect(202);
        let cancelled = eventually("turn.cancelled", WAIT, || async {
            receiver.of_type("turn.cancelled").pop()
        })
        .await;
        assert_eq!(cancelled.body["data"]["conversation_id"], id.as_str());

        app.llm.push([Llm::status(401, "bad key")]);
        app.send(&id, "again").await;
        let failed = eventually("turn.failed", WAIT, || async {
            receiver.of_type("turn.failed").pop()
        })
        .await;
        assert_eq!(failed.body["data"]["state"], "error");
        assert_eq!(failed.body["data"]["error_kind"], "auth");
        assert!(failed.body["data"]["message"].is_string());
        // turn.completed was not subscribed: never sent.
        assert!(receiver.of_type("turn.completed").is_empty());
        assert!(receiver.got().iter().all(|g| g.verified));
        app.cleanup(db).await;
    }
}

/// The hostile tenant's first tries: an endpoint on the node's own network (loopback in
/// several spellings, the metadata address, a name that resolves to loopback) is refused
/// at creation; bad URLs and events are 400s; the quota holds.
#[tokio::test]
async fn internal_addresses_bad_input_and_the_quota_are_refused() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_QUOTAS__WEBHOOKS", "1"),
            ("BEDROCK_QUOTAS__SCHEDULES", "1"),
        ],
    )
    .await;
    for url in [
        "http://127.0.0.1:5432/",
        "http://127.1/",
        "http://0x7f000001/",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://0.0.0.0/",
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1/",
        "http://localhost/",
    ] {
        app.post(
            "/v1/webhooks",
            json!({"url": url, "events": ["turn.completed"]}),
        )
        .await
        .expect_error(400, "egress_refused");
    }
    for (body, why) in [
        (
            json!({"url": "ftp://example.com/", "events": ["turn.completed"]}),
            "a scheme",
        ),
        (
            json!({"url": "http://user:pw@example.com/", "events": ["turn.completed"]}),
            "credentials",
        ),
        (
            json!({"url": "not a url", "events": ["turn.completed"]}),
            "not a URL",
        ),
        (
            json!({"url": "http://93.184.215.14/", "events": []}),
            "no event",
        ),
        (
            json!({"url": "http://93.184.215.14/", "events": ["turn.done"]}),
            "an unknown event",
        ),
        (
            json!({"url": "http://93.184.215.14/", "events": "turn.completed"}),
            "events not a list",
        ),
        (
            json!({"url": "http://93.184.215.14/", "events": ["turn.completed"], "description": "x".repeat(300)}),
            "a long description",
        ),
        (
            json!({"url": "http://93.184.215.14/", "events": ["turn.completed"], "secret": "mine"}),
            "an unknown field",
        ),
    ] {
        let reply = app.post("/v1/webhooks", body).await;
        assert!(
            reply.status == 400 || reply.status == 422,
            "{why}: {} {}",
            reply.status,
            reply.body
        );
        assert!(
            reply.body["error"]["code"].is_string(),
            "{why}: {}",
            reply.body
        );
    }
    app.post(
        "/v1/webhooks",
        json!({"url": "http://93.184.215.14/hook", "events": ["turn.completed"]}),
    )
    .await
    .expect(201);
    app.post(
        "/v1/webhooks",
        json!({"url": "http://93.184.215.14/other", "events": ["turn.completed"]}),
    )
    .await
    .expect_error(429, "quota_exceeded");
    // Schedules have a quota too: a tenant cannot fire more than its share.
    let conv = app.conversation().await;
    app.post(
        "/v1/schedules",
        json!({"conversation_id": conv, "message": "x", "every": "1h"}),
    )
    .await
    .expect(201);
    app.post(
        "/v1/schedules",
        json!({"conversation_id": conv, "message": "y", "every": "1h"}),
    )
    .await
    .expect_error(429, "quota_exceeded");
    app.cleanup(db).await;
}

/// An endpoint that fails for longer than `disable_after_ms` is disabled and says why; its
/// pending deliveries fail; enabling it again forgets its failures.
#[tokio::test]
async fn a_failing_endpoint_is_disabled_and_says_why() {
    for db in TestDb::each().await {
        let mut extra = FAST.to_vec();
        extra.push(("BEDROCK_WEBHOOKS__DISABLE_AFTER_MS", "400"));
        let app = TestApp::spawn_with(&db, &extra).await;
        let (addr, receiver) = serve_receiver().await;
        receiver.always_fail.store(true, Ordering::SeqCst);
        let hook = subscribe(&app, addr, &receiver, json!(["turn.completed"])).await;
        one_turn(&app, "hello").await;
        let disabled = eventually("the endpoint to be disabled", WAIT, || async {
            let hook = app.get(&format!("/v1/webhooks/{hook}")).await.expect(200);
            (hook["enabled"] == false).then_some(hook)
        })
        .await;
        let reason = disabled["disabled_reason"].as_str().expect("a reason");
        assert!(
            reason.contains("failed since") && reason.contains("HTTP 500"),
            "{reason}"
        );
        assert!(disabled["failing_since"].is_string(), "{disabled}");
        let page = app
            .get(&format!("/v1/webhooks/{hook}/deliveries?status=failed"))
            .await
            .expect(200);
        assert_eq!(
            page["deliveries"].as_array().map(Vec::len),
            Some(1),
            "{page}"
        );
        // A disabled endpoint is sent nothing, and a retry asks to enable it first.
        let attempts = receiver.got().len();
        one_turn(&app, "again").await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(receiver.got().len(), attempts);
        let delivery = page["deliveries"][0]["id"].as_str().expect("an id");
        app.post(
            &format!("/v1/webhooks/{hook}/deliveries/{delivery}/retry"),
            json!({}),
        )
        .await
        .expect_error(409, "webhook_disabled");

        receiver.always_fail.store(false, Ordering::SeqCst);
        let enabled = app
            .request(
                reqwest::Method::PATCH,
                &format!("/v1/webhooks/{hook}"),
                Some(&app.key_a),
                Some(json!({"enabled": true})),
            )
            .await
            .expect(200);
        assert_eq!(enabled["enabled"], true);
        assert!(enabled["disabled_reason"].is_null() && enabled["failing_since"].is_null());
        app.post(
            &format!("/v1/webhooks/{hook}/deliveries/{delivery}/retry"),
            json!({}),
        )
        .await
        .expect(202);
        eventually("the retried delivery to succeed", WAIT, || async {
            receiver
                .got()
                .iter()
                .any(|g| g.id == delivery && g.answered == 200)
                .then_some(())
        })
        .await;
        app.cleanup(db).await;
    }
}

/// After a rotation the new secret is shown once, and for a while each request carries two
/// signatures: receivers verify with either secret.
#[tokio::test]
async fn a_rotated_secret_signs_beside_the_old_one() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(&db, &FAST).await;
    let (addr, receiver) = serve_receiver().await;
    let hook = subscribe(&app, addr, &receiver, json!(["turn.completed"])).await;
    let rotated = app
        .post(&format!("/v1/webhooks/{hook}/rotate_secret"), json!({}))
        .await
        .expect(200);
    let new = rotated["secret"]
        .as_str()
        .expect("the new secret")
        .to_owned();
    let old = receiver
        .secret
        .lock()
        .expect("the secret")
        .replace(new.clone());
    assert_ne!(old.as_deref(), Some(new.as_str()));
    *receiver.old_secret.lock().expect("the old secret") = old;
    one_turn(&app, "hello").await;
    let got = eventually("the delivery", WAIT, || async {
        receiver.of_type("turn.completed").pop()
    })
    .await;
    assert!(got.verified && got.verified_old, "{got:?}");
    assert_eq!(got.signature.split(' ').count(), 2, "{}", got.signature);
    app.cleanup(db).await;
}

/// Nothing acknowledged is lost: the process is killed (SIGKILL) while an attempt is in
/// flight; after the restart the claim of the dead process runs out, the delivery is made
/// again with the same `webhook-id`, and it succeeds exactly once.
#[tokio::test]
async fn a_delivery_survives_kill_9_and_succeeds_once() {
    for db in TestDb::each().await {
        let llm = FakeLlm::start().await;
        let workspace = crate::support::db::temp_dir("webhook-kill");
        let (addr, receiver) = serve_receiver().await;
        receiver.hang_next.store(true, Ordering::SeqCst);
        let command = || {
            let mut cmd = crate::support::process::command(&db, &llm, &workspace);
            cmd.env("BEDROCK_EGRESS__ALLOW", r#"["127.0.0.1"]"#)
                .env("BEDROCK_WEBHOOKS__POLL_MS", "50")
                .env("BEDROCK_WEBHOOKS__TIMEOUT_MS", "20000")
                .env("BEDROCK_WEBHOOKS__CLAIM_MS", "21000")
                .env("BEDROCK_WEBHOOKS__RETRY_INITIAL_MS", "100");
            cmd
        };
        let server = Server::start_with(command());
        let made = server
            .post(
                "/webhooks",
                json!({"url": format!("http://{addr}/hook"), "events": ["turn.completed"]}),
            )
            .await;
        *receiver.secret.lock().expect("the secret") =
            Some(made["secret"].as_str().expect("a secret").to_owned());
        let hook = made["id"].as_str().expect("an id").to_owned();
        let conv = server.conversation().await;
        let id = conv["id"].as_str().expect("an id").to_owned();
        llm.push([Llm::text("hello")]);
        server.send(&id, "hi").await;
        let first = eventually("the first attempt (which hangs)", WAIT, || async {
            receiver.of_type("turn.completed").pop()
        })
        .await;
        server.kill_hard();

        // The restarted process cannot take the dead one's claim until it runs out (its
        // attempt may still be under way for all it knows); then it sends it again.
        let mut cmd = command();
        cmd.env("BEDROCK_WEBHOOKS__TIMEOUT_MS", "1000")
            .env("BEDROCK_WEBHOOKS__CLAIM_MS", "1500");
        let server = Server::start_with(cmd);
        let delivered = eventually(
            "the delivery after the restart",
            Duration::from_secs(60),
            || async {
                let got = receiver.of_type("turn.completed");
                got.iter().any(|g| g.answered == 200).then_some(got)
            },
        )
        .await;
        assert!(
            delivered.iter().all(|g| g.id == first.id && g.verified),
            "{delivered:?}"
        );
        assert_eq!(delivered.iter().filter(|g| g.answered == 200).count(), 1);
        let page = eventually("the delivery's record", WAIT, || async {
            let page = server.get(&format!("/webhooks/{hook}/deliveries")).await?;
            (page["deliveries"][0]["status"] == "succeeded").then_some(page)
        })
        .await;
        assert_eq!(
            page["deliveries"].as_array().map(Vec::len),
            Some(1),
            "{page}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            receiver
                .of_type("turn.completed")
                .iter()
                .filter(|g| g.answered == 200)
                .count(),
            1
        );
        let _ = server.terminate();
        crate::support::process::remove_workspace(&workspace);
        db.drop_db().await;
    }
}

/// Three real nodes on one Postgres: turns run on every node, each event is delivered by
/// one node once (its `webhook-id` seen once), and a conversation's deliveries arrive in
/// the order of its turns.
#[tokio::test]
async fn a_cluster_delivers_each_event_once_and_in_order() {
    let Some(db) = TestDb::postgres().await else {
        #[allow(clippy::print_stderr)]
        {
            eprintln!("SKIPPED: the cluster's webhooks need Postgres (BEDROCK_TEST_DATABASE_URL)");
        }
        return;
    };
    bedrock::install_crypto();
    let llm = FakeLlm::start().await;
    llm.fallback(Llm::text("done"));
    let workspace = crate::support::db::temp_dir("webhook-cluster");
    let (addr, receiver) = serve_receiver().await;
    let node = |id: &str| {
        let mut cmd = crate::support::process::command(&db, &llm, &workspace);
        cmd.env("BEDROCK_CLUSTER__NODE_ID", id)
            .env("BEDROCK_CLUSTER__LEASE_TTL_MS", "2000")
            .env("BEDROCK_CLUSTER__HEARTBEAT_MS", "500")
            .env("BEDROCK_EGRESS__ALLOW", r#"["127.0.0.1"]"#)
            .env("BEDROCK_WEBHOOKS__POLL_MS", "50")
            // A cycle whose write failed on a busy machine is made again within the wait.
            .env("BEDROCK_WEBHOOKS__TIMEOUT_MS", "2000")
            .env("BEDROCK_WEBHOOKS__CLAIM_MS", "3000")
            // An attempt that failed there is made again within the wait too (and the
            // conversation's later deliveries, which wait for it).
            .env("BEDROCK_WEBHOOKS__RETRY_INITIAL_MS", "300")
            .env("BEDROCK_WEBHOOKS__RETRY_MAX_DELAY_MS", "1000");
        Server::start_with(cmd)
    };
    let nodes: Vec<Server> = ["a", "b", "c"].iter().map(|id| node(id)).collect();
    let made = nodes[0]
        .post(
            "/webhooks",
            json!({"url": format!("http://{addr}/hook"), "events": ["turn.completed"]}),
        )
        .await;
    *receiver.secret.lock().expect("the secret") =
        Some(made["secret"].as_str().expect("a secret").to_owned());
    // Every node sees the endpoint within a second (its refresh); on a busy machine later.
    // A node that knows it writes its turns' events: each proves it with a turn told.
    for server in &nodes {
        eventually("the node to know the endpoint", WAIT, || async {
            let conv = server.conversation().await;
            let id = conv["id"].as_str().expect("an id").to_owned();
            server.send(&id, "warm").await;
            let told = async {
                loop {
                    if receiver
                        .of_type("turn.completed")
                        .iter()
                        .any(|g| g.body["data"]["conversation_id"] == id.as_str())
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(3), told)
                .await
                .ok()
        })
        .await;
    }
    let turns = 3;
    let mut conversations = Vec::new();
    for server in &nodes {
        for _ in 0..2 {
            let conv = server.conversation().await;
            conversations.push(conv["id"].as_str().expect("an id").to_owned());
        }
    }
    let runs = conversations.iter().enumerate().map(|(n, id)| {
        let server = &nodes[n % nodes.len()];
        async move {
            for turn in 0..turns {
                server.send(id, &format!("turn {turn}")).await;
                eventually("the turn to end", WAIT, || async {
                    let conv = server.get(&format!("/conversations/{id}")).await?;
                    (conv["state"]["kind"] == "idle").then_some(())
                })
                .await;
            }
        }
    });
    futures::future::join_all(runs).await;
    let expected = conversations.len() * turns;
    let ours = || {
        receiver
            .of_type("turn.completed")
            .into_iter()
            .filter(|g| {
                conversations
                    .iter()
                    .any(|id| g.body["data"]["conversation_id"] == id.as_str())
            })
            .collect::<Vec<Got>>()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while ours().len() < expected {
        if tokio::time::Instant::now() >= deadline {
            let logs: Vec<String> = nodes
                .iter()
                .flat_map(|n| n.logs.lock().map(|l| l.clone()).unwrap_or_default())
                .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("webhook"))
                .collect();
            panic!(
                "{} of {expected} deliveries in time; the nodes said: {logs:#?}",
                ours().len()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = ours();
    assert_eq!(got.len(), expected, "an event delivered twice or lost");
    let ids: HashSet<&str> = got.iter().map(|g| g.id.as_str()).collect();
    assert_eq!(ids.len(), expected);
    assert!(got.iter().all(|g| g.verified));
    for id in &conversations {
        let events: Vec<i64> = got
            .iter()
            .filter(|g| g.body["data"]["conversation_id"] == id.as_str())
            .filter_map(|g| g.body["data"]["event_id"].as_i64())
            .collect();
        assert_eq!(events.len(), turns, "{id}");
        assert!(
            events.windows(2).all(|w| w[0] < w[1]),
            "{id}: out of order {events:?}"
        );
    }
    for server in nodes {
        server.kill_hard();
    }
    crate::support::process::remove_workspace(&workspace);
    db.drop_db().await;
}

/// Finished deliveries and runs are removed after their keeping (`[webhooks] keep_ms`,
/// `[schedules] keep_runs_ms`): a schedule every second must not grow the database
/// without bound.
#[tokio::test]
async fn finished_deliveries_and_runs_are_removed_after_their_keeping() {
    let db = TestDb::sqlite();
    let mut extra = FAST.to_vec();
    extra.extend([
        ("BEDROCK_WEBHOOKS__KEEP_MS", "400"),
        ("BEDROCK_SCHEDULES__KEEP_RUNS_MS", "400"),
        ("BEDROCK_SCHEDULES__POLL_MS", "50"),
    ]);
    let app = TestApp::spawn_with(&db, &extra).await;
    let (addr, receiver) = serve_receiver().await;
    let hook = subscribe(&app, addr, &receiver, json!(["turn.completed"])).await;
    let id = one_turn(&app, "hello").await;
    eventually("the delivery", WAIT, || async {
        let page = app
            .get(&format!("/v1/webhooks/{hook}/deliveries"))
            .await
            .expect(200);
        (page["deliveries"][0]["status"] == "succeeded").then_some(())
    })
    .await;
    let at = (chrono::Utc::now() + chrono::Duration::milliseconds(100)).to_rfc3339();
    let schedule = app
        .post(
            "/v1/schedules",
            json!({"conversation_id": id, "message": "again", "at": at}),
        )
        .await
        .expect(201);
    let sid = schedule["id"].as_str().expect("an id");
    eventually("the run", WAIT, || async {
        let runs = app
            .get(&format!("/v1/schedules/{sid}/runs"))
            .await
            .expect(200);
        (runs["runs"][0]["status"] == "started").then_some(())
    })
    .await;
    eventually("both to be removed", WAIT, || async {
        let deliveries = app
            .get(&format!("/v1/webhooks/{hook}/deliveries"))
            .await
            .expect(200);
        let runs = app
            .get(&format!("/v1/schedules/{sid}/runs"))
            .await
            .expect(200);
        (deliveries["deliveries"] == json!([]) && runs["runs"] == json!([])).then_some(())
    })
    .await;
    app.cleanup(db).await;
}
