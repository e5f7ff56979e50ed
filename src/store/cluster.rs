//! Postgres: nodes, their heartbeats, and the leases on conversations (migration m7). A lease
//! is `conversations.lease_owner` (a node's incarnation: one per process start) and
//! `lease_epoch`; it is live while that incarnation's heartbeat is younger than the TTL, so
//! one heartbeat renews every lease of a node. Each statement here decides in the database,
//! in one statement: two nodes racing for a lease cannot both win.

use std::sync::atomic::Ordering;
use std::time::Duration;

use entity::conversations;
use sea_orm::{ConnectionTrait, DbBackend, FromQueryResult, Statement, Value};

use super::{Result, Store, StoreError};
use crate::model::ConversationRecord;

/// Who holds a conversation's lease, when it is not us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub node: String,
    /// The base URL the owner serves its API on.
    pub advertise: String,
}

/// What taking a lease found.
#[derive(Clone, Debug, PartialEq)]
pub enum Lease {
    /// Ours: the conversation as stored, its `lease` the new epoch (the fencing token every
    /// commit carries), and the incarnation that held it before (`None`: nobody).
    Taken {
        record: Box<ConversationRecord>,
        previous: Option<String>,
    },
    /// Held by another live node.
    Elsewhere(Owner),
    /// No such conversation.
    Missing,
}

/// A node of the cluster as this process runs it.
#[derive(Clone, Copy, Debug)]
pub struct Node<'a> {
    pub id: &'a str,
    /// This process's run of the node: the owner of the leases it takes.
    pub incarnation: &'a str,
    pub ttl: Duration,
}

impl Node<'_> {
    fn ttl_ms(&self) -> Value {
        Value::from(i64::try_from(self.ttl.as_millis()).unwrap_or(i64::MAX))
    }
}

/// The channel nodes announce their conversations' frames on.
pub const FRAMES_CHANNEL: &str = "bedrock_frames";

/// The channel nodes say which conversations they have clients for on.
pub const WATCH_CHANNEL: &str = "bedrock_watch";

/// True in SQL for a conversation `c` with work in flight: a turn, or a background task.
const WORK: &str = "(c.state NOT IN ('idle', 'error', 'completed', 'context_exhausted') \
    OR EXISTS (SELECT 1 FROM background_tasks b \
               WHERE b.conversation_id = c.id AND b.status = 'running'))";

/// True in SQL for a conversation `c` whose lease no live node holds; `$ttl` is the bound
/// parameter of the TTL in milliseconds.
fn unheld(ttl: &str) -> String {
    format!(
        "(c.lease_owner IS NULL OR NOT EXISTS (SELECT 1 FROM nodes n \
         WHERE n.incarnation = c.lease_owner \
             AND n.heartbeat_at > now() - {ttl} * interval '1 millisecond'))"
    )
}

impl Store {
    fn require_postgres(&self) -> Result<()> {
        if self.backend() == DbBackend::Postgres {
            Ok(())
        } else {
            Err(StoreError::Other(
                "a cluster needs Postgres; SQLite is one node".into(),
            ))
        }
    }

