//! A cluster (issue "Cluster"): three real `bedrock serve` processes on one fresh Postgres
//! database and one shared workspace directory. Postgres only: skipped (said so) without
//! BEDROCK_TEST_DATABASE_URL.

use std::time::Duration;

use bedrock::testkit::{FakeLlm, Reply as Llm};
use serde_json::{Value, json};

use crate::support::process::{Server, command};
use crate::support::ws::{Ws, is_state};
use crate::support::{TestDb, WAIT, eventually};

/// Leases of two seconds, renewed every half second: failover within seconds.
const TTL_MS: &str = "2000";

fn node(db: &TestDb, llm: &FakeLlm, workspace: &std::path::Path, id: &str) -> Server {
    let mut cmd = command(db, llm, workspace);
    cmd.env("BEDROCK_CLUSTER__NODE_ID", id)
        .env("BEDROCK_CLUSTER__LEASE_TTL_MS", TTL_MS)
        .env("BEDROCK_CLUSTER__HEARTBEAT_MS", "500");
    Server::start_with(cmd)
}

/// Three nodes, their database, fake LLM and shared workspace.
struct Cluster {
    db: TestDb,
    llm: FakeLlm,
    workspace: std::path::PathBuf,
    nodes: Vec<Server>,
}

impl Cluster {
    async fn start() -> Option<Cluster> {
        let Some(db) = TestDb::postgres().await else {
            #[allow(clippy::print_stderr)]
            {
                eprintln!("SKIPPED: cluster tests need Postgres (BEDROCK_TEST_DATABASE_URL)");
            }
            return None;
        };
        bedrock::install_crypto();
        let llm = FakeLlm::start().await;
        let workspace = crate::support::db::temp_dir("cluster-ws");
        let nodes = ["a", "b", "c"]
            .iter()
            .map(|id| node(&db, &llm, &workspace, id))
            .collect();
        Some(Cluster {
            db,
            llm,
            workspace,
            nodes,
        })
    }

    /// Kills the nodes still in the cluster and removes what the test made.
    async fn end(self) {
        for server in self.nodes {
            server.kill_hard();
        }
        crate::support::process::remove_workspace(&self.workspace);
        self.db.drop_db().await;
    }
}

/// A new conversation on `server`: its id and its working directory.
async fn conversation(server: &Server) -> (String, std::path::PathBuf) {
    let created = server.conversation().await;
    let id = created["id"].as_str().expect("an id").to_owned();
    let cwd = std::path::PathBuf::from(created["cwd"].as_str().expect("a cwd"));
    (id, cwd)
}

/// The conversation's tool results, as `[tool_use_id, output]`.
async fn tool_results(server: &Server, id: &str) -> Vec<Value> {
    let messages = server
        .get(&format!("/conversations/{id}/messages"))
        .await
        .expect("messages");
    messages["messages"]
        .as_array()
        .expect("a list")
        .iter()
        .filter(|m| m["message_type"] == "tool")
        .map(|m| json!([m["content"]["tool_use_id"], m["content"]["output"]]))
        .collect()
}

async fn post(server: &Server, path: &str, body: Value) -> (u16, Value) {
    let answer = reqwest::Client::new()
        .post(format!("{}/v1{path}", server.base))
        .json(&body)
        .send()
        .await
        .expect("the node answers");
    let status = answer.status().as_u16();
    (status, answer.json().await.unwrap_or(Value::Null))
}

/// POSTs a user message (the JSON `body`) to conversation `id` through `server`.
async fn send_through(server: &Server, id: &str, body: Value) -> (u16, Value) {
    post(server, &format!("/conversations/{id}/messages"), body).await
}

/// Waits until conversation `id`, read through `server`, is at rest (idle or error).
async fn at_rest_on(server: &Server, id: &str) {
    eventually("the conversation to come to rest", WAIT, || async {
        let kind = state(server, id).await["kind"].as_str()?.to_owned();
        matches!(kind.as_str(), "idle" | "error").then_some(())
    })
    .await;
}

async fn state(server: &Server, id: &str) -> Value {
    server
        .get(&format!("/conversations/{id}"))
        .await
        .expect("a JSON answer")["state"]
        .clone()
}

