//! Postgres's write path: a group commit as one statement, one round trip to the server.
//!
//! Through sea-orm's transaction a commit was five round trips (BEGIN, three statements,
//! COMMIT), each a wake-up of the server's backend and of the task waiting for its answer.
//! Here the batch goes over as three JSON documents (its conversations' new counters and
//! state, its messages, its frames) to `bedrock_commit`, a function the migrations create,
//! which writes them. A single statement is its own transaction: it lands whole or not at
//! all. Each conversation's update is guarded by the counters the commit expects; one that
//! finds its conversation gone or its counters moved raises SQLSTATE `BR409`, which undoes
//! the whole statement. The text never changes with the batch's size, so it stays prepared.

use std::net::SocketAddr;
use std::sync::Arc;

use chrono::{DateTime, SecondsFormat, Utc};
use sea_orm::{ConnectionTrait, DbBackend, Statement, Value};
use serde::Serialize;

use super::codec;
use super::limits::SummedUsage;
use super::{Result, StoreError, UsageRecord, to_i64};
use crate::model::ConversationCommit;
use crate::state_machine::ConvState;

/// The whole batch, written by the migrations' `bedrock_commit` function.
const COMMIT: &str = "SELECT bedrock_commit($1::json, $2::json, $3::json)";

/// The SQLSTATE `bedrock_commit` raises when a guarded update finds nothing to change.
pub(super) const GUARD_FAILED: &str = "BR409";

/// The usage of LLM responses, beside [`COMMIT`] in one statement (one round trip, one
/// transaction): the day's usage rows, then the budgets' spend in place of their
/// reservations. Rows are summed per key first (one statement may not change a row twice).
const USAGE: &str = "u AS (INSERT INTO usage_daily (tenant_id, model, day, input_tokens, output_tokens) \
       SELECT tenant_id, model, day, input_tokens, output_tokens FROM \
       json_to_recordset($U1::json) AS x(tenant_id text, model text, day text, input_tokens bigint, output_tokens bigint) \
       ON CONFLICT (tenant_id, day, model) DO UPDATE SET \
       input_tokens = usage_daily.input_tokens + excluded.input_tokens, \
       output_tokens = usage_daily.output_tokens + excluded.output_tokens), \
     b AS (UPDATE tenant_limits SET used = used + x.spent, \
       reserved = CASE WHEN reserved > x.held THEN reserved - x.held ELSE 0 END \
       FROM json_to_recordset($U2::json) AS x(tenant_id text, period_start text, spent bigint, held bigint) \
       WHERE tenant_limits.tenant_id = x.tenant_id AND tenant_limits.period_start = x.period_start)";

/// Webhook deliveries beside [`COMMIT`] (issue 39): those of the batch's commits' events,
/// in the same statement, so they land with the change that caused them or not at all; each
/// only while its endpoint is there and enabled (one deleted or disabled on another node
/// since this one read the endpoints gets nothing, and takes no commit down with it).
const DELIVERIES: &str = "d AS (INSERT INTO webhook_deliveries (id, webhook_id, tenant_id, conversation_id, \
       event_seq, event_type, payload, next_attempt_at, expires_at, created_at, updated_at, claimed_by, \
       claimed_until, status, attempts, attempts_log) \
       SELECT x.id, x.webhook_id, x.tenant_id, x.conversation_id, x.event_seq, x.event_type, x.payload, \
       x.created_at, x.expires_at, x.created_at, x.created_at, x.claimed_by, x.claimed_until, 'pending', 0, '[]' FROM \
       json_to_recordset($D1::json) AS x(ord bigint, id text, webhook_id text, tenant_id text, \
       conversation_id text, event_seq bigint, event_type text, payload text, created_at bigint, \
       expires_at bigint, claimed_by text, claimed_until bigint) \
       JOIN webhooks w ON w.id = x.webhook_id AND w.enabled \
       ORDER BY x.ord)";