    fn postgres(&self, sql: &str, values: impl IntoIterator<Item = Value>) -> Result<Statement> {
        self.require_postgres()?;
        Ok(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            values,
        ))
    }

    /// Registers this incarnation of the node (retiring any earlier one of the same id, whose
    /// leases end at once) or renews its heartbeat and with it every lease it holds; tells
    /// how many other nodes are live.
    pub async fn heartbeat(&self, node: Node<'_>, advertise: &str) -> Result<u64> {
        let statement = self.postgres(
            "WITH retired AS ( \
                 UPDATE nodes SET heartbeat_at = '-infinity' \
                 WHERE id = $1 AND incarnation <> $2 AND heartbeat_at > '-infinity'), \
             beat AS ( \
                 INSERT INTO nodes (incarnation, id, advertise) VALUES ($2, $1, $3) \
                 ON CONFLICT (incarnation) DO UPDATE \
                     SET heartbeat_at = now(), advertise = EXCLUDED.advertise) \
             SELECT count(*) AS peers FROM nodes WHERE id <> $1 \
                 AND heartbeat_at > now() - $4 * interval '1 millisecond'",
            [
                Value::from(node.id),
                Value::from(node.incarnation),
                Value::from(advertise),
                node.ttl_ms(),
            ],
        )?;
        let row = self
            .db
            .query_one_raw(statement)
            .await?
            .ok_or_else(|| StoreError::Other("a heartbeat returned no row".into()))?;
        let peers: i64 = row.try_get("", "peers")?;
        let peers = u64::try_from(peers).unwrap_or(0);
        // Frames are announced to other nodes only while there are any.
        self.peers.store(peers > 0, Ordering::Relaxed);
        Ok(peers)
    }

    /// Whether other nodes were live at the last heartbeat.
    pub fn has_peers(&self) -> bool {
        self.peers.load(Ordering::Relaxed)
    }

    /// The flag behind [`has_peers`](Self::has_peers), kept up to date by the heartbeats.
    pub fn peers(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        self.peers.clone()
    }

    /// Sends these notifications to the other nodes' listeners on `channel`
    /// ([`FRAMES_CHANNEL`] or [`WATCH_CHANNEL`]; see the cluster's `frames` module for what
    /// they say). In a transaction of its own,
    /// after the commits whose frames they announce, and without waiting for its commit to
    /// reach the disk: a NOTIFY holds a lock that every notifying transaction of the
    /// database takes in turn until its commit is done, so inside the commits it would put
    /// them all in a single file, each behind the previous one's flush. A notification lost
    /// in a crash costs nothing: the frames are stored, and the listeners' sweep finds them.
    pub async fn notify(&self, channel: &str, payloads: &[String]) -> Result<()> {
        if payloads.is_empty() {
            return Ok(());
        }
        self.require_postgres()?;
        let document = serde_json::to_string(payloads)
            .map_err(|e| StoreError::Other(format!("notifications do not serialise: {e}")))?;
        // One statement, its own transaction: the setting made local to it is still in
        // force when it commits.
        self.db
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT set_config('synchronous_commit', 'off', true), \
                     (SELECT count(pg_notify($1, p)) FROM json_array_elements_text($2::json) p)",
                [Value::from(channel), Value::from(document)],
            ))
            .await?;
        Ok(())
    }

    /// Takes the lease of conversation `id` for `node` when nobody live holds it (or `node`
    /// does), adding one to its epoch: whoever held it before can no longer write for it.
    pub async fn take_lease(&self, id: &str, node: Node<'_>) -> Result<Lease> {
        // Held by another live node (every command carried to its owner asks): said by a
        // plain read. Taking the lease locks the row, which is a write (flushed to the log
        // at its commit) and waits behind the owner's own commits.
        if let Some(owner) = self.live_owner(id, node).await? {
            return Ok(Lease::Elsewhere(owner));
        }
        // Released between the two statements: once more.
        for _ in 0..2 {
            if let Some(lease) = self.try_take_lease(id, node).await? {
                return Ok(lease);
            }
        }
        Ok(Lease::Elsewhere(Owner {
            node: String::new(),
            advertise: String::new(),
        }))
    }

    async fn try_take_lease(&self, id: &str, node: Node<'_>) -> Result<Option<Lease>> {
        // The row is locked first, so `previous` is the holder this update replaces.
        let sql = format!(
            "UPDATE conversations c SET lease_owner = $1, lease_epoch = c.lease_epoch + 1 \
             FROM (SELECT id, lease_owner AS previous FROM conversations \
                   WHERE id = $2 FOR UPDATE) old \
             WHERE c.id = old.id AND (c.lease_owner = $1 OR {}) \
             RETURNING c.*, old.previous",
            unheld("$3")
        );
        let statement = self.postgres(
            &sql,
            [
                Value::from(node.incarnation),
                Value::from(id),
                node.ttl_ms(),
            ],
        )?;
        if let Some(row) = self.db.query_one_raw(statement).await? {
            let mut record =
                super::conversation(conversations::Model::from_query_result(&row, "")?)?;
            record.lease = Some(row.try_get("", "lease_epoch")?);
            return Ok(Some(Lease::Taken {
                record: Box::new(record),
                previous: row.try_get("", "previous")?,
            }));
        }
        let statement = self.postgres(
            "SELECT n.id, n.advertise FROM conversations c \
             LEFT JOIN nodes n ON n.incarnation = c.lease_owner WHERE c.id = $1",
            [Value::from(id)],
        )?;
        let Some(row) = self.db.query_one_raw(statement).await? else {
            return Ok(Some(Lease::Missing));
        };
        let owner: Option<String> = row.try_get("", "id")?;
        let advertise: Option<String> = row.try_get("", "advertise")?;
        Ok(owner.map(|node| {
            Lease::Elsewhere(Owner {
                node,
                advertise: advertise.unwrap_or_default(),
            })
        }))
    }

    /// The live owner of conversation `id` when it is another node than `node`.
    pub async fn live_owner(&self, id: &str, node: Node<'_>) -> Result<Option<Owner>> {
        let statement = self.postgres(
            "SELECT n.id, n.advertise FROM conversations c \
             JOIN nodes n ON n.incarnation = c.lease_owner \
             WHERE c.id = $1 AND n.id <> $2 \
                 AND n.heartbeat_at > now() - $3 * interval '1 millisecond'",
            [Value::from(id), Value::from(node.id), node.ttl_ms()],
        )?;
        let Some(row) = self.db.query_one_raw(statement).await? else {
            return Ok(None);
        };
        Ok(Some(Owner {
            node: row.try_get("", "id")?,
            advertise: row.try_get("", "advertise")?,
        }))
    }

    /// Conversations with work that nobody live is doing (a turn in flight or a background
    /// task running), held by an incarnation that is dead: found through the dead
    /// incarnations' rows. `unowned` also looks among conversations nobody holds, a scan of
    /// the table for rows from before leases existed (start-up only). At most `limit`.
    pub async fn orphaned_conversations(
        &self,
        node: Node<'_>,
        unowned: bool,
        limit: u64,
    ) -> Result<Vec<String>> {
        let sql = format!(
            "SELECT c.id FROM nodes n JOIN conversations c ON c.lease_owner = n.incarnation \
             WHERE n.heartbeat_at <= now() - $1 * interval '1 millisecond' AND {WORK} \
             UNION ALL \
             SELECT c.id FROM conversations c WHERE $2 AND c.lease_owner IS NULL AND {WORK} \
             LIMIT $3"
        );
        let statement = self.postgres(
            &sql,
            [
                node.ttl_ms(),
                Value::from(unowned),
                Value::from(i64::try_from(limit).unwrap_or(i64::MAX)),
            ],
        )?;
        self.db
            .query_all_raw(statement)
            .await?
            .into_iter()
            .map(|row| Ok(row.try_get("", "id")?))
            .collect()
    }

    /// Lets go of what dead incarnations still hold with no work in it (their conversations
    /// at rest), then forgets the incarnations that hold nothing.
    pub async fn clear_dead_nodes(&self, node: Node<'_>) -> Result<()> {
        let release = self.postgres(
            &format!(
                "UPDATE conversations c SET lease_owner = NULL FROM nodes n \
                 WHERE c.lease_owner = n.incarnation \
                     AND n.heartbeat_at <= now() - $1 * interval '1 millisecond' AND NOT {WORK}"
            ),
            [node.ttl_ms()],
        )?;
        self.db.execute_raw(release).await?;
        let forget = self.postgres(
            "DELETE FROM nodes n WHERE n.heartbeat_at <= now() - $1 * interval '1 millisecond' \
                 AND NOT EXISTS (SELECT 1 FROM conversations c WHERE c.lease_owner = n.incarnation)",
            [node.ttl_ms()],
        )?;
        self.db.execute_raw(forget).await?;
        Ok(())
    }

    /// How many conversations `node` holds.
    pub async fn owned_count(&self, node: Node<'_>) -> Result<u64> {
        let statement = self.postgres(
            "SELECT count(*) AS n FROM conversations WHERE lease_owner = $1",
            [Value::from(node.incarnation)],
        )?;
        let row = self.db.query_one_raw(statement).await?;
        let n: i64 = match row {
            Some(row) => row.try_get("", "n")?,
            None => 0,
        };
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// A connection that hears other nodes' commits (`NOTIFY bedrock_frames`; each
    /// notification is `<conversation id> <its last event id>`). It reconnects by itself
    /// when its connection is lost, and says so (`try_recv` gives `None`): notifications
    /// sent meanwhile are lost, and the listener's owner reads what it missed.
    pub async fn frames_listener(&self) -> Result<sea_orm::sqlx::postgres::PgListener> {
        self.require_postgres()?;
        let unavailable = |e: sea_orm::sqlx::Error| StoreError::Unavailable(e.to_string());
        let mut listener = sea_orm::sqlx::postgres::PgListener::connect_with(
            self.db.get_postgres_connection_pool(),
        )
        .await
        .map_err(unavailable)?;
        listener
            .listen_all([FRAMES_CHANNEL, WATCH_CHANNEL])
            .await
            .map_err(unavailable)?;
        Ok(listener)
    }

    /// The last event id of each of the conversations `ids` (those that exist), in one
    /// statement.
    pub async fn last_event_ids(&self, ids: &[&str]) -> Result<Vec<(String, i64)>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids = serde_json::to_string(ids)
            .map_err(|e| StoreError::Other(format!("ids do not serialise: {e}")))?;
        let statement = self.postgres(
            "SELECT id, next_event_id - 1 AS last FROM conversations \
             WHERE id IN (SELECT json_array_elements_text($1::json))",
            [Value::from(ids)],
        )?;
        let rows = self.db.query_all_raw(statement).await?;
        rows.iter()
            .map(|row| Ok((row.try_get("", "id")?, row.try_get("", "last")?)))
            .collect()
    }

    /// A node leaving: it lets go of its conversations at rest (the next node to need one
    /// takes it at once) and marks itself dead, so others take over at once whatever it
    /// could not finish.
    pub async fn leave(&self, node: Node<'_>) -> Result<()> {
        let release = self.postgres(
            &format!(
                "UPDATE conversations c SET lease_owner = NULL \
                 WHERE c.lease_owner = $1 AND NOT {WORK}"
            ),
            [Value::from(node.incarnation)],
        )?;
        self.db.execute_raw(release).await?;
        let retire = self.postgres(
            "UPDATE nodes SET heartbeat_at = '-infinity' WHERE incarnation = $1",
            [Value::from(node.incarnation)],
        )?;
        self.db.execute_raw(retire).await?;
        Ok(())
    }
}
