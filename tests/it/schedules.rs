//! Schedules (issue 39; docs/api.md, "Schedules"): an agent run on an interval with no
//! client, across a restart and on a three-node cluster with a node killed, each firing
//! exactly once (counted: one conversation and one message per started firing, no fire
//! time twice or missing); a message to a conversation under its busy policy; firings
//! missed while no node ran, skipped or caught up once. On SQLite and Postgres.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use bedrock::testkit::{FakeLlm, Reply as Llm};
use serde_json::{Value, json};

use crate::support::process::{Server, command};
use crate::support::{TestApp, TestDb, WAIT, eventually};

const FAST: [(&str, &str); 2] = [
    ("BEDROCK_SCHEDULES__POLL_MS", "50"),
    ("BEDROCK_SCHEDULES__CLAIM_MS", "2000"),
];

async fn runs(app: &TestApp, id: &str) -> Vec<Value> {
    let page = app
        .get(&format!("/v1/schedules/{id}/runs?limit=500"))
        .await
        .expect(200);
    page["runs"].as_array().cloned().unwrap_or_default()
}

fn started(runs: &[Value]) -> Vec<&Value> {
    runs.iter().filter(|r| r["status"] == "started").collect()
}

/// The fire times of `runs`, in milliseconds.
fn fire_times(runs: &[&Value]) -> BTreeSet<i64> {
    runs.iter()
        .map(|r| {
            chrono::DateTime::parse_from_rfc3339(r["fire_at"].as_str().expect("a time"))
                .expect("RFC 3339")
                .timestamp_millis()
        })
        .collect()
}

/// Each started run made one conversation, whose one user message is the schedule's.
async fn each_run_once(app: &TestApp, started: &[&Value], message: &str) {
    let conversations: HashSet<&str> = started
        .iter()
        .map(|r| r["conversation_id"].as_str().expect("a conversation"))
        .collect();
    assert_eq!(
        conversations.len(),
        started.len(),
        "a conversation per firing"
    );
    for id in conversations {
        let messages = app.messages(id).await;
        let users: Vec<&Value> = messages
            .iter()
            .filter(|m| m["message_type"] == "user")
            .collect();
        assert_eq!(users.len(), 1, "{id}: {messages:?}");
        assert_eq!(users[0]["content"]["text"], message);
    }
}

