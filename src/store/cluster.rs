//! Postgres: nodes, their heartbeats, and the leases on conversations (migration m7). A lease
//! is `conversations.owner_node` and `owner_epoch`; it is live while its node's heartbeat is
//! younger than the TTL, so one heartbeat renews every lease of a node. Each statement here
//! decides in the database, in one statement: two nodes racing for a lease cannot both win.

use std::sync::atomic::Ordering;
use std::time::Duration;

use sea_orm::{ConnectionTrait, DbBackend, Statement, Value};

use super::{Result, Store, StoreError};

/// Who holds a conversation's lease, when it is not us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub node: String,
    /// The base URL the owner serves its API on.
    pub advertise: String,
}

/// What taking a lease found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lease {
    /// Ours, with this epoch (the fencing token every commit carries).
    Taken { epoch: i64 },
    /// Held by another live node.
    Elsewhere(Owner),
    /// No such conversation.
    Missing,
}

/// A live heartbeat is younger than this many milliseconds.
fn ttl_ms(ttl: Duration) -> Value {
    Value::from(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX))
}

impl Store {
    fn postgres(&self, sql: &str, values: impl IntoIterator<Item = Value>) -> Result<Statement> {
        if self.backend() != DbBackend::Postgres {
            return Err(StoreError::Other(
                "a cluster needs Postgres; SQLite is one node".into(),
            ));
        }
        Ok(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            values,
        ))
    }

    /// Registers this node (again, after a restart with the same id) with a fresh heartbeat.
    pub async fn register_node(&self, id: &str, advertise: &str) -> Result<()> {
        let statement = self.postgres(
            "INSERT INTO nodes (id, advertise) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET advertise = EXCLUDED.advertise, \
                 started_at = now(), heartbeat_at = now()",
            [Value::from(id), Value::from(advertise)],
        )?;
        self.db.execute_raw(statement).await?;
        Ok(())
    }

    /// Renews every lease of this node and tells how many other nodes are live. A node whose
    /// row is gone (removed by an operator) registers again.
    pub async fn heartbeat(&self, id: &str, advertise: &str, ttl: Duration) -> Result<u64> {
        let statement = self.postgres(
            "WITH beat AS (UPDATE nodes SET heartbeat_at = now() WHERE id = $1 RETURNING id) \
             SELECT (SELECT count(*) FROM beat) AS beat, \
                    (SELECT count(*) FROM nodes WHERE id <> $1 \
                        AND heartbeat_at > now() - $2 * interval '1 millisecond') AS peers",
            [Value::from(id), ttl_ms(ttl)],
        )?;
        let row = self
            .db
            .query_one_raw(statement)
            .await?
            .ok_or_else(|| StoreError::Other("a heartbeat returned no row".into()))?;
        let beat: i64 = row.try_get("", "beat")?;
        let peers: i64 = row.try_get("", "peers")?;
        if beat == 0 {
            self.register_node(id, advertise).await?;
        }
        let peers = u64::try_from(peers).unwrap_or(0);
        // Commits wake the other nodes' streams only while there are other nodes.
        self.peers.store(peers > 0, Ordering::Relaxed);
        Ok(peers)
    }

    /// Whether commits should wake other nodes' streams.
    pub(super) fn has_peers(&self) -> bool {
        self.peers.load(Ordering::Relaxed)
    }

    /// Takes the lease of conversation `id` for node `me` when nobody live holds it (or `me`
    /// does), adding one to its epoch: whoever held it before can no longer write for it.
    pub async fn take_lease(&self, id: &str, me: &str, ttl: Duration) -> Result<Lease> {
        // Released between the two statements: once more.
        for _ in 0..2 {
            match self.try_take_lease(id, me, ttl).await? {
                Some(lease) => return Ok(lease),
                None => continue,
            }
        }
        Ok(Lease::Elsewhere(Owner {
            node: String::new(),
            advertise: String::new(),
        }))
    }

    async fn try_take_lease(&self, id: &str, me: &str, ttl: Duration) -> Result<Option<Lease>> {
        let statement = self.postgres(
            "UPDATE conversations c SET owner_node = $1, owner_epoch = c.owner_epoch + 1 \
             WHERE c.id = $2 AND (c.owner_node IS NULL OR c.owner_node = $1 OR NOT EXISTS ( \
                 SELECT 1 FROM nodes n WHERE n.id = c.owner_node \
                     AND n.heartbeat_at > now() - $3 * interval '1 millisecond')) \
             RETURNING c.owner_epoch",
            [Value::from(me), Value::from(id), ttl_ms(ttl)],
        )?;
        if let Some(row) = self.db.query_one_raw(statement).await? {
            return Ok(Some(Lease::Taken {
                epoch: row.try_get("", "owner_epoch")?,
            }));
        }
        Ok(match self.owner(id).await? {
            None => Some(Lease::Missing),
            Some(Some(owner)) => Some(Lease::Elsewhere(owner)),
            Some(None) => None,
        })
    }

    /// Who holds conversation `id`'s lease: `None` when there is no such conversation,
    /// `Some(None)` when nobody does.
    pub async fn owner(&self, id: &str) -> Result<Option<Option<Owner>>> {
        let statement = self.postgres(
            "SELECT c.owner_node, n.advertise FROM conversations c \
             LEFT JOIN nodes n ON n.id = c.owner_node WHERE c.id = $1",
            [Value::from(id)],
        )?;
        let Some(row) = self.db.query_one_raw(statement).await? else {
            return Ok(None);
        };
        let node: Option<String> = row.try_get("", "owner_node")?;
        let advertise: Option<String> = row.try_get("", "advertise")?;
        Ok(Some(node.map(|node| Owner {
            node,
            advertise: advertise.unwrap_or_default(),
        })))
    }

    /// The live owner of conversation `id` when it is another node than `me`.
    pub async fn live_owner(&self, id: &str, me: &str, ttl: Duration) -> Result<Option<Owner>> {
        let statement = self.postgres(
            "SELECT c.owner_node, n.advertise FROM conversations c \
             JOIN nodes n ON n.id = c.owner_node \
             WHERE c.id = $1 AND c.owner_node <> $2 \
                 AND n.heartbeat_at > now() - $3 * interval '1 millisecond'",
            [Value::from(id), Value::from(me), ttl_ms(ttl)],
        )?;
        let Some(row) = self.db.query_one_raw(statement).await? else {
            return Ok(None);
        };
        Ok(Some(Owner {
            node: row.try_get("", "owner_node")?,
            advertise: row.try_get("", "advertise")?,
        }))
    }

    /// Conversations with work that nobody live is doing: a turn in flight or a background
    /// task running, and no live owner (or `me`, after a restart with the same id). At most
    /// `limit`.
    pub async fn orphaned_conversations(
        &self,
        me: &str,
        ttl: Duration,
        limit: u64,
    ) -> Result<Vec<String>> {
        let statement = self.postgres(
            "SELECT c.id FROM conversations c \
             WHERE (c.state NOT IN ('idle', 'error', 'completed') \
                    OR EXISTS (SELECT 1 FROM background_tasks b \
                               WHERE b.conversation_id = c.id AND b.status = 'running')) \
               AND (c.owner_node IS NULL OR c.owner_node = $1 OR NOT EXISTS ( \
                    SELECT 1 FROM nodes n WHERE n.id = c.owner_node \
                        AND n.heartbeat_at > now() - $2 * interval '1 millisecond')) \
             LIMIT $3",
            [
                Value::from(me),
                ttl_ms(ttl),
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

    /// How many conversations node `me` holds.
    pub async fn owned_count(&self, me: &str) -> Result<u64> {
        let statement = self.postgres(
            "SELECT count(*) AS n FROM conversations WHERE owner_node = $1",
            [Value::from(me)],
        )?;
        let row = self.db.query_one_raw(statement).await?;
        let n: i64 = match row {
            Some(row) => row.try_get("", "n")?,
            None => 0,
        };
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// A node leaving: its leases go (the next node to need a conversation takes it at once,
    /// without waiting for the TTL), then its row.
    pub async fn leave(&self, me: &str) -> Result<()> {
        let release = self.postgres(
            "UPDATE conversations SET owner_node = NULL WHERE owner_node = $1",
            [Value::from(me)],
        )?;
        self.db.execute_raw(release).await?;
        let forget = self.postgres("DELETE FROM nodes WHERE id = $1", [Value::from(me)])?;
        self.db.execute_raw(forget).await?;
        Ok(())
    }
}