/// The replay log beside [`COMMIT`] (issue 40): the steps of a commit without frames (the
/// others ride on its last row of frames) as one row of `conversation_steps`, in the same
/// statement. The conversation exists before its commit
/// (the guarded update needs it), so the statement's snapshot finds its key.
const STEPS: &str = "s AS (INSERT INTO conversation_steps (conversation_key, last_step, first_step, packed_steps, created_at) \
       SELECT k.internal_key, x.last_step, x.first_step, decode(x.packed_steps, 'base64'), x.created_at FROM \
       json_to_recordset($S1::json) AS x(conversation_id text, last_step bigint, first_step bigint, packed_steps text, created_at bigint) \
       JOIN conversations k ON k.id = x.conversation_id)";

/// The statement of a batch with or without usage, deliveries and steps: eight texts, each
/// prepared once.
fn commit_text(usage: bool, deliveries: bool, steps: bool) -> &'static str {
    static TEXTS: std::sync::LazyLock<[String; 8]> = std::sync::LazyLock::new(|| {
        let text = |usage: bool, deliveries: bool, steps: bool| {
            if !usage && !deliveries && !steps {
                return COMMIT.to_owned();
            }
            let mut parts = vec![
                "c AS (SELECT bedrock_commit($1::json, $2::json, $3::json) AS done)".to_owned(),
            ];
            let mut next = 4;
            if usage {
                parts.push(
                    USAGE
                        .replace("$U1", &format!("${next}"))
                        .replace("$U2", &format!("${}", next + 1)),
                );
                next += 2;
            }
            if deliveries {
                parts.push(DELIVERIES.replace("$D1", &format!("${next}")));
                next += 1;
            }
            if steps {
                parts.push(STEPS.replace("$S1", &format!("${next}")));
            }
            format!("WITH {} SELECT done FROM c", parts.join(", "))
        };
        std::array::from_fn(|i| text(i & 1 != 0, i & 2 != 0, i & 4 != 0))
    });
    &TEXTS[usize::from(usage) + 2 * usize::from(deliveries) + 4 * usize::from(steps)]
}

/// Writes `commits` in one statement, with the usage in `usage` (if any) and the commits'
/// webhook deliveries (if any).
pub(super) async fn commit(
    db: &impl ConnectionTrait,
    commits: &[Arc<ConversationCommit>],
    usage: &[UsageRecord],
) -> Result<()> {
    let [conversations, messages, frames] = documents(commits)?;
    let mut values = vec![
        Value::from(conversations),
        Value::from(messages),
        Value::from(frames),
    ];
    if !usage.is_empty() {
        let (days, spends) = usage_documents(usage);
        values.extend([Value::from(days), Value::from(spends)]);
    }
    let deliveries: Vec<serde_json::Value> = commits
        .iter()
        .flat_map(|commit| &commit.deliveries)
        .enumerate()
        .map(|(ord, d)| {
            let (claimed_by, claimed_until) = d
                .claimed
                .as_ref()
                .map_or((None, None), |(by, until)| (Some(by), Some(until)));
            serde_json::json!({"ord": ord, "id": d.id, "webhook_id": d.webhook_id,
                "tenant_id": d.tenant_id, "conversation_id": d.conversation_id,
                "event_seq": d.event_seq, "event_type": d.event_type, "payload": d.payload,
                "created_at": d.created_at, "expires_at": d.expires_at,
                "claimed_by": claimed_by, "claimed_until": claimed_until})
        })
        .collect();
    let has_deliveries = !deliveries.is_empty();
    if has_deliveries {
        values.push(Value::from(
            serde_json::Value::Array(deliveries).to_string(),
        ));
    }
    let steps: Vec<serde_json::Value> = commits
        .iter()
        .filter(|commit| super::steps_row(commit))
        .map(|commit| {
            serde_json::json!({"conversation_id": commit.conversation_id,
                "last_step": commit.steps.last().map_or(0, |step| step.n),
                "first_step": commit.steps.first().map_or(0, |step| step.n),
                "packed_steps": super::base64_text(&super::packed_steps(commit)),
                "created_at": commit.at.timestamp_millis()})
        })
        .collect();
    let has_steps = !steps.is_empty();
    if has_steps {
        values.push(Value::from(serde_json::Value::Array(steps).to_string()));
    }
    let sql = commit_text(!usage.is_empty(), has_deliveries, has_steps);
    db.query_one_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        sql,
        values,
    ))
    .await?;
    Ok(())
}