async fn idle_on(server: &Server, id: &str) {
    eventually("the conversation to be idle", WAIT, || async {
        (state(server, id).await == json!({"kind": "idle"})).then_some(())
    })
    .await;
}

/// A conversation created on A takes a message sent through B (carried to A, its owner)
/// but not one whose carried-by header a client forged,
/// concurrent sends over the three nodes get exactly one 202, a cancel through C stops the
/// running tool, and `/readyz` shows each node.
#[tokio::test]
async fn any_node_answers_for_any_conversation() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let (llm, nodes) = (&cluster.llm, &cluster.nodes);
    let [a, b, c] = &nodes[..] else {
        unreachable!()
    };
    let (id, _) = conversation(a).await;

    // What a hostile client tries first: the header nodes mark a carried request with,
    // forged. The request is neither carried to the owner nor run where it landed: 503 with
    // Retry-After, and nothing is stored (the texts below hold no "forged").
    let forged = reqwest::Client::new()
        .post(format!("{}/v1/conversations/{id}/messages", b.base))
        .header("x-bedrock-forwarded-by", "a")
        .json(&json!({"text": "forged"}))
        .send()
        .await
        .expect("the node answers");
    assert_eq!(forged.status().as_u16(), 503, "a forged carried request");
    assert_eq!(
        forged
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );

    llm.push([Llm::text("hello from the owner")]);
    let (status, _) = send_through(b, &id, json!({"text": "hi"})).await;
    assert_eq!(status, 202, "a send through a node that does not own it");
    idle_on(c, &id).await;
    let messages = c
        .get(&format!("/conversations/{id}/messages"))
        .await
        .expect("messages");
    let texts: Vec<&str> = messages["messages"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|m| m["content"]["text"].as_str())
        .collect();
    assert_eq!(texts, ["hi", "hello from the owner"]);
    let ready = reqwest::get(format!("{}/readyz", a.base))
        .await
        .expect("readyz")
        .json::<Value>()
        .await
        .expect("JSON");
    assert_eq!(ready["node"]["id"], "a");
    assert!(
        ready["node"]["conversations_owned"].as_u64() >= Some(1),
        "{ready}"
    );

    // Sixteen sends at once, over all three nodes: exactly one is accepted.
    let sleep = crate::support::unique_sleep();
    llm.push([Llm::bash("call_1", &sleep)]);
    let sends = (0..16).map(|i| {
        let server = &nodes[i % 3];
        let id = &id;
        async move { send_through(server, id, json!({"text": format!("send {i}")})).await }
    });
    let answers = futures::future::join_all(sends).await;
    let accepted = answers.iter().filter(|(s, _)| *s == 202).count();
    let busy = answers
        .iter()
        .filter(|(s, body)| *s == 409 && body["error"]["code"] == "agent_busy")
        .count();
    assert_eq!((accepted, busy), (1, 15), "{answers:?}");
    crate::support::wait_running(&sleep).await;

    // Cancel through C, which does not own it.
    let (status, cancelled) = post(c, &format!("/conversations/{id}/cancel"), json!({})).await;
    assert_eq!(status, 202, "{cancelled}");
    assert_eq!(cancelled["state"], json!({"kind": "idle"}));
    eventually("the tool to be killed", WAIT, || async {
        (!crate::support::running(&sleep)).then_some(())
    })
    .await;
    cluster.end().await;
}

fn ws_url(server: &Server, id: &str, query: &str) -> String {
    let host = server.base.trim_start_matches("http://");
    format!("ws://{host}/v1/conversations/{id}/ws{query}")
}

/// The durable frames' event ids run on by one from `after`: no gap, no duplicate.
fn assert_consecutive(frames: &[Value], after: i64) -> i64 {
    let ids: Vec<i64> = frames
        .iter()
        .filter(|f| f["type"] != "snapshot")
        .filter_map(|f| f["event_id"].as_i64())
        .collect();
    let expected: Vec<i64> = (after + 1..=after + ids.len() as i64).collect();
    assert_eq!(
        ids, expected,
        "event ids in order, no gap or duplicate: {frames:?}"
    );
    ids.last().copied().unwrap_or(after)
}

