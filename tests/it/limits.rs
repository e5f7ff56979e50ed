//! Budgets and limits (issue 25; docs/api.md, "Budgets and limits"), through the real
//! server on SQLite and Postgres: a tenant's token budget (the configured default and a
//! tenant's own), atomic across concurrent conversations; a conversation's own budget;
//! `GET /v1/usage`; request rates per key for REST and WebSocket frames.

use std::time::Duration;

use bedrock::config::BudgetPeriod;
use bedrock::store::{Store, StoreOptions};
use reqwest::Method;
use serde_json::{Value, json};

use crate::support::ws::Ws;
use crate::support::{TestApp, TestDb};

/// Every fake answer counts 100 input and 10 output tokens.
const PER_ANSWER: u64 = 110;

async fn store_of(app: &TestApp) -> Store {
    Store::connect(&StoreOptions {
        url: app.db_url.clone(),
        max_connections: 2,
        acquire_timeout: Duration::from_secs(5),
    })
    .await
    .expect("the database answers")
}

async fn tenant_id(store: &Store, name: &str) -> String {
    store
        .tenant_by_name(name)
        .await
        .expect("the tenants are read")
        .expect("the tenant exists")
        .id
}

/// The configured budget: turns go on while it lasts; the first request after it is spent
/// is not sent, and the turn ends in error kind `budget` saying what was spent, the limit and
/// when it resets. The chain stays valid and GET /v1/usage reports it all.
#[tokio::test]
async fn a_spent_tenant_budget_ends_the_turn_before_any_request() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[("BEDROCK_BUDGETS__TENANT_TOKENS", "150")]).await;
        let id = app.conversation().await;
        for text in ["one", "two"] {
            app.send(&id, text).await;
            app.wait_kind(&id, "idle").await;
        }
        app.send(&id, "three").await;
        let state = app.wait_kind(&id, "error").await;
        assert_eq!(state["error_kind"], "budget", "{state}");
        let message = state["message"].as_str().expect("a message");
        assert!(
            message.contains("220 of its 150 tokens this month") && message.contains("resets at"),
            "{message}"
        );
        assert_eq!(app.llm.requests().len(), 2, "no request after the budget");
        let messages = app.messages(&id).await;
        let last = messages.last().expect("messages");
        assert_eq!(last["message_type"], "error");

        let usage = crate::support::eventually(
            "the answers' tokens settled",
            crate::support::WAIT,
            || async {
                let usage = app.get("/v1/usage").await.expect(200);
                (usage["input_tokens"] == 200).then_some(usage)
            },
        )
        .await;
        assert_eq!(usage["input_tokens"], 200);
        assert_eq!(usage["output_tokens"], 20);
        assert_eq!(usage["by_model"]["fake-model"]["input_tokens"], 200);
        assert_eq!(usage["budget"]["limit"], 150);
        assert_eq!(usage["budget"]["used"], 2 * PER_ANSWER);
        assert_eq!(usage["budget"]["period"], "month");
        assert!(usage["budget"]["resets_at"].as_str().is_some());
        // Another tenant's usage is its own.
        let other = app
            .request(Method::GET, "/v1/usage", Some(&app.key_b), None)
            .await
            .expect(200);
        assert_eq!(other["input_tokens"], 0);
        // Bad ranges are 400s.
        app.get("/v1/usage?from=yesterday")
            .await
            .expect_error(400, "invalid_request");
        app.get("/v1/usage?from=2026-02-01&to=2026-01-01")
            .await
            .expect_error(400, "invalid_request");

        // The tenant's own, larger budget lets the conversation go on.
        let store = store_of(&app).await;
        let tenant = tenant_id(&store, "a").await;
        store
            .set_tenant_budget(
                &tenant,
                Some(1000),
                Some(BudgetPeriod::Day),
                BudgetPeriod::Day,
                chrono::Utc::now(),
            )
            .await
            .expect("the budget is set");
        app.send(&id, "four").await;
        app.wait_kind(&id, "idle").await;
        // An answer's tokens are settled in a task of their own, a moment after the turn
        // ends (llm/budget.rs): under load the read can come first.
        let usage = crate::support::eventually(
            "the answer's tokens settled",
            crate::support::WAIT,
            || async {
                let usage = app.get("/v1/usage").await.expect(200);
                (usage["budget"]["used"] == 3 * PER_ANSWER).then_some(usage)
            },
        )
        .await;
        assert_eq!(usage["budget"]["limit"], 1000);
        assert_eq!(usage["budget"]["period"], "day");
        assert_eq!(usage["budget"]["used"], 3 * PER_ANSWER);
        store.close().await.expect("closes");
        app.cleanup(db).await;
    }
}