/// The usage rows of a batch, summed per (tenant, model, day), and the budgets' spends,
/// summed per (tenant, period), as JSON documents.
fn usage_documents(usage: &[UsageRecord]) -> (String, String) {
    let summed = SummedUsage::of(usage);
    let days: Vec<serde_json::Value> = summed
        .days
        .into_iter()
        .map(|((tenant_id, model, day), (input, output))| {
            serde_json::json!({"tenant_id": tenant_id, "model": model, "day": day,
                "input_tokens": to_i64(input), "output_tokens": to_i64(output)})
        })
        .collect();
    let spends: Vec<serde_json::Value> = summed
        .spends
        .into_iter()
        .map(|((tenant_id, period_start), (spent, held))| {
            serde_json::json!({"tenant_id": tenant_id, "period_start": period_start,
                "spent": to_i64(spent), "held": to_i64(held)})
        })
        .collect();
    (
        serde_json::Value::Array(days).to_string(),
        serde_json::Value::Array(spends).to_string(),
    )
}

/// The batch's three documents: its conversations' guarded updates, its messages, its
/// frames. Each is serialised straight from the commits (the rows borrow from them), not
/// built as a `serde_json::Value` first, which copied every frame's payload.
fn documents(commits: &[Arc<ConversationCommit>]) -> Result<[String; 3]> {
    let mut conversations = Vec::with_capacity(commits.len());
    let mut messages = Vec::new();
    let mut frames = Vec::new();
    for commit in commits {
        let state = commit.state.as_ref();
        let usage = commit.usage;
        conversations.push(ConversationRow {
            id: &commit.conversation_id,
            exp_seq: commit.expected_next_sequence_id,
            exp_evt: commit.expected_next_event_id,
            next_seq: commit.next_sequence_id,
            next_evt: commit.next_event_id,
            updated_at: timestamp(commit.at),
            state: state.map(ConvState::kind),
            state_data: state,
            state_at: state.map(|_| timestamp(commit.at)),
            input_tokens: usage.map(|u| to_i64(u.input_tokens)),
            output_tokens: usage.map(|u| to_i64(u.output_tokens)),
            context_tokens: usage.map(|u| to_i64(u.context_tokens)),
            epoch: commit.lease,
        });
        messages.extend(commit.messages.iter().map(|message| MessageRow {
            event_id: super::message_event_id(commit, message.sequence_id),
            id: &message.id,
            conversation_id: &message.conversation_id,
            sequence_id: message.sequence_id,
            message_type: message.content.message_type().as_str(),
            content: codec::content(&message.content),
            usage_data: message.usage.as_ref().map(codec::usage),
            client_message_id: message.client_message_id.as_deref(),
            created_at: timestamp(message.created_at),
        }));
        frames.extend(super::frame_rows(commit));
    }
    Ok([
        document(&conversations)?,
        document(&messages)?,
        document(&frames)?,
    ])
}

fn document<T: Serialize>(rows: &[T]) -> Result<String> {
    serde_json::to_string(rows)
        .map_err(|e| StoreError::Other(format!("a commit does not serialise: {e}")))
}

/// A conversation's guarded update, as `bedrock_commit` reads it.
#[derive(Serialize)]
struct ConversationRow<'a> {
    id: &'a str,
    exp_seq: i64,
    exp_evt: i64,
    next_seq: i64,
    next_evt: i64,
    updated_at: String,
    state: Option<&'static str>,
    state_data: Option<&'a ConvState>,
    state_at: Option<String>,
    input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    context_tokens: Option<i64>,
    /// The lease epoch the commit is made under; `null`: unguarded (SQLite-era callers).
    epoch: Option<i64>,
}

/// A message row, as `bedrock_commit` reads it.
#[derive(Serialize)]
struct MessageRow<'a> {
    id: &'a str,
    conversation_id: &'a str,
    sequence_id: i64,
    message_type: &'static str,
    content: serde_json::Value,
    usage_data: Option<serde_json::Value>,
    client_message_id: Option<&'a str>,
    created_at: String,
    /// The event id of the message's frame.
    event_id: Option<i64>,
}