/// The texts of a stream's message frames.
fn texts(frames: &[Value]) -> Vec<&str> {
    frames
        .iter()
        .filter(|f| f["type"] == "message")
        .filter_map(|f| f["message"]["content"]["text"].as_str())
        .collect()
}

/// Frames across nodes: a WebSocket on C, which neither created nor runs the conversation,
/// sees the whole of a turn sent through B (in order, no gap or duplicate); its own
/// user_message and cancel frames are carried to the owner; a client resuming on B after an
/// event id gets exactly the rest; a message_id repeated through another node is a repeat.
#[tokio::test]
async fn streams_and_commands_work_from_any_node() {
    let Some(cluster) = Cluster::start().await else {
        return;
    };
    let (llm, nodes) = (&cluster.llm, &cluster.nodes);
    let [a, b, c] = &nodes[..] else {
        unreachable!()
    };
    let (id, _) = conversation(a).await;
    // The owner runs it from its first command on.
    llm.push([Llm::text("first answer")]);
    a.send(&id, "warm up").await;
    idle_on(a, &id).await;

    let mut on_c = Ws::connect(&ws_url(c, &id, "")).await;
    let snapshot = on_c.frame_of("snapshot").await;
    let start = snapshot["event_id"].as_i64().expect("an event id");
    // An answer too large for a notification: C reads it from the stored frames.
    let long = format!("hello from A {}", "x".repeat(10_000));
    llm.push([Llm::text(&long)]);
    let (status, _) = send_through(b, &id, json!({"text": "through B", "message_id": "m-1"})).await;
    assert_eq!(status, 202);
    let turn = on_c.frames_until(|f| is_state(f, "idle")).await;
    let after_turn = assert_consecutive(&turn, start);
    assert_eq!(texts(&turn), ["through B", long.as_str()]);

    // The same message_id through C is the same message, and starts nothing.
    let (status, again) =
        send_through(c, &id, json!({"text": "through B", "message_id": "m-1"})).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["message"]["message_id"], "m-1");

    // C's client sends its own message and cancels the tool it starts, over its socket.
    let sleep = crate::support::unique_sleep();
    llm.push([Llm::bash("call_ws", &sleep)]);
    on_c.send(&json!({"type": "user_message", "text": "from C's socket"}))
        .await;
    let started = on_c.frames_until(|f| is_state(f, "tool_executing")).await;
    crate::support::wait_running(&sleep).await;
    on_c.send(&json!({"type": "cancel"})).await;
    let cancelled = on_c.frames_until(|f| is_state(f, "idle")).await;
    assert!(
        !cancelled
            .iter()
            .chain(&started)
            .any(|f| f["type"] == "rejected"),
        "{cancelled:?}"
    );
    eventually("the tool to be killed", WAIT, || async {
        (!crate::support::running(&sleep)).then_some(())
    })
    .await;
    // A system event over C's socket is the owner's to answer.
    on_c.send(&json!({"type": "system_event",
        "event": {"type": "user_request", "request_id": "r1", "kind": "usage"}}))
        .await;
    let answered = on_c
        .frames_until(|f| f["type"] == "system_event" && f["event"]["type"] == "user_response")
        .await;
    assert!(
        !answered.iter().any(|f| f["type"] == "rejected"),
        "{answered:?}"
    );
    let mut seen = turn.clone();
    seen.extend(started);
    seen.extend(cancelled);
    seen.extend(answered);
    assert_consecutive(&seen, start);
    assert_eq!(texts(&seen)[2], "from C's socket");
    assert_eq!(
        tool_results(a, &id).await.last(),
        Some(&json!(["call_ws", "cancelled by user"])),
    );
    // An interrupting message over C's socket is carried to the owner with its policy.
    let sleep = crate::support::unique_sleep();
    llm.push([Llm::bash("call_long_ws", &sleep), Llm::text("redirected")]);
    on_c.send(&json!({"type": "user_message", "text": "a long one"}))
        .await;
    let long = on_c.frames_until(|f| is_state(f, "tool_executing")).await;
    crate::support::wait_running(&sleep).await;
    on_c.send(&json!({"type": "user_message", "text": "instead", "if_busy": "interrupt"}))
        .await;
    let redirected = on_c
        .frames_until(|f| f["type"] == "message" && f["message"]["content"]["text"] == "redirected")
        .await;
    assert!(
        !long
            .iter()
            .chain(&redirected)
            .any(|f| f["type"] == "rejected"),
        "{redirected:?}"
    );
    assert_eq!(
        tool_results(a, &id).await.last(),
        Some(&json!(["call_long_ws", "cancelled by user"])),
    );
    eventually("the interrupted tool to be killed", WAIT, || async {
        (!crate::support::running(&sleep)).then_some(())
    })
    .await;
    seen.extend(long);
    seen.extend(redirected);
    seen.extend(on_c.frames_until(|f| is_state(f, "idle")).await);
    let last = assert_consecutive(&seen, start);

    // A client resuming on B after the first turn gets exactly what C saw after it.
    let mut on_b = Ws::connect(&ws_url(b, &id, &format!("?after_event_id={after_turn}"))).await;
    let resumed = on_b
        .frames_until(|f| f["event_id"].as_i64() == Some(last) && f["type"] != "snapshot")
        .await;
    let replayed: Vec<&Value> = resumed.iter().filter(|f| f["type"] != "snapshot").collect();
    let expected: Vec<&Value> = seen
        .iter()
        .filter(|f| f["event_id"].as_i64() > Some(after_turn))
        .collect();
    assert_eq!(replayed, expected);
    cluster.end().await;
}