/// The check is atomic with the spend of concurrent conversations: with budget left for
/// one request, of five conversations sending at once exactly one reaches the LLM.
#[tokio::test]
async fn concurrent_conversations_cannot_overspend_together() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &[("BEDROCK_BUDGETS__TENANT_TOKENS", "50")]).await;
        let mut ids = Vec::new();
        for _ in 0..5 {
            ids.push(app.conversation().await);
        }
        let sends = ids.iter().map(|id| app.send(id, "go"));
        futures::future::join_all(sends).await;
        let mut kinds = Vec::new();
        for id in &ids {
            let state =
                crate::support::eventually("the turn to end", crate::support::WAIT, || async {
                    let state = app.state(id).await;
                    matches!(state["kind"].as_str(), Some("idle" | "error")).then_some(state)
                })
                .await;
            kinds.push(
                state["error_kind"]
                    .as_str()
                    .unwrap_or(state["kind"].as_str().unwrap_or_default())
                    .to_owned(),
            );
        }
        kinds.sort();
        assert_eq!(
            kinds,
            ["budget", "budget", "budget", "budget", "idle"],
            "exactly one request passes"
        );
        assert_eq!(app.llm.requests().len(), 1);
        app.cleanup(db).await;
    }
}

/// A conversation's own budget, given at creation, ends its turns once spent; the tenant
/// has none. 0 is refused.
#[tokio::test]
async fn a_conversation_budget() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    let created = app
        .post("/v1/conversations", json!({"budget_tokens": 100}))
        .await
        .expect(201);
    assert_eq!(created["budget_tokens"], 100);
    let id = created["id"].as_str().expect("an id");
    app.send(id, "one").await;
    app.wait_kind(id, "idle").await;
    app.send(id, "two").await;
    let state = app.wait_kind(id, "error").await;
    assert_eq!(state["error_kind"], "budget");
    assert!(
        state["message"]
            .as_str()
            .is_some_and(|m| m.contains("used 110 of its budget of 100 tokens")),
        "{state}"
    );
    assert_eq!(app.llm.requests().len(), 1);
    app.post("/v1/conversations", json!({"budget_tokens": 0}))
        .await
        .expect_error(400, "invalid_request");
    // The usage report has no budget for the tenant.
    let usage = app.get("/v1/usage").await.expect(200);
    assert_eq!(usage["budget"], Value::Null);
    app.cleanup(db).await;
}

/// Over a key's rate: 429 `rate_limited` with Retry-After; another key has its own bucket;
/// a tenant's own rate applies to its keys; WebSocket frames count and are answered
/// `rejected`.
#[tokio::test]
async fn request_rates_per_key() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn_with(
        &db,
        &[
            ("BEDROCK_RATE_LIMITS__PER_SECOND", "0.2"),
            ("BEDROCK_RATE_LIMITS__BURST", "3"),
        ],
    )
    .await;
    // Tenant b gets its own, larger burst before its first request.
    let store = store_of(&app).await;
    let b = tenant_id(&store, "b").await;
    store
        .set_tenant_rate(&b, Some(0.2), Some(6))
        .await
        .expect("the rate is set");
    store.close().await.expect("closes");

    let response = app
        .http
        .post(format!("{}/v1/conversations", app.base))
        .bearer_auth(&app.key_a)
        .json(&json!({}))
        .send()
        .await
        .expect("an answer");
    let id = response.json::<Value>().await.expect("JSON")["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    // The WebSocket's upgrade is the second request of the burst of 3.
    let mut ws = Ws::connect(&app.ws_url(&id, "")).await;
    ws.frame_of("snapshot").await;
    app.get(&format!("/v1/conversations/{id}"))
        .await
        .expect(200);
    let refused = app
        .http
        .get(format!("{}/v1/conversations/{id}", app.base))
        .bearer_auth(&app.key_a)
        .send()
        .await
        .expect("an answer");
    assert_eq!(refused.status().as_u16(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("seconds");
    assert!((1..=5).contains(&retry_after), "{retry_after}");
    let body: Value = refused.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "rate_limited");
    // A frame over the rate is refused on the socket, which stays open.
    ws.send(&json!({"type": "ping"})).await;
    let rejected = ws.frame_of("rejected").await;
    assert_eq!(rejected["code"], "rate_limited");

    // Tenant b: six requests in a row pass, the seventh does not.
    for _ in 0..6 {
        app.request(Method::GET, "/v1/conversations", Some(&app.key_b), None)
            .await
            .expect(200);
    }
    app.request(Method::GET, "/v1/conversations", Some(&app.key_b), None)
        .await
        .expect_error(429, "rate_limited");
    app.cleanup(db).await;
}