/// An agent runs every second with no client; a restart loses no firing and runs none
/// twice; pause and resume; another tenant sees nothing of it.
#[tokio::test]
async fn an_agent_runs_on_an_interval_across_a_restart() {
    for db in TestDb::each().await {
        let mut app = TestApp::spawn_with(&db, &FAST).await;
        app.llm.fallback(Llm::text("the report"));
        app.post(
            "/v1/agents",
            json!({"name": "reporter", "model": "fake-model", "system_prompt": "report"}),
        )
        .await
        .expect(201);
        let made = app
            .post(
                "/v1/schedules",
                json!({"agent": "reporter", "message": "nightly report", "every": "1s"}),
            )
            .await
            .expect(201);
        let id = made["id"].as_str().expect("an id").to_owned();
        assert_eq!(made["every_ms"], 1000);
        assert!(made["next_fire_at"].is_string(), "{made}");

        eventually("two firings", WAIT, || async {
            (started(&runs(&app, &id).await).len() >= 2).then_some(())
        })
        .await;
        app.stop().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        app.start().await;
        let before = started(&runs(&app, &id).await).len();
        eventually("firings after the restart", WAIT, || async {
            (started(&runs(&app, &id).await).len() >= before + 2).then_some(())
        })
        .await;
        let paused = app
            .post(&format!("/v1/schedules/{id}/pause"), json!({}))
            .await
            .expect(200);
        assert_eq!(paused["enabled"], false);
        assert!(paused["next_fire_at"].is_null());
        // Let what was claimed finish, then nothing more fires.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let all = runs(&app, &id).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(runs(&app, &id).await.len(), all.len(), "fired while paused");

        let started_runs = started(&all);
        let times = fire_times(&started_runs);
        assert_eq!(times.len(), started_runs.len(), "a fire time twice");
        assert!(times.iter().all(|t| t % 1000 == made_ms(&made) % 1000));
        each_run_once(&app, &started_runs, "nightly report").await;

        let resumed = app
            .post(&format!("/v1/schedules/{id}/resume"), json!({}))
            .await
            .expect(200);
        assert_eq!(resumed["enabled"], true);
        // `bedrock schedule list`, for operators.
        let listed = bedrock::app::list_schedules(&app.settings(), Some("a"))
            .await
            .expect("listed");
        assert!(
            listed
                .iter()
                .any(|l| l["id"] == id.as_str() && l["latest_run"]["status"].is_string()),
            "{listed:?}"
        );

        // Tenant b: nothing of it.
        let b = Some(app.key_b.as_str());
        let listed = app
            .request(reqwest::Method::GET, "/v1/schedules", b, None)
            .await
            .expect(200);
        assert_eq!(listed["schedules"], json!([]));
        for path in [
            format!("/v1/schedules/{id}"),
            format!("/v1/schedules/{id}/runs"),
        ] {
            app.request(reqwest::Method::GET, &path, b, None)
                .await
                .expect_error(404, "not_found");
        }
        app.request(
            reqwest::Method::DELETE,
            &format!("/v1/schedules/{id}"),
            b,
            None,
        )
        .await
        .expect_error(404, "not_found");
        // Nor can tenant b fire tenant a's agent: a firing acts as the schedule's tenant
        // only, and the agent is looked up as that tenant's.
        app.request(
            reqwest::Method::POST,
            "/v1/schedules",
            b,
            Some(json!({"agent": "reporter", "message": "mine now", "every": "1s"})),
        )
        .await
        .expect_error(404, "not_found");
        app.request(
            reqwest::Method::DELETE,
            &format!("/v1/schedules/{id}"),
            Some(&app.key_a),
            None,
        )
        .await
        .expect(204);
        app.cleanup(db).await;
    }
}

fn made_ms(made: &Value) -> i64 {
    chrono::DateTime::parse_from_rfc3339(made["created_at"].as_str().expect("a time"))
        .expect("RFC 3339")
        .timestamp_millis()
}