/// kill -9 of the owner in the middle of a tool: within the lease TTL and two seconds
/// another node has taken the conversation over, closed the turn with a synthetic result,
/// and the next turn works through any node.
#[tokio::test]
async fn a_dead_owner_is_replaced_within_the_lease() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    let a = cluster.nodes.remove(0);
    let (llm, nodes) = (&cluster.llm, &cluster.nodes);
    let (id, _) = conversation(&a).await;
    let sleep = crate::support::unique_sleep();
    llm.push([Llm::bash("call_long", &sleep)]);
    a.send(&id, "long job").await;
    crate::support::wait_running(&sleep).await;
    let killed = std::time::Instant::now();
    a.kill_hard();

    let b = &nodes[0];
    idle_on(b, &id).await;
    let took = killed.elapsed();
    let ttl = Duration::from_millis(TTL_MS.parse().expect("a number"));
    // Measured, not a timing test: bounded loosely for a busy machine.
    assert!(took < ttl + WAIT, "took over after {took:?}");
    assert_eq!(
        tool_results(b, &id).await,
        [json!(["call_long", "interrupted by server restart"])]
    );

    llm.push([Llm::text("still here")]);
    let c = &nodes[1];
    let (status, _) = send_through(c, &id, json!({"text": "and now?"})).await;
    assert_eq!(status, 202);
    idle_on(b, &id).await;
    let request = eventually("the next request", WAIT, || async {
        llm.requests().get(1).cloned()
    })
    .await;
    assert_eq!(
        crate::support::roles(&request),
        ["system", "user", "assistant", "tool", "user"]
    );
    cluster.end().await;
}