/// A time as Postgres reads it, to the microsecond it keeps (truncated, as sqlx binds one).
fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Turns off Nagle's algorithm on a new connection's socket. sqlx (0.9) leaves it on, and a
/// statement that did not fit in one TCP segment then waited for the server's delayed ACK
/// before its last segment went out: 40–50 ms stalls, which made most of the commit tail.
/// sqlx does not expose its socket, so this finds it among the process's file descriptors by
/// its two addresses, as the server reports them. A connection through a proxy or a Unix
/// socket, which the addresses do not match, is left as it is.
pub(super) async fn no_delay(
    conn: &mut sea_orm::sqlx::PgConnection,
) -> Result<(), sea_orm::sqlx::Error> {
    if let Some((local, peer)) = ends(conn).await?
        && with_socket(local, peer, |socket| socket.set_tcp_nodelay(true)).is_none()
    {
        tracing::debug!(%local, %peer, "no socket of this process has the connection's addresses");
    }
    Ok(())
}

/// A connection's addresses, ours then the server's, as the server sees them (`None` over a
/// Unix socket).
async fn ends(
    conn: &mut sea_orm::sqlx::PgConnection,
) -> Result<Option<(SocketAddr, SocketAddr)>, sea_orm::sqlx::Error> {
    type Ends = (Option<String>, Option<i32>, Option<String>, Option<i32>);
    let (client, client_port, server, server_port): Ends = sea_orm::sqlx::query_as(
        "SELECT host(inet_client_addr()), inet_client_port(), \
                host(inet_server_addr()), inet_server_port()",
    )
    .fetch_one(conn)
    .await?;
    let end = |host: Option<String>, port: Option<i32>| {
        Some(SocketAddr::new(
            host?.parse().ok()?,
            u16::try_from(port?).ok()?,
        ))
    };
    Ok(end(client, client_port).zip(end(server, server_port)))
}

/// Runs `f` on the socket of this process connected from `local` to `peer`, if there is one.
#[allow(unsafe_code)]
fn with_socket<T>(
    local: SocketAddr,
    peer: SocketAddr,
    f: impl FnOnce(&socket2::SockRef<'_>) -> T,
) -> Option<T> {
    use std::os::fd::{BorrowedFd, RawFd};
    let fds = std::fs::read_dir("/proc/self/fd").ok()?;
    for fd in fds.flatten() {
        let Some(raw) = fd
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok())
        else {
            continue;
        };
        // SAFETY: the descriptor is only used while borrowed here, by getsockname,
        // getpeername and what `f` does to the one socket with exactly this pair of
        // addresses, the connection's own. Were another descriptor closed and its number
        // reused in between, those calls fail or find other addresses.
        let fd = unsafe { BorrowedFd::borrow_raw(raw) };
        let socket = socket2::SockRef::from(&fd);
        let address = |a: std::io::Result<socket2::SockAddr>| a.ok().and_then(|a| a.as_socket());
        if address(socket.local_addr()) == Some(local) && address(socket.peer_addr()) == Some(peer)
        {
            return Some(f(&socket));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{drop_postgres, postgres_store};

    /// Every pooled Postgres connection over TCP sends without waiting for ACKs
    /// (TCP_NODELAY); one over a Unix socket has no addresses to find, and the hook leaves it
    /// as it is.
    #[tokio::test]
    async fn postgres_connections_do_not_wait_for_acks() {
        let Some((store, name)) = postgres_store(&[]).await else {
            return;
        };
        let pool = store.db.get_postgres_connection_pool();
        let over_socket = pool.connect_options().get_socket().is_some();
        let mut conn = pool.acquire().await.expect("a connection");
        let found = ends(&mut conn).await.expect("the server answers");
        if over_socket {
            assert_eq!(found, None, "a Unix socket has no TCP addresses");
        } else {
            let (local, peer) = found.expect("a TCP connection");
            let nodelay = with_socket(local, peer, |socket| socket.tcp_nodelay().expect("reads"));
            assert_eq!(nodelay, Some(true));
        }
        drop(conn);
        drop_postgres(store, &name).await;
    }
}