/// A one-time message to a conversation: sent once, then the schedule is done; to a busy
/// conversation it is skipped (`skip`) or queued (`enqueue`). Bad input is a 400.
#[tokio::test]
async fn messages_go_to_a_conversation_under_its_busy_policy() {
    for db in TestDb::each().await {
        let app = TestApp::spawn_with(&db, &FAST).await;
        let id = app.conversation().await;
        app.llm.fallback(Llm::text("ok"));
        let soon = (chrono::Utc::now() + chrono::Duration::milliseconds(300)).to_rfc3339();
        let made = app
            .post(
                "/v1/schedules",
                json!({"conversation_id": id, "message": "ping", "at": soon}),
            )
            .await
            .expect(201);
        let sid = made["id"].as_str().expect("an id").to_owned();
        let run = eventually("the one firing", WAIT, || async {
            runs(&app, &sid)
                .await
                .into_iter()
                .find(|r| r["status"] == "started")
        })
        .await;
        assert_eq!(run["conversation_id"], id.as_str());
        app.wait_kind(&id, "idle").await;
        let done = app.get(&format!("/v1/schedules/{sid}")).await.expect(200);
        assert_eq!(done["enabled"], false);
        assert!(done["next_fire_at"].is_null());
        app.post(&format!("/v1/schedules/{sid}/resume"), json!({}))
            .await
            .expect_error(409, "schedule_done");

        // Busy: a long tool runs.
        app.llm
            .push([Llm::bash("call_sleep", "sleep 5"), Llm::text("slept")]);
        app.send(&id, "sleep").await;
        app.wait_kind(&id, "tool_executing").await;
        let at = (chrono::Utc::now() + chrono::Duration::milliseconds(200)).to_rfc3339();
        let skip = app
            .post(
                "/v1/schedules",
                json!({"conversation_id": id, "message": "skipped", "at": at}),
            )
            .await
            .expect(201);
        let queue = app
            .post(
                "/v1/schedules",
                json!({"conversation_id": id, "message": "queued", "at": at, "if_busy": "enqueue"}),
            )
            .await
            .expect(201);
        let skipped = eventually("the skipped firing", WAIT, || async {
            runs(&app, skip["id"].as_str()?)
                .await
                .into_iter()
                .find(|r| r["status"] == "skipped")
        })
        .await;
        assert!(
            skipped["outcome"]
                .as_str()
                .unwrap_or_default()
                .contains("busy")
        );
        eventually("the queued firing", WAIT, || async {
            runs(&app, queue["id"].as_str()?)
                .await
                .into_iter()
                .find(|r| r["status"] == "queued")
        })
        .await;
        let texts = eventually("the queued message to run", WAIT, || async {
            let texts: Vec<String> = app
                .messages(&id)
                .await
                .iter()
                .filter(|m| m["message_type"] == "user")
                .filter_map(|m| m["content"]["text"].as_str().map(str::to_owned))
                .collect();
            texts.iter().any(|t| t == "queued").then_some(texts)
        })
        .await;
        assert!(!texts.iter().any(|t| t == "skipped"), "{texts:?}");
        assert_eq!(texts.iter().filter(|t| *t == "ping").count(), 1);

        for (body, why) in [
            (json!({"message": "x", "every": "1m"}), "no target"),
            (
                json!({"agent": "a", "conversation_id": id, "message": "x", "every": "1m"}),
                "two targets",
            ),
            (json!({"conversation_id": id, "message": "x"}), "no time"),
            (
                json!({"conversation_id": id, "message": "x", "every": "1m", "cron": "* * * * *"}),
                "two times",
            ),
            (
                json!({"conversation_id": id, "message": "x", "every": "100ms"}),
                "under a second",
            ),
            (
                json!({"conversation_id": id, "message": "x", "cron": "61 * * * *"}),
                "a bad cron",
            ),
            (
                json!({"conversation_id": id, "message": "x", "cron": "* * * * *", "timezone": "Mars/Base"}),
                "a bad zone",
            ),
            (
                json!({"conversation_id": id, "message": "x", "at": "yesterday"}),
                "a bad time",
            ),
            (
                json!({"conversation_id": id, "message": "x", "at": "2020-01-01T00:00:00Z"}),
                "the past",
            ),
            (
                json!({"conversation_id": id, "message": "x", "every": "1m", "if_busy": "shrug"}),
                "a bad policy",
            ),
            (
                json!({"conversation_id": id, "message": "", "every": "1m"}),
                "no message",
            ),
        ] {
            let reply = app.post("/v1/schedules", body).await;
            assert_eq!(reply.status, 400, "{why}: {}", reply.body);
        }
        app.post(
            "/v1/schedules",
            json!({"conversation_id": "not-a-conversation", "message": "x", "every": "1m"}),
        )
        .await
        .expect_error(404, "not_found");
        // Another tenant cannot aim a schedule at this tenant's conversation.
        app.request(
            reqwest::Method::POST,
            "/v1/schedules",
            Some(&app.key_b),
            Some(json!({"conversation_id": id, "message": "hijack", "every": "1s"})),
        )
        .await
        .expect_error(404, "not_found");

        // Interrupt: the running turn is cancelled and the message takes its place.
        app.llm
            .push([Llm::bash("call_long", "sleep 30"), Llm::text("interrupted")]);
        app.send(&id, "long").await;
        app.wait_kind(&id, "tool_executing").await;
        let at = (chrono::Utc::now() + chrono::Duration::milliseconds(200)).to_rfc3339();
        let interrupt = app
            .post(
                "/v1/schedules",
                json!({"conversation_id": id, "message": "instead", "at": at, "if_busy": "interrupt"}),
            )
            .await
            .expect(201);
        eventually("the interrupting firing", WAIT, || async {
            runs(&app, interrupt["id"].as_str()?)
                .await
                .into_iter()
                .find(|r| r["status"] == "started")
        })
        .await;
        eventually("the interrupting message to run", WAIT, || async {
            let messages = app.messages(&id).await;
            messages
                .iter()
                .any(|m| m["message_type"] == "user" && m["content"]["text"] == "instead")
                .then_some(())
        })
        .await;
        app.wait_kind(&id, "idle").await;
        app.post(
            "/v1/schedules",
            json!({"agent": "nobody", "message": "x", "every": "1m"}),
        )
        .await
        .expect_error(404, "not_found");
        app.cleanup(db).await;
    }
}

