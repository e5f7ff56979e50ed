//! Replay (issue 40): every conversation's decisions are kept and re-run. Real turns with
//! tools, a retry, a cancel, an approval, a kill -9 and a restart, then `bedrock replay`
//! finds every decision the same; a build with a changed decision (the hidden test switch)
//! finds the first step it changes; the trace shows each step, per tenant.

use bedrock::testkit::{FakeLlm, Reply as Llm};
use serde_json::{Value, json};

use crate::support::app::TestApp;
use crate::support::process::{Server, command, remove_workspace};
use crate::support::ws::Ws;
use crate::support::{TestDb, WAIT, eventually};

/// Waits until conversation `id` is in state `kind`.
async fn wait_kind(server: &Server, id: &str, kind: &str) -> Value {
    eventually(&format!("{id} {kind}"), WAIT * 2, || async {
        let conv = server.get(&format!("/conversations/{id}")).await?;
        (conv["state"]["kind"] == kind).then_some(conv)
    })
    .await
}

/// Runs `bedrock replay` with `args` on the test's database: (exit code, stdout, stderr).
fn replay(
    db: &TestDb,
    llm: &FakeLlm,
    workspace: &std::path::Path,
    args: &[&str],
) -> (i32, String, String) {
    let out = command(db, llm, workspace)
        .arg("replay")
        .args(args)
        .output()
        .expect("bedrock replay runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every step of a conversation's trace, page by page (`limit` a page).
async fn whole_trace(server: &Server, id: &str, limit: u64) -> Vec<Value> {
    let mut steps = Vec::new();
    let mut after = 0;
    loop {
        let page = server
            .get(&format!(
                "/conversations/{id}/trace?after={after}&limit={limit}"
            ))
            .await
            .expect("a trace");
        let got = page["steps"].as_array().expect("steps").clone();
        assert!(got.len() as u64 <= limit, "{page}");
        steps.extend(got);
        match page["next_cursor"].as_i64() {
            Some(next) => after = next,
            None => return steps,
        }
    }
}

fn kinds(steps: &[Value]) -> Vec<&str> {
    steps.iter().filter_map(|s| s["kind"].as_str()).collect()
}

/// Issue 40: real turns (tools, an LLM error retried, a cancel, an approval, a kill -9 in
/// the middle of a tool and the restart's recovery), then `bedrock replay` re-runs every
/// stored step and finds each decision the same; with a deliberately changed decision it
/// reports the first step it changes, and exits non-zero.
#[tokio::test]
async fn replay_finds_every_decision_the_same_and_a_changed_one_at_its_step() {
    bedrock::install_crypto();
    for db in TestDb::each().await {
        let llm = FakeLlm::start().await;
        let workspace = crate::support::db::temp_dir("replay-ws");
        let mut server = Server::start(&db, &llm, &workspace);

        // A: a tool, then an LLM error retried, then a cancelled tool.
        let a = server.conversation().await["id"]
            .as_str()
            .expect("an id")
            .to_owned();
        llm.push([Llm::bash("t1", "echo hi"), Llm::text("done")]);
        server.send(&a, "one").await;
        wait_kind(&server, &a, "idle").await;
        llm.push([Llm::status(500, "boom"), Llm::text("after a retry")]);
        server.send(&a, "two").await;
        eventually("the retried answer", WAIT * 2, || async {
            let messages = server.get(&format!("/conversations/{a}/messages")).await?;
            messages.to_string().contains("after a retry").then_some(())
        })
        .await;
        wait_kind(&server, &a, "idle").await;
        // A cancelled turn asks nothing more of the LLM: only the tool call is scripted.
        llm.push([Llm::bash("t2", "sleep 20")]);
        server.send(&a, "three").await;
        wait_kind(&server, &a, "tool_executing").await;
        server
            .post(&format!("/conversations/{a}/cancel"), json!({}))
            .await;
        wait_kind(&server, &a, "idle").await;

        // B: a tool the client approves.
        let b = server
            .post("/conversations", json!({"require_approval": ["bash"]}))
            .await["id"]
            .as_str()
            .expect("an id")
            .to_owned();
        llm.push([
            Llm::bash("t3", "echo approved"),
            Llm::text("approved and done"),
        ]);
        let ws_base = server.base.replacen("http://", "ws://", 1);
        let mut ws = Ws::connect(&format!("{ws_base}/v1/conversations/{b}/ws")).await;
        ws.frame().await;
        server.send(&b, "ask first").await;
        let request = ws.frame_of("client_request").await["request_id"]
            .as_str()
            .expect("a request id")
            .to_owned();
        server
            .post(
                &format!("/conversations/{b}/requests/{request}"),
                json!({"payload": {"confirmed": true}}),
            )
            .await;
        wait_kind(&server, &b, "idle").await;

        // A again: killed in the middle of a tool, recovered by the restart, then a turn.
        llm.push([Llm::bash("t4", "sleep 5")]);
        server.send(&a, "four").await;
        wait_kind(&server, &a, "tool_executing").await;
        server.kill_hard();
        server = Server::start(&db, &llm, &workspace);
        wait_kind(&server, &a, "idle").await;
        llm.push([Llm::text("five done")]);
        server.send(&a, "five").await;
        eventually("the turn after the restart", WAIT * 2, || async {
            let messages = server.get(&format!("/conversations/{a}/messages")).await?;
            messages.to_string().contains("five done").then_some(())
        })
        .await;
        wait_kind(&server, &a, "idle").await;

        // The trace: every step, numbered from 1 without gaps, each decided the same; the
        // restart's step found the tool running.
        let trace = whole_trace(&server, &a, 3).await;
        let numbers: Vec<i64> = trace.iter().filter_map(|s| s["step"].as_i64()).collect();
        assert_eq!(
            numbers,
            (1..=numbers.len() as i64).collect::<Vec<_>>(),
            "{trace:?}"
        );
        assert!(trace.iter().all(|s| s["same"] == true), "{trace:?}");
        let seen = kinds(&trace);
        for kind in [
            "user_message",
            "continue",
            "llm_response",
            "tool_complete",
            "llm_error",
            "retry_timeout",
            "user_cancel",
            "interrupted",
        ] {
            assert!(seen.contains(&kind), "no {kind} step in {seen:?}");
        }
        let restart = trace
            .iter()
            .find(|s| s["kind"] == "interrupted")
            .expect("the restart's step");
        assert_eq!(
            restart["state_before"]["kind"], "tool_executing",
            "{restart}"
        );
        assert_eq!(restart["state_after"]["kind"], "idle", "{restart}");
        // A step refers to its message: the tool's output is the tool result message's.
        let tool_step = trace
            .iter()
            .find(|s| s["kind"] == "tool_complete")
            .expect("a tool step");
        let seq = tool_step["message"].as_i64().expect("its message");
        assert!(
            tool_step["event"].to_string().contains("\"msg\""),
            "{tool_step}"
        );
        let messages = server
            .get(&format!("/conversations/{a}/messages"))
            .await
            .expect("messages");
        let message = messages["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .find(|m| m["sequence_id"] == seq)
            .expect("the step's message");
        assert_eq!(message["message_type"], "tool", "{message}");
        // The step that first stores a tool result: where a changed decision shows.
        let first_tool_result = trace
            .iter()
            .find(|s| {
                s["effects"].as_array().is_some_and(|effects| {
                    effects
                        .iter()
                        .any(|e| e["persist_message"]["tool"].is_object())
                })
            })
            .and_then(|s| s["step"].as_i64())
            .expect("a step storing a tool result");
        let b_steps = whole_trace(&server, &b, 100).await;
        assert!(kinds(&b_steps).contains(&"tool_complete"), "{b_steps:?}");
        server.kill_hard();

        // `bedrock replay`: the same decisions, every conversation, every step.
        let (code, out, err) = replay(&db, &llm, &workspace, &["--all", "--verbose"]);
        assert_eq!(code, 0, "{out}\n{err}");
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        assert_eq!(lines.len(), 2, "{out}");
        for line in &lines {
            assert_eq!(line["same"], true, "{line}");
            assert_eq!(line["skipped"], 0, "{line}");
        }
        let a_line = lines
            .iter()
            .find(|l| l["conversation_id"] == a.as_str())
            .expect("A's line");
        assert_eq!(a_line["steps"], trace.len(), "{a_line}");
        assert!(err.contains("0 diverged"), "{err}");
        let (code, _, err) = replay(&db, &llm, &workspace, &[&a]);
        assert_eq!(code, 0, "{err}");
        let (code, _, err) = replay(&db, &llm, &workspace, &["--all", "--since", "1h"]);
        assert_eq!(code, 0, "{err}");
        assert!(err.contains("2 conversations"), "{err}");

        // A changed decision: found at the first step it changes, exit status 1.
        let (code, out, err) = replay(&db, &llm, &workspace, &["--all", "--test-changed-decision"]);
        assert_eq!(code, 1, "{out}\n{err}");
        let diverged: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        let a_diverged = diverged
            .iter()
            .find(|l| l["conversation_id"] == a.as_str())
            .expect("A diverged");
        assert_eq!(
            a_diverged["diverged_at_step"], first_tool_result,
            "{a_diverged}"
        );
        assert_eq!(a_diverged["steps_before"], first_tool_result - 1);
        assert_ne!(
            a_diverged["stored"]["digest"], a_diverged["replayed"]["digest"],
            "{a_diverged}"
        );
        assert!(
            a_diverged["event"]["tool_complete"].is_object(),
            "{a_diverged}"
        );
        assert!(err.contains("decide differently"), "{err}");

        // Bad arguments are refused clearly.
        let (code, _, err) = replay(&db, &llm, &workspace, &["nope"]);
        assert_ne!(code, 0);
        assert!(err.contains("no conversation"), "{err}");
        let (code, _, err) = replay(&db, &llm, &workspace, &[]);
        assert_ne!(code, 0);
        assert!(err.contains("--all"), "{err}");
        let (code, _, err) = replay(&db, &llm, &workspace, &["--all", "--since", "soon"]);
        assert_ne!(code, 0);
        assert!(err.contains("--since"), "{err}");

        remove_workspace(&workspace);
        db.drop_db().await;
    }
}

/// The trace is the tenant's own: another tenant gets 404; bad paging is a 400 in the
/// contract's shape; a deleted conversation takes its steps with it.
#[tokio::test]
async fn the_trace_is_the_tenants_own() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        app.llm
            .push([Llm::bash("t1", "echo hi"), Llm::text("done")]);
        let id = app.conversation().await;
        app.send(&id, "go").await;
        app.wait_kind(&id, "idle").await;
        let trace = app
            .get(&format!("/v1/conversations/{id}/trace"))
            .await
            .expect(200);
        let steps = trace["steps"].as_array().expect("steps");
        assert!(steps.len() >= 5, "{trace}");
        assert_eq!(steps[0]["kind"], "user_message");
        assert_eq!(steps[0]["state_before"]["kind"], "idle");
        assert!(trace["next_cursor"].is_null());
        let b = Some(app.key_b.as_str());
        app.request(
            reqwest::Method::GET,
            &format!("/v1/conversations/{id}/trace"),
            b,
            None,
        )
        .await
        .expect_error(404, "not_found");
        // A cancel at rest changes nothing and asks for nothing: no step, no write (a tenant
        // cannot grow the log for free).
        for _ in 0..3 {
            app.post(&format!("/v1/conversations/{id}/cancel"), json!({}))
                .await
                .expect(202);
        }
        let again = app
            .get(&format!("/v1/conversations/{id}/trace"))
            .await
            .expect(200);
        assert_eq!(
            again["steps"].as_array().map(Vec::len),
            Some(steps.len()),
            "{again}"
        );
        assert!(again.get("divergence").is_none(), "{again}");
        // `bedrock replay --all --tenant`: one tenant's conversations only.
        for (tenant, expected) in [("a", 1), ("b", 0)] {
            let target = bedrock::app::ReplayTarget {
                all: true,
                tenant: Some(tenant.into()),
                ..Default::default()
            };
            let mut out = Vec::new();
            let summary = bedrock::app::replay(&app.settings(), &target, &mut out, true)
                .await
                .expect("a replay");
            assert_eq!(summary.conversations, expected, "tenant {tenant}");
            assert_eq!(summary.diverged, 0);
            assert_eq!(summary.steps as usize, steps.len() * expected as usize);
        }
        let target = bedrock::app::ReplayTarget {
            all: true,
            tenant: Some("nobody".into()),
            ..Default::default()
        };
        let error = bedrock::app::replay(&app.settings(), &target, &mut Vec::new(), true)
            .await
            .expect_err("no such tenant");
        assert!(error.to_string().contains("no tenant"), "{error}");
        // A hostile page: the furthest `after` there is, the largest page, asked for sixty
        // times at once. Each is answered (a few at a time, off the request workers), none
        // fails, and nothing past the log's end is made up.
        let far = app
            .get(&format!(
                "/v1/conversations/{id}/trace?after={}&limit=500",
                i64::MAX
            ))
            .await
            .expect(200);
        assert_eq!(far["steps"], json!([]), "{far}");
        assert!(far["next_cursor"].is_null(), "{far}");
        // Meanwhile another tenant's trace is not kept waiting behind the flood: a tenant's
        // traces are made one at a time, so it holds one of the node's two permits at most.
        let b_conv = app.conversation_of(&app.key_b).await;
        let path = format!("/v1/conversations/{id}/trace?limit=500");
        let done = std::sync::atomic::AtomicUsize::new(0);
        const FLOOD: usize = 60;
        // Sixty pages: a's queue must outlast b's one request by far, on a machine the rest
        // of the suite keeps busy (with twenty, b's request once came back after all of
        // them, its own way through the edge slower than a's queue).
        let flood: Vec<_> = (0..FLOOD)
            .map(|_| async {
                let page = app.get(&path).await;
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                page
            })
            .collect();
        let b_trace = async {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            let before = done.load(std::sync::atomic::Ordering::SeqCst);
            let page = app
                .request(
                    reqwest::Method::GET,
                    &format!("/v1/conversations/{b_conv}/trace"),
                    b,
                    None,
                )
                .await
                .expect(200);
            (page, before, done.load(std::sync::atomic::Ordering::SeqCst))
        };
        let (pages, (b_page, a_before, a_done)) =
            tokio::join!(futures::future::join_all(flood), b_trace);
        for page in pages {
            assert_eq!(
                page.expect(200)["steps"].as_array().map(Vec::len),
                Some(steps.len())
            );
        }
        assert_eq!(b_page["steps"], json!([]), "{b_page}");
        // Waiting behind a's flood would mean b's answer came after all of a's pages that
        // were left when b asked. Asked while half or more were left (on a busy machine b's
        // request may go out later, when there is nothing left to wait for), it comes
        // before the last.
        assert!(
            a_before > FLOOD / 2 || a_done < FLOOD,
            "b's trace, asked with {} of a's pages left, waited for all of them",
            FLOOD - a_before
        );
        for query in ["limit=0", "limit=501", "after=-1", "limit=x"] {
            app.get(&format!("/v1/conversations/{id}/trace?{query}"))
                .await
                .expect_error(400, "invalid_request");
        }
        app.request(
            reqwest::Method::DELETE,
            &format!("/v1/conversations/{id}"),
            Some(app.key_a.as_str()),
            None,
        )
        .await
        .expect(204);
        app.get(&format!("/v1/conversations/{id}/trace"))
            .await
            .expect_error(404, "not_found");
        let target = bedrock::app::ReplayTarget {
            all: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        let summary = bedrock::app::replay(&app.settings(), &target, &mut out, true)
            .await
            .expect("a replay");
        assert_eq!(
            summary.conversations,
            0,
            "{}",
            String::from_utf8_lossy(&out)
        );
        // A row of steps that does not read is that conversation's report, and the run goes
        // on to the others.
        app.llm.push([Llm::text("one"), Llm::text("two")]);
        let broken = app.conversation().await;
        app.send(&broken, "go").await;
        app.wait_kind(&broken, "idle").await;
        let fine = app.conversation().await;
        app.send(&fine, "go").await;
        app.wait_kind(&fine, "idle").await;
        let db_conn = sea_orm::Database::connect(&app.db_url)
            .await
            .expect("the database");
        // Its packed steps damaged (an unknown format byte, 9).
        let damaged = if app.db_url.starts_with("postgres") {
            "'\\x0900'::bytea"
        } else {
            "X'0900'"
        };
        sea_orm::ConnectionTrait::execute_unprepared(
            &db_conn,
            &format!(
                "UPDATE conversation_frames SET packed_steps = {damaged} WHERE last_step IS NOT NULL \
                 AND conversation_key = (SELECT internal_key FROM conversations WHERE id = '{broken}')"
            ),
        )
        .await
        .expect("a row made unreadable");
        db_conn.close().await.expect("closed");
        let mut out = Vec::new();
        let summary = bedrock::app::replay(&app.settings(), &target, &mut out, true)
            .await
            .expect("a replay that goes on");
        let out = String::from_utf8_lossy(&out);
        assert_eq!(summary.conversations, 2, "{out}");
        assert_eq!(summary.diverged, 1, "{out}");
        assert!(
            out.lines()
                .any(|l| l.contains(&broken) && l.contains("unreadable")),
            "{out}"
        );
        assert!(
            out.lines()
                .any(|l| l.contains(&fine) && l.contains("\"same\":true")),
            "{out}"
        );
        app.cleanup(db).await;
    }
}

/// A new conversation's actor starts its log at step 1 without reading it (created, forked:
/// nothing of it was stored). What a tenant tries first: sending to each conversation as
/// soon as the listing shows it, while its create is still answering, so that its first
/// message may start the actor before the create does; then forking one and sending to the
/// fork. Whichever starts each actor, every trace is numbered from 1 without a gap or a
/// repeat, and `bedrock replay` finds every decision the same.
#[tokio::test]
async fn a_new_conversations_steps_are_numbered_from_one_whoever_starts_it() {
    for db in TestDb::each().await {
        let app = TestApp::spawn(&db).await;
        const CREATES: usize = 8;
        app.llm.push((0..=CREATES).map(|_| Llm::text("ok")));
        let created = async {
            let mut ids = Vec::new();
            for _ in 0..CREATES {
                ids.push(app.conversation().await);
            }
            ids
        };
        let sender = async {
            let mut sent: Vec<String> = Vec::new();
            while sent.len() < CREATES {
                let page = app.get("/v1/conversations?limit=200").await.expect(200);
                for conv in page["conversations"].as_array().expect("a listing") {
                    let id = conv["id"].as_str().expect("an id").to_owned();
                    if !sent.contains(&id) {
                        app.send(&id, "go").await;
                        sent.push(id);
                    }
                }
            }
            sent
        };
        let (mut ids, mut sent) = tokio::join!(created, sender);
        ids.sort();
        sent.sort();
        assert_eq!(ids, sent);
        for id in &ids {
            app.wait_kind(id, "idle").await;
        }
        let fork = app
            .post(&format!("/v1/conversations/{}/fork", ids[0]), json!({}))
            .await
            .expect(201)["id"]
            .as_str()
            .expect("the fork's id")
            .to_owned();
        app.send(&fork, "go").await;
        app.wait_kind(&fork, "idle").await;
        ids.push(fork);
        for id in &ids {
            let trace = app
                .get(&format!("/v1/conversations/{id}/trace?limit=500"))
                .await
                .expect(200);
            let numbers: Vec<i64> = trace["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .filter_map(|s| s["step"].as_i64())
                .collect();
            assert!(!numbers.is_empty(), "{trace}");
            assert_eq!(
                numbers,
                (1..=numbers.len() as i64).collect::<Vec<_>>(),
                "{trace}"
            );
        }
        let target = bedrock::app::ReplayTarget {
            all: true,
            tenant: Some("a".into()),
            ..Default::default()
        };
        let summary = bedrock::app::replay(&app.settings(), &target, &mut Vec::new(), true)
            .await
            .expect("a replay");
        assert_eq!(summary.conversations, ids.len() as u64);
        assert_eq!(summary.diverged, 0);
        app.cleanup(db).await;
    }
}