/// Fencing: the owner is paused (SIGSTOP) in the middle of a tool until its lease expires,
/// another node takes the conversation over and runs a turn, then the first wakes up with
/// its tool finished: it stores nothing for that conversation (the database refuses its
/// stale epoch), each tool ran once, and the chain is the new owner's.
#[tokio::test]
async fn a_paused_owner_cannot_write_after_losing_its_lease() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    let a = cluster.nodes.remove(0);
    let (llm, nodes) = (&cluster.llm, &cluster.nodes);
    let (id, cwd) = conversation(&a).await;
    llm.push([Llm::bash("call_a", "echo a >> ran_a; sleep 2; echo a-done")]);
    a.send(&id, "slow job").await;
    eventually("A's tool to start", WAIT, || async {
        cwd.join("ran_a").exists().then_some(())
    })
    .await;
    let pid = nix::unistd::Pid::from_raw(i32::try_from(a.child.id()).expect("a pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");

    let b = &nodes[0];
    idle_on(b, &id).await;
    llm.push([
        Llm::bash("call_b", "echo b >> ran_b"),
        Llm::text("done on b"),
    ]);
    let (status, _) = send_through(b, &id, json!({"text": "again"})).await;
    assert_eq!(status, 202);
    eventually("B's turn to end", WAIT, || async {
        let messages = b.get(&format!("/conversations/{id}/messages")).await?;
        let last = messages["messages"].as_array()?.last()?.clone();
        (last["content"]["text"] == "done on b").then_some(())
    })
    .await;

    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    // A's tool has finished while it slept; give A time to try to store its result.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let outputs = tool_results(b, &id).await;
    assert_eq!(outputs.len(), 2, "{outputs:?}");
    assert_eq!(
        outputs[0],
        json!(["call_a", "interrupted by server restart"]),
        "A's late result was not stored"
    );
    assert_eq!(outputs[1][0], "call_b");
    assert_eq!(
        std::fs::read_to_string(cwd.join("ran_a")).expect("A's marker"),
        "a\n"
    );
    assert_eq!(
        std::fs::read_to_string(cwd.join("ran_b")).expect("B's marker"),
        "b\n"
    );
    assert_eq!(state(b, &id).await, json!({"kind": "idle"}));
    assert_eq!(
        llm.requests().len(),
        3,
        "A sent no LLM request after waking"
    );
    let refused = a
        .logs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|line| line.contains("lease moved"));
    assert!(
        refused,
        "A tried to store its result and the database refused it"
    );
    a.kill_hard();
    cluster.end().await;
}

/// The user messages stored in conversation `id`, in order.
async fn user_texts(server: &Server, id: &str) -> Vec<String> {
    let messages = server
        .get(&format!("/conversations/{id}/messages?limit=1000"))
        .await
        .expect("messages");
    messages["messages"]
        .as_array()
        .expect("a list")
        .iter()
        .filter(|m| m["message_type"] == "user")
        .filter_map(|m| m["content"]["text"].as_str().map(str::to_owned))
        .collect()
}

/// kill -9 of a node while a third of forty conversations have a turn in flight on it: every
/// one of the forty acknowledged messages is stored, and every conversation comes to rest
/// on a surviving node.
#[tokio::test]
async fn no_acknowledged_message_is_lost_when_a_node_dies() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    cluster.llm.fallback(Llm::text("answered"));
    cluster.llm.latency(Duration::from_millis(400));
    let mut acked = Vec::new();
    for i in 0..40 {
        let server = &cluster.nodes[i % 3];
        let (id, _) = conversation(server).await;
        let text = format!("message {i}");
        let (status, body) = send_through(server, &id, json!({ "text": text })).await;
        assert_eq!(status, 202, "{body}");
        acked.push((id, text));
    }
    cluster.nodes.remove(0).kill_hard();
    let survivor = &cluster.nodes[0];
    let mut lost = 0;
    for (id, text) in &acked {
        at_rest_on(survivor, id).await;
        if user_texts(survivor, id).await != [text.clone()] {
            lost += 1;
        }
    }
    assert_eq!(lost, 0, "acknowledged messages lost");
    cluster.end().await;
}

/// What a client following a conversation across nodes received.
struct Followed {
    /// The event id of its first snapshot.
    first: i64,
    /// The event ids of the durable frames after it, in the order received.
    ids: Vec<i64>,
    reconnects: usize,
}