/// Firings missed while no node ran: with `catch_up: none` skipped (a run row says so),
/// with `one` the latest runs once. One-time schedules make it exact: the node is down when
/// they are due.
#[tokio::test]
async fn missed_firings_are_skipped_or_caught_up_once() {
    for db in TestDb::each().await {
        let mut extra = FAST.to_vec();
        extra.push(("BEDROCK_SCHEDULES__LATE_MS", "300"));
        let mut app = TestApp::spawn_with(&db, &extra).await;
        app.llm.fallback(Llm::text("ok"));
        app.post("/v1/agents", json!({"name": "r", "model": "fake-model"}))
            .await
            .expect(201);
        let at = (chrono::Utc::now() + chrono::Duration::milliseconds(700)).to_rfc3339();
        let mut ids = Vec::new();
        for catch_up in ["none", "one"] {
            let made = app
                .post(
                    "/v1/schedules",
                    json!({"agent": "r", "message": catch_up, "at": at, "catch_up": catch_up}),
                )
                .await
                .expect(201);
            ids.push(made["id"].as_str().expect("an id").to_owned());
        }
        app.stop().await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        app.start().await;
        for (id, catch_up) in ids.iter().zip(["none", "one"]) {
            let run = eventually("the missed firing's run", WAIT, || async {
                runs(&app, id)
                    .await
                    .into_iter()
                    .find(|r| r["status"] != "claimed")
            })
            .await;
            match catch_up {
                "none" => {
                    assert_eq!(run["status"], "skipped", "{run}");
                    assert!(
                        run["outcome"]
                            .as_str()
                            .unwrap_or_default()
                            .contains("missed"),
                        "{run}"
                    );
                }
                _ => assert_eq!(run["status"], "started", "{run}"),
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert_eq!(runs(&app, id).await.len(), 1, "{catch_up}");
            let schedule = app.get(&format!("/v1/schedules/{id}")).await.expect(200);
            assert_eq!(schedule["enabled"], false, "{schedule}");
        }
        app.cleanup(db).await;
    }
}

/// Three real nodes on one Postgres fire one schedule every second; one is killed with
/// SIGKILL mid-way. Every fire time from the first to the last runs exactly once: one run
/// each, no gap, one conversation and one message each.
#[tokio::test]
async fn each_firing_runs_exactly_once_on_a_cluster_with_a_node_killed() {
    let Some(db) = TestDb::postgres().await else {
        #[allow(clippy::print_stderr)]
        {
            eprintln!("SKIPPED: the cluster's schedules need Postgres (BEDROCK_TEST_DATABASE_URL)");
        }
        return;
    };
    bedrock::install_crypto();
    let llm = FakeLlm::start().await;
    llm.fallback(Llm::text("ok"));
    let workspace = crate::support::db::temp_dir("schedule-cluster");
    let node = |id: &str| {
        let mut cmd = command(&db, &llm, &workspace);
        cmd.env("BEDROCK_CLUSTER__NODE_ID", id)
            .env("BEDROCK_CLUSTER__LEASE_TTL_MS", "2000")
            .env("BEDROCK_CLUSTER__HEARTBEAT_MS", "500")
            .env("BEDROCK_SCHEDULES__POLL_MS", "50")
            .env("BEDROCK_SCHEDULES__CLAIM_MS", "2000");
        Server::start_with(cmd)
    };
    let mut nodes: Vec<Server> = ["a", "b", "c"].iter().map(|id| node(id)).collect();
    nodes[0]
        .post("/agents", json!({"name": "r", "model": "fake-model"}))
        .await;
    let made = nodes[0]
        .post(
            "/schedules",
            json!({"agent": "r", "message": "tick", "every": "1s"}),
        )
        .await;
    let id = made["id"].as_str().expect("an id").to_owned();
    // A message every second to a conversation node b runs: a firing claimed by a or c is
    // handed to b (an in-process request carries no key to forward).
    let conv = nodes[1].conversation().await;
    let conv = conv["id"].as_str().expect("a conversation").to_owned();
    let pinged = nodes[1]
        .post(
            "/schedules",
            json!({"conversation_id": conv, "message": "ping", "every": "1s", "if_busy": "enqueue"}),
        )
        .await;
    let ping = pinged["id"].as_str().expect("an id").to_owned();
    eventually("three firings", WAIT, || async {
        let runs = cluster_runs(&nodes[1], &id).await?;
        (runs.iter().filter(|r| r["status"] == "started").count() >= 3).then_some(())
    })
    .await;
    nodes.remove(0).kill_hard();
    tokio::time::sleep(Duration::from_millis(4000)).await;
    nodes[0]
        .post(&format!("/schedules/{id}/pause"), json!({}))
        .await;
    nodes[0]
        .post(&format!("/schedules/{ping}/pause"), json!({}))
        .await;
    let pings = eventually("every ping to finish", WAIT, || async {
        let runs = cluster_runs(&nodes[0], &ping).await?;
        runs.iter()
            .all(|r| r["status"] != "claimed")
            .then_some(runs)
    })
    .await;
    assert!(
        pings
            .iter()
            .all(|r| r["status"] == "started" || r["status"] == "queued"),
        "{pings:?}"
    );
    assert!(pings.len() >= 4, "{pings:?}");
    let texts = eventually("the pings to be stored", WAIT, || async {
        let messages = nodes[0]
            .get(&format!("/conversations/{conv}/messages?limit=1000"))
            .await?;
        let pinged = messages["messages"]
            .as_array()?
            .iter()
            .filter(|m| m["message_type"] == "user")
            .count();
        (pinged == pings.len()).then_some(pinged)
    })
    .await;
    assert_eq!(texts, pings.len());
    // What was claimed (by a dead node too) finishes within a claim.
    let all = eventually("every claimed firing to finish", WAIT, || async {
        let runs = cluster_runs(&nodes[0], &id).await?;
        runs.iter()
            .all(|r| r["status"] != "claimed")
            .then_some(runs)
    })
    .await;
    let started: Vec<&Value> = all.iter().filter(|r| r["status"] == "started").collect();
    let times: Vec<i64> = fire_times(&started).into_iter().collect();
    assert_eq!(times.len(), started.len());
    assert!(times.len() >= 6, "{all:?}");
    for pair in times.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            1000,
            "a firing missing or twice: {times:?}"
        );
    }
    let conversations: HashSet<&str> = started
        .iter()
        .filter_map(|r| r["conversation_id"].as_str())
        .collect();
    assert_eq!(conversations.len(), started.len());
    for conv in conversations {
        let messages = nodes[0]
            .get(&format!("/conversations/{conv}/messages"))
            .await
            .expect("its messages");
        let users = messages["messages"]
            .as_array()
            .map(|m| m.iter().filter(|m| m["message_type"] == "user").count());
        assert_eq!(users, Some(1), "{conv}: {messages}");
    }
    for server in nodes {
        server.kill_hard();
    }
    crate::support::process::remove_workspace(&workspace);
    db.drop_db().await;
}

async fn cluster_runs(server: &Server, id: &str) -> Option<Vec<Value>> {
    let page = server
        .get(&format!("/schedules/{id}/runs?limit=500"))
        .await?;
    page["runs"].as_array().cloned()
}