/// A client that follows conversation `id`'s stream over the nodes at `bases`, starting on
/// `at`: when its node goes away it resumes on the next with the last event id it saw. It
/// stops once it has seen the event id `until` says (set at the end).
async fn follow(
    id: String,
    bases: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    mut at: usize,
    until: std::sync::Arc<std::sync::atomic::AtomicI64>,
) -> Followed {
    use std::sync::atomic::Ordering;
    let mut followed = Followed {
        first: -1,
        ids: Vec::new(),
        reconnects: 0,
    };
    let mut last: Option<i64> = None;
    loop {
        let base = {
            let bases = bases.lock().unwrap_or_else(|e| e.into_inner());
            bases[at % bases.len()].clone()
        };
        let host = base.trim_start_matches("http://");
        let query = last.map_or(String::new(), |l| format!("?after_event_id={l}"));
        let url = format!("ws://{host}/v1/conversations/{id}/ws{query}");
        let Ok((socket, _)) = tokio_tungstenite::connect_async(url).await else {
            at += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut ws = Ws { socket };
        loop {
            match ws.next(Duration::from_millis(200)).await {
                None => {
                    if last.is_some_and(|l| l >= until.load(Ordering::Acquire)) {
                        return followed;
                    }
                }
                Some(crate::support::ws::Next::Frame(frame)) => {
                    let event_id = frame["event_id"].as_i64();
                    if frame["type"] == "snapshot" {
                        if last.is_none() {
                            followed.first = event_id.expect("a snapshot's event id");
                            last = event_id;
                        }
                    } else if let Some(event_id) = event_id {
                        followed.ids.push(event_id);
                        last = Some(event_id);
                    }
                }
                Some(crate::support::ws::Next::Closed(..)) => {
                    followed.reconnects += 1;
                    at += 1;
                    break;
                }
            }
        }
    }
}

/// A rolling restart: each node in turn gets SIGTERM while turns run and clients stream
/// from it, and comes back under the same id. No acknowledged message is lost, and every
/// client resumes on another node and sees every durable frame once, in order.
#[tokio::test]
async fn a_rolling_restart_loses_nothing() {
    let Some(mut cluster) = Cluster::start().await else {
        return;
    };
    cluster.llm.fallback(Llm::text("answered"));
    cluster.llm.latency(Duration::from_millis(300));
    let bases = std::sync::Arc::new(std::sync::Mutex::new(
        cluster
            .nodes
            .iter()
            .map(|n| n.base.clone())
            .collect::<Vec<_>>(),
    ));
    let mut conversations = Vec::new();
    for k in 0..6 {
        let (id, _) = conversation(&cluster.nodes[k % 3]).await;
        let until = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(i64::MAX));
        let client = tokio::spawn(follow(id.clone(), bases.clone(), k % 3, until.clone()));
        conversations.push((id, until, client, Vec::new()));
    }
    for round in 0..3 {
        for (k, (id, _, _, acked)) in conversations.iter_mut().enumerate() {
            let server = &cluster.nodes[(k + round) % 3];
            let text = format!("round {round}, conversation {k}");
            let (status, body) = send_through(server, id, json!({ "text": text })).await;
            assert_eq!(status, 202, "{body}");
            acked.push(text);
        }
        let old = cluster.nodes.remove(round);
        let exited = tokio::task::spawn_blocking(move || old.terminate())
            .await
            .expect("the node exits");
        assert!(exited.success(), "a graceful stop: {exited:?}");
        let back = node(
            &cluster.db,
            &cluster.llm,
            &cluster.workspace,
            ["a", "b", "c"][round],
        );
        bases.lock().unwrap_or_else(|e| e.into_inner())[round] = back.base.clone();
        cluster.nodes.insert(round, back);
        for (id, ..) in &conversations {
            at_rest_on(&cluster.nodes[round], id).await;
        }
    }
    let any = &cluster.nodes[0];
    for (id, until, client, acked) in conversations {
        assert_eq!(
            user_texts(any, &id).await,
            acked,
            "acknowledged messages stored"
        );
        let mut ws = Ws::connect(&ws_url(any, &id, "")).await;
        let last = ws.frame_of("snapshot").await["event_id"]
            .as_i64()
            .expect("an event id");
        until.store(last, std::sync::atomic::Ordering::Release);
        let followed = tokio::time::timeout(WAIT, client)
            .await
            .expect("the client catches up")
            .expect("the client's task");
        let expected: Vec<i64> = (followed.first + 1..=last).collect();
        assert_eq!(followed.ids, expected, "every durable frame once, in order");
        assert!(followed.reconnects >= 1, "the client's node was restarted");
    }
    cluster.end().await;
}
