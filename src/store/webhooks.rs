//! Tenants' webhook endpoints, the outbox of their events and the deliveries made of it
//! (issue 39; migration 17). Reads are open; writes are called by the persistence actor.
//!
//! An event's outbox row is written with the change that caused it (the group commit, a
//! request's row). The fan-out turns outbox rows into one delivery per subscribed endpoint
//! and removes them, in one transaction; on Postgres one node at a time (a transaction
//! advisory lock), so a conversation's deliveries keep the order of its events. A delivery
//! is claimed by one node until `claimed_until` (a claim of a dead node runs out), and a
//! conversation's next delivery to an endpoint is claimed only once the ones before it are
//! done.

use sea_orm::{ConnectionTrait, DbBackend, FromQueryResult, TransactionTrait, Value};
use secrecy::ExposeSecret as _;

use super::{Result, Store};
use crate::model::{NewDelivery, Webhook, WebhookDelivery};

/// The transaction advisory lock of the fan-out on Postgres.
const FAN_OUT_LOCK: i64 = 0x6265_6472_6f63_6b39; // "bedrock9"

/// Attempts whose results one statement writes (8 values each).
const FINISH_BATCH: usize = 64;

/// The attempts a delivery keeps in its log.
pub const ATTEMPTS_KEPT: usize = 10;

/// What a dispatcher writes of its attempts: their results, and the deliveries handed to
/// it that it gives back to the claim (unclaimed) behind a failed one of their pair.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WebhookResults {
    pub attempts: Vec<Attempt>,
    pub released: Vec<String>,
}

impl WebhookResults {
    pub fn is_empty(&self) -> bool {
        self.attempts.is_empty() && self.released.is_empty()
    }

    pub fn len(&self) -> usize {
        self.attempts.len() + self.released.len()
    }

    pub fn append(&mut self, other: WebhookResults) {
        self.attempts.extend(other.attempts);
        self.released.extend(other.released);
    }
}

/// What an endpoint's owner may change.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WebhookChange {
    pub url: Option<String>,
    pub events: Option<Vec<String>>,
    pub description: Option<Option<String>>,
    /// `Some(true)` enables it again (and forgets its failures), `Some(false)` disables it.
    pub enabled: Option<bool>,
}

/// One attempt's result, as the dispatcher saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Attempt {
    pub delivery_id: String,
    pub webhook_id: String,
    pub tenant_id: String,
    /// The claim it was made under: a claim that ran out (and was taken) writes nothing.
    pub claimed_by: String,
    /// The delivery's log of attempts when it was sent: this one is added to it.
    pub log_before: String,
    pub at: i64,
    /// The HTTP status, if the endpoint answered.
    pub status: Option<u16>,
    pub error: Option<String>,
    pub latency_ms: i64,
    /// The first bytes of the answer's body.
    pub excerpt: Option<String>,
    /// Delivered (a 2xx).
    pub succeeded: bool,
    /// When to try again; `None`: no more (expired).
    pub retry_at: Option<i64>,
    /// The endpoint has failed since this long ago: disable it (`Some(reason)`).
    pub disable: Option<String>,
}

#[derive(Debug, FromQueryResult)]
struct WebhookRow {
    id: String,
    tenant_id: String,
    url: String,
    events: String,
    description: Option<String>,
    enabled: bool,
    disabled_reason: Option<String>,
    secret: String,
    previous_secret: Option<String>,
    previous_secret_until: Option<i64>,
    failing_since: Option<i64>,
    created_at: i64,
    updated_at: i64,
}

impl From<WebhookRow> for Webhook {
    fn from(row: WebhookRow) -> Webhook {
        Webhook {
            events: serde_json::from_str(&row.events).unwrap_or_default(),
            id: row.id,
            tenant_id: row.tenant_id,
            url: row.url,
            description: row.description,
            enabled: row.enabled,
            disabled_reason: row.disabled_reason,
            secret: row.secret.into(),
            previous_secret: row.previous_secret.map(Into::into),
            previous_secret_until: row.previous_secret_until,
            failing_since: row.failing_since,
            created_at: row.created_at,
            updated_at: row.updated_at,
        }
    }
}

#[derive(Debug, FromQueryResult)]
struct DeliveryRow {
    id: String,
    webhook_id: String,
    tenant_id: String,
    conversation_id: String,
    event_seq: i64,
    event_type: String,
    payload: String,
    status: String,
    attempts: i32,
    next_attempt_at: i64,
    expires_at: i64,
    last_status: Option<i32>,
    last_error: Option<String>,
    last_latency_ms: Option<i64>,
    attempts_log: String,
    created_at: i64,
    updated_at: i64,
}

impl From<DeliveryRow> for WebhookDelivery {
    fn from(row: DeliveryRow) -> WebhookDelivery {
        WebhookDelivery {
            id: row.id,
            webhook_id: row.webhook_id,
            tenant_id: row.tenant_id,
            conversation_id: row.conversation_id,
            event_seq: row.event_seq,
            event_type: row.event_type,
            payload: row.payload,
            status: row.status,
            attempts: u32::try_from(row.attempts).unwrap_or(0),
            next_attempt_at: row.next_attempt_at,
            expires_at: row.expires_at,
            last_status: row.last_status.and_then(|s| u16::try_from(s).ok()),
            last_error: row.last_error,
            last_latency_ms: row.last_latency_ms,
            attempts_log: row.attempts_log,
            created_at: row.created_at,
            updated_at: row.updated_at,
        }
    }
}

const WEBHOOK_COLUMNS: &str = "id, tenant_id, url, events, description, enabled, disabled_reason, \
     secret, previous_secret, previous_secret_until, failing_since, created_at, updated_at";

const DELIVERY_COLUMNS: &str = "id, webhook_id, tenant_id, conversation_id, event_seq, event_type, \
     payload, status, attempts, next_attempt_at, expires_at, last_status, last_error, \
     last_latency_ms, attempts_log, created_at, updated_at";

#[derive(Debug, FromQueryResult)]
struct OutboxRow {
    seq: i64,
    tenant_id: String,
    conversation_id: String,
    event_type: String,
    payload: String,
}

impl Store {
    /// The tenant's endpoints, oldest first.
    pub async fn webhooks(&self, tenant_id: &str) -> Result<Vec<Webhook>> {
        let sql = format!(
            "SELECT {WEBHOOK_COLUMNS} FROM webhooks WHERE tenant_id = $1 ORDER BY created_at, id"
        );
        Ok(
            WebhookRow::find_by_statement(self.statement(&sql, vec![tenant_id.into()]))
                .all(&self.db)
                .await?
                .into_iter()
                .map(Webhook::from)
                .collect(),
        )
    }

    /// One endpoint of the tenant.
    pub async fn webhook(&self, tenant_id: &str, id: &str) -> Result<Option<Webhook>> {
        let sql =
            format!("SELECT {WEBHOOK_COLUMNS} FROM webhooks WHERE tenant_id = $1 AND id = $2");
        Ok(
            WebhookRow::find_by_statement(self.statement(&sql, vec![tenant_id.into(), id.into()]))
                .one(&self.db)
                .await?
                .map(Webhook::from),
        )
    }

    /// How many endpoints the tenant has.
    pub async fn webhook_count(&self, tenant_id: &str) -> Result<u64> {
        self.count_of(
            "SELECT COUNT(*) AS n FROM webhooks WHERE tenant_id = $1",
            vec![tenant_id.into()],
        )
        .await
    }

    /// Every enabled endpoint (a node keeps them in memory: a commit reads them with no I/O).
    pub async fn enabled_webhooks(&self) -> Result<Vec<Webhook>> {
        let sql = format!("SELECT {WEBHOOK_COLUMNS} FROM webhooks WHERE enabled = $1");
        Ok(
            WebhookRow::find_by_statement(self.statement(&sql, vec![true.into()]))
                .all(&self.db)
                .await?
                .into_iter()
                .map(Webhook::from)
                .collect(),
        )
    }

    /// The (endpoint, conversation) pairs with a delivery not done (but those claimed by
    /// `except`, which its holder knows of): a new event of one waits its turn behind it.
    pub async fn pending_pairs(&self, except: &str) -> Result<Vec<(String, String)>> {
        #[derive(FromQueryResult)]
        struct PairRow {
            webhook_id: String,
            conversation_id: String,
        }
        Ok(PairRow::find_by_statement(self.statement(
            "SELECT DISTINCT webhook_id, conversation_id FROM webhook_deliveries \
             WHERE status = 'pending' AND (claimed_by IS NULL OR claimed_by <> $1)",
            vec![except.into()],
        ))
        .all(&self.db)
        .await?
        .into_iter()
        .map(|row| (row.webhook_id, row.conversation_id))
        .collect())
    }

    /// An endpoint's deliveries, newest first: up to `limit` created before `before` (a
    /// delivery id, the page's cursor).
    pub async fn webhook_deliveries(
        &self,
        tenant_id: &str,
        webhook_id: &str,
        status: Option<&str>,
        before: Option<&str>,
        limit: u64,
    ) -> Result<Vec<WebhookDelivery>> {
        let mut values: Vec<Value> = vec![tenant_id.into(), webhook_id.into()];
        values.extend(status.map(Value::from));
        values.extend(before.map(Value::from));
        values.push(i64::try_from(limit).unwrap_or(i64::MAX).into());
        let sql = listing_sql(status.is_some(), before.is_some());
        Ok(DeliveryRow::find_by_statement(self.statement(&sql, values))
            .all(&self.db)
            .await?
            .into_iter()
            .map(WebhookDelivery::from)
            .collect())
    }

    /// One delivery of the tenant's endpoint.
    pub async fn webhook_delivery(
        &self,
        tenant_id: &str,
        webhook_id: &str,
        id: &str,
    ) -> Result<Option<WebhookDelivery>> {
        let sql = format!(
            "SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries \
             WHERE tenant_id = $1 AND webhook_id = $2 AND id = $3"
        );
        Ok(DeliveryRow::find_by_statement(
            self.statement(&sql, vec![tenant_id.into(), webhook_id.into(), id.into()]),
        )
        .one(&self.db)
        .await?
        .map(WebhookDelivery::from))
    }

    /// The deliveries claimed by `claimed_by` (a node's claim token) but those in `except`,
    /// with their endpoints, on `db` (the cycle's own transaction: the writing connection's
    /// pages are in its cache, a reading one's are read again after every commit).
    async fn claimed_on(
        &self,
        db: &impl ConnectionTrait,
        claimed_by: &str,
        except: &[&str],
    ) -> Result<Vec<(WebhookDelivery, Webhook)>> {
        let mut values: Vec<Value> = vec![claimed_by.into()];
        let not_in = if except.is_empty() {
            String::new()
        } else {
            let mut ids: Vec<Value> = except.iter().map(|id| Value::from(*id)).collect();
            let marks = padded_marks(&mut ids, 2);
            values.extend(ids);
            format!(" AND id NOT IN ({marks})")
        };
        let sql = format!(
            "SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries WHERE claimed_by = $1 AND status = 'pending'{not_in} \
             ORDER BY conversation_id, event_seq"
        );
        let deliveries: Vec<WebhookDelivery> =
            DeliveryRow::find_by_statement(self.statement(&sql, values))
                .all(db)
                .await?
                .into_iter()
                .map(WebhookDelivery::from)
                .collect();
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        // Their endpoints by id (never a search of the deliveries: those done stay for
        // `keep_for`, and a search of them all grew with every event delivered).
        let mut ids: Vec<&str> = deliveries.iter().map(|d| d.webhook_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut values: Vec<Value> = ids.iter().map(|id| Value::from(*id)).collect();
        let marks = padded_marks(&mut values, 1);
        let sql = format!("SELECT {WEBHOOK_COLUMNS} FROM webhooks WHERE id IN ({marks})");
        let hooks: Vec<Webhook> = WebhookRow::find_by_statement(self.statement(&sql, values))
            .all(db)
            .await?
            .into_iter()
            .map(Webhook::from)
            .collect();
        Ok(deliveries
            .into_iter()
            .filter_map(|delivery| {
                let hook = hooks.iter().find(|h| h.id == delivery.webhook_id)?.clone();
                Some((delivery, hook))
            })
            .collect())
    }

    /// How many outbox rows wait for the fan-out, and deliveries for an attempt.
    pub async fn webhook_backlog(&self) -> Result<(u64, u64)> {
        let outbox = self
            .count_of("SELECT COUNT(*) AS n FROM webhook_outbox", Vec::new())
            .await?;
        let pending = self
            .count_of(
                "SELECT COUNT(*) AS n FROM webhook_deliveries WHERE status = 'pending'",
                Vec::new(),
            )
            .await?;
        Ok((outbox, pending))
    }

    pub(crate) async fn insert_webhook(&self, hook: &Webhook) -> Result<()> {
        let sql = format!(
            "INSERT INTO webhooks ({WEBHOOK_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
        );
        self.writer()
            .execute_raw(self.statement(
                &sql,
                vec![
                    hook.id.clone().into(),
                    hook.tenant_id.clone().into(),
                    hook.url.clone().into(),
                    serde_json::to_string(&hook.events).unwrap_or_default().into(),
                    hook.description.clone().into(),
                    hook.enabled.into(),
                    hook.disabled_reason.clone().into(),
                    hook.secret.expose_secret().into(),
                    hook.previous_secret
                        .as_ref()
                        .map(|s| s.expose_secret().to_owned())
                        .into(),
                    hook.previous_secret_until.into(),
                    hook.failing_since.into(),
                    hook.created_at.into(),
                    hook.updated_at.into(),
                ],
            ))
            .await?;
        Ok(())
    }

    /// Changes the tenant's endpoint; whether it was there. Enabling forgets its failures.
    pub(crate) async fn update_webhook(
        &self,
        tenant_id: &str,
        id: &str,
        change: &WebhookChange,
        at: i64,
    ) -> Result<bool> {
        let mut sets = vec!["updated_at = $1".to_owned()];
        let mut values: Vec<Value> = vec![at.into()];
        let mut set = |column: &str, value: Value, values: &mut Vec<Value>| {
            values.push(value);
            sets.push(format!("{column} = ${}", values.len()));
        };
        if let Some(url) = &change.url {
            set("url", url.clone().into(), &mut values);
        }
        if let Some(events) = &change.events {
            let text = serde_json::to_string(events).unwrap_or_default();
            set("events", text.into(), &mut values);
        }
        if let Some(description) = &change.description {
            set("description", description.clone().into(), &mut values);
        }
        if let Some(enabled) = change.enabled {
            set("enabled", enabled.into(), &mut values);
            if enabled {
                sets.push("disabled_reason = NULL".to_owned());
                sets.push("failing_since = NULL".to_owned());
            } else {
                set(
                    "disabled_reason",
                    "disabled by its owner".into(),
                    &mut values,
                );
            }
        }
        values.push(tenant_id.into());
        values.push(id.into());
        let sql = format!(
            "UPDATE webhooks SET {} WHERE tenant_id = ${} AND id = ${}",
            sets.join(", "),
            values.len() - 1,
            values.len()
        );
        let done = self
            .writer()
            .execute_raw(self.statement(&sql, values))
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// A new signing secret; the old one signs beside it until `previous_until`.
    pub(crate) async fn rotate_webhook_secret(
        &self,
        tenant_id: &str,
        id: &str,
        secret: &secrecy::SecretString,
        previous_until: i64,
        at: i64,
    ) -> Result<bool> {
        let done = self
            .writer()
            .execute_raw(self.statement(
                "UPDATE webhooks SET previous_secret = secret, previous_secret_until = $1, \
                 secret = $2, updated_at = $3 WHERE tenant_id = $4 AND id = $5",
                vec![
                    previous_until.into(),
                    secret.expose_secret().into(),
                    at.into(),
                    tenant_id.into(),
                    id.into(),
                ],
            ))
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Removes the tenant's endpoint and its deliveries; whether it was there.
    pub(crate) async fn delete_webhook(&self, tenant_id: &str, id: &str) -> Result<bool> {
        let txn = self.writer().begin().await?;
        txn.execute_raw(self.statement(
            "DELETE FROM webhook_deliveries WHERE tenant_id = $1 AND webhook_id = $2",
            vec![tenant_id.into(), id.into()],
        ))
        .await?;
        let done = txn
            .execute_raw(self.statement(
                "DELETE FROM webhooks WHERE tenant_id = $1 AND id = $2",
                vec![tenant_id.into(), id.into()],
            ))
            .await?;
        txn.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    /// Turns up to `limit` outbox rows into deliveries, one per enabled endpoint of the
    /// row's tenant subscribed to its event, and removes them: one transaction. Each
    /// delivery is retried until `retry_for_ms` after `now`. Returns the rows taken (0 on
    /// Postgres when another node is at it).
    async fn fan_out_on(
        &self,
        txn: &sea_orm::DatabaseTransaction,
        now: i64,
        retry_for_ms: i64,
        limit: u64,
    ) -> Result<u64> {
        if self.backend() == DbBackend::Postgres {
            let locked = txn
                .query_one_raw(self.statement(
                    "SELECT pg_try_advisory_xact_lock($1) AS locked",
                    vec![FAN_OUT_LOCK.into()],
                ))
                .await?
                .map(|row| row.try_get::<bool>("", "locked"))
                .transpose()?
                .unwrap_or(false);
            if !locked {
                return Ok(0);
            }
        }
        let rows = OutboxRow::find_by_statement(self.statement(
            "SELECT seq, tenant_id, conversation_id, event_type, payload FROM webhook_outbox \
             ORDER BY seq LIMIT $1",
            vec![i64::try_from(limit).unwrap_or(i64::MAX).into()],
        ))
        .all(txn)
        .await?;
        let Some(last) = rows.last().map(|row| row.seq) else {
            return Ok(0);
        };
        let mut tenants: Vec<&str> = rows.iter().map(|row| row.tenant_id.as_str()).collect();
        tenants.sort_unstable();
        tenants.dedup();
        let mut values: Vec<Value> = vec![true.into()];
        let mut named: Vec<Value> = tenants.iter().map(|t| (*t).into()).collect();
        let marks = padded_marks(&mut named, 2);
        values.extend(named);
        let sql = format!(
            "SELECT {WEBHOOK_COLUMNS} FROM webhooks WHERE enabled = $1 AND tenant_id IN ({marks})"
        );
        let hooks: Vec<Webhook> = WebhookRow::find_by_statement(self.statement(&sql, values))
            .all(txn)
            .await?
            .into_iter()
            .map(Webhook::from)
            .collect();
        let mut inserts: Vec<Value> = Vec::new();
        for row in &rows {
            for hook in hooks.iter().filter(|h| {
                h.tenant_id == row.tenant_id && h.events.iter().any(|e| e == &row.event_type)
            }) {
                inserts.extend([
                    format!("msg_{}", uuid::Uuid::now_v7().simple()).into(),
                    hook.id.clone().into(),
                    row.tenant_id.clone().into(),
                    row.conversation_id.clone().into(),
                    row.seq.into(),
                    row.event_type.clone().into(),
                    row.payload.clone().into(),
                    now.into(),
                    now.saturating_add(retry_for_ms).into(),
                    now.into(),
                    now.into(),
                ]);
            }
        }
        // At most 64 rows a statement (11 values each, under SQLite's 999 of old).
        for chunk in inserts.chunks(11 * 64) {
            let sql = format!(
                "INSERT INTO webhook_deliveries (id, webhook_id, tenant_id, conversation_id, event_seq, \
                 event_type, payload, next_attempt_at, expires_at, created_at, updated_at, status, \
                 attempts, attempts_log) VALUES {}",
                tuples(chunk.len() / 11, 11, ", 'pending', 0, '[]'")
            );
            txn.execute_raw(self.statement(&sql, chunk.to_vec()))
                .await?;
        }
        txn.execute_raw(self.statement(
            "DELETE FROM webhook_outbox WHERE seq <= $1",
            vec![last.into()],
        ))
        .await?;
        Ok(u64::try_from(rows.len()).unwrap_or(u64::MAX))
    }

    /// Claims up to `limit` due deliveries for `claimed_by` until `until`: each one whose
    /// endpoint is enabled, not claimed (or whose claim ran out), and the first undone one
    /// of its conversation for its endpoint. Returns how many it claimed.
    async fn claim_on(
        &self,
        db: &impl ConnectionTrait,
        claimed_by: &str,
        now: i64,
        until: i64,
        limit: u64,
    ) -> Result<u64> {
        let sql = claim_sql(self.backend() == DbBackend::Postgres);
        let done = db
            .execute_raw(self.statement(
                &sql,
                vec![
                    claimed_by.into(),
                    until.into(),
                    now.into(),
                    now.into(),
                    true.into(),
                    i64::try_from(limit).unwrap_or(i64::MAX).into(),
                ],
            ))
            .await?;
        Ok(done.rows_affected())
    }

    /// One cycle of a node's dispatcher in one transaction (one log sync): the outbox an
    /// earlier release left fanned out (with `fan_out_limit`; on Postgres unless another
    /// node is at it), up to `claim_limit` due deliveries claimed, and (when it claimed some,
    /// deliveries are in flight (`except`) or its claims hold some it did not send
    /// (`held`)) the deliveries its claims hold but those in flight, with their endpoints.
    /// Returns how many it claimed and those.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn webhook_cycle(
        &self,
        now: i64,
        retry_for_ms: i64,
        fan_out_limit: u64,
        claimed_by: &str,
        until: i64,
        claim_limit: u64,
        except: &[&str],
        held: bool,
    ) -> Result<(u64, Vec<(WebhookDelivery, Webhook)>)> {
        let txn = self.writer().begin().await?;
        if fan_out_limit > 0 {
            self.fan_out_on(&txn, now, retry_for_ms, fan_out_limit)
                .await?;
        }
        let claimed = if claim_limit > 0 {
            self.claim_on(&txn, claimed_by, now, until, claim_limit)
                .await?
        } else {
            0
        };
        let mine = if claimed > 0 || held || !except.is_empty() {
            self.claimed_on(&txn, claimed_by, except).await?
        } else {
            Vec::new()
        };
        txn.commit().await?;
        Ok((claimed, mine))
    }

    /// Writes the results of a cycle's attempts in a transaction of their own (Postgres;
    /// SQLite's go with a batch of commits, [`finish_statements`]).
    pub(crate) async fn finish_webhook_attempts(&self, results: &WebhookResults) -> Result<()> {
        if results.is_empty() {
            return Ok(());
        }
        let txn = self.writer().begin().await?;
        for (sql, values) in finish_statements(results, true) {
            txn.execute_raw(self.statement(&sql, values)).await?;
        }
        txn.commit().await?;
        Ok(())
    }

    /// Removes up to `limit` finished deliveries last changed before `before`; how many.
    pub(crate) async fn prune_webhook_deliveries(&self, before: i64, limit: u64) -> Result<u64> {
        let done = self
            .writer()
            .execute_raw(self.statement(
                "DELETE FROM webhook_deliveries WHERE id IN (SELECT id FROM webhook_deliveries \
                 WHERE status <> 'pending' AND updated_at < $1 LIMIT $2)",
                vec![
                    before.into(),
                    i64::try_from(limit).unwrap_or(i64::MAX).into(),
                ],
            ))
            .await?;
        Ok(done.rows_affected())
    }

    /// Sends a delivery again (whatever its status): due now, retried for `retry_for_ms`
    /// more. Whether it was there.
    pub(crate) async fn retry_webhook_delivery(
        &self,
        tenant_id: &str,
        webhook_id: &str,
        id: &str,
        now: i64,
        retry_for_ms: i64,
    ) -> Result<bool> {
        let done = self
            .writer()
            .execute_raw(self.statement(
                "UPDATE webhook_deliveries SET status = 'pending', next_attempt_at = $1, \
                 expires_at = $2, claimed_by = NULL, claimed_until = NULL, updated_at = $3 \
                 WHERE tenant_id = $4 AND webhook_id = $5 AND id = $6",
                vec![
                    now.into(),
                    now.saturating_add(retry_for_ms).into(),
                    now.into(),
                    tenant_id.into(),
                    webhook_id.into(),
                    id.into(),
                ],
            ))
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// The statements that write attempts' results, each under its claim (a claim taken by
/// another node writes nothing): delivered, to be retried, or failed for good; each
/// endpoint's failures (and, past the setting, its disabling with the reason, failing its
/// pending deliveries). A few statements for all of them, not a few an attempt: the rows
/// changed by one `UPDATE ... FROM (VALUES ...)` per 64, each attempt's log made from the one
/// its delivery was sent with (nothing is read, so they can go with a batch of commits). An
/// attempt tells of its endpoint's health whoever's claim it was made under. Marks numbered
/// (`$1`, for [`Store::statement`]) or not (`?`, for a batch of statements).
pub(super) fn finish_statements(
    results: &WebhookResults,
    numbered: bool,
) -> Vec<(String, Vec<Value>)> {
    let attempts = &results.attempts;
    let mut statements: Vec<(String, Vec<Value>)> = Vec::new();
    let push = |statements: &mut Vec<(String, Vec<Value>)>, sql: String, values: Vec<Value>| {
        let sql = if numbered { sql } else { unnumbered(&sql) };
        statements.push((sql, values));
    };
    // Handed deliveries given back to the claim: under their direct claim still (one that
    // ran out and was taken is not changed).
    for chunk in results.released.chunks(FINISH_BATCH) {
        let mut values: Vec<Value> = chunk.iter().map(|id| id.clone().into()).collect();
        let marks = padded_marks(&mut values, 1);
        push(
            &mut statements,
            format!(
                "UPDATE webhook_deliveries SET claimed_by = NULL, claimed_until = NULL \
                 WHERE status = 'pending' AND claimed_by LIKE '%/direct' AND id IN ({marks})"
            ),
            values,
        );
    }
    let mut held: Vec<(&Attempt, String)> = Vec::with_capacity(attempts.len());
    for attempt in attempts {
        // One attempt of a delivery a cycle (those in flight are not claimed again).
        if held
            .iter()
            .any(|(a, _)| a.delivery_id == attempt.delivery_id)
        {
            continue;
        }
        held.push((attempt, attempts_log_with(&attempt.log_before, attempt)));
    }
    for chunk in held.chunks(FINISH_BATCH) {
        // The last row repeated up to a power of two, as `padded_marks` does (the same
        // row changed the same way once).
        let rows = chunk.len().next_power_of_two();
        let mut values: Vec<Value> = Vec::with_capacity(rows * 9);
        let last = chunk.len() - 1;
        for (attempt, log) in (0..rows).map(|r| &chunk[r.min(last)]) {
            let status = if attempt.succeeded {
                "succeeded"
            } else if attempt.retry_at.is_some() {
                "pending"
            } else {
                "failed"
            };
            values.extend([
                attempt.delivery_id.clone().into(),
                status.into(),
                attempt.retry_at.unwrap_or(attempt.at).into(),
                attempt.status.map(i32::from).into(),
                attempt.error.clone().into(),
                attempt.latency_ms.into(),
                log.clone().into(),
                attempt.at.into(),
                attempt.claimed_by.clone().into(),
            ]);
        }
        statements.push((results_sql(rows, numbered).into_owned(), values));
    }
    // Each endpoint as its latest attempt left it: failing since the first failure after
    // its last success (that of this cycle, if it had one, replaces the stored one), or
    // not failing.
    let mut latest: Vec<(&str, Option<i64>, bool)> = Vec::new();
    let mut ordered: Vec<&Attempt> = held.iter().map(|(a, _)| *a).collect();
    ordered.sort_by_key(|a| a.at);
    for attempt in ordered {
        let failing = (!attempt.succeeded).then_some(attempt.at);
        match latest
            .iter_mut()
            .find(|(id, _, _)| *id == attempt.webhook_id)
        {
            Some((_, since, recovered)) => {
                *since = failing.and(since.or(failing));
                *recovered |= attempt.succeeded;
            }
            None => latest.push((attempt.webhook_id.as_str(), failing, attempt.succeeded)),
        }
    }
    let mut recovered: Vec<Value> = latest
        .iter()
        .filter(|(_, since, _)| since.is_none())
        .map(|(id, _, _)| (*id).into())
        .collect();
    if !recovered.is_empty() {
        let marks = padded_marks(&mut recovered, 1);
        let sql = format!(
            "UPDATE webhooks SET failing_since = NULL \
             WHERE failing_since IS NOT NULL AND id IN ({marks})"
        );
        push(&mut statements, sql, recovered);
    }
    for (id, since, recovered) in &latest {
        let Some(since) = since else { continue };
        let sql = if *recovered {
            "UPDATE webhooks SET failing_since = $1 WHERE id = $2"
        } else {
            "UPDATE webhooks SET failing_since = $1 WHERE id = $2 AND failing_since IS NULL"
        };
        push(
            &mut statements,
            sql.to_owned(),
            vec![(*since).into(), (*id).into()],
        );
    }
    for (attempt, _) in &held {
        let Some(reason) = &attempt.disable else {
            continue;
        };
        push(
            &mut statements,
            "UPDATE webhooks SET enabled = $1, disabled_reason = $2, updated_at = $3 WHERE id = $4"
                .to_owned(),
            vec![
                false.into(),
                reason.clone().into(),
                attempt.at.into(),
                attempt.webhook_id.clone().into(),
            ],
        );
        push(
            &mut statements,
            "UPDATE webhook_deliveries SET status = 'failed', claimed_by = NULL, \
             claimed_until = NULL, last_error = $1, updated_at = $2 \
             WHERE webhook_id = $3 AND status = 'pending'"
                .to_owned(),
            vec![
                "the endpoint was disabled".into(),
                attempt.at.into(),
                attempt.webhook_id.clone().into(),
            ],
        );
    }
    statements
}

/// The statement that writes `rows` attempts' results (a power of two up to
/// [`FINISH_BATCH`]), marks numbered or not: made once per shape, as the batch's other
/// texts repeat (making it each time, `?` marks and all, was a tenth of a delivery's cost).
/// VALUES' columns are column1..column9 on both databases. A row whose claim ran out (and
/// was taken by another node) is not changed. SQLite's (unnumbered) form is `OR FAIL`, as
/// [`insert_deliveries_sql`] says.
fn results_sql(rows: usize, numbered: bool) -> std::borrow::Cow<'static, str> {
    const SHAPES: usize = FINISH_BATCH.trailing_zeros() as usize + 1;
    static TEXTS: [[std::sync::OnceLock<String>; SHAPES]; 2] =
        [const { [const { std::sync::OnceLock::new() }; SHAPES] }; 2];
    let shape = rows.next_power_of_two().trailing_zeros() as usize;
    let make = || {
        let sql = format!(
            "UPDATE{} webhook_deliveries SET status = v.column2, attempts = attempts + 1, \
             next_attempt_at = v.column3, claimed_by = NULL, claimed_until = NULL, \
             last_status = v.column4, last_error = v.column5, last_latency_ms = v.column6, \
             attempts_log = v.column7, updated_at = v.column8 \
             FROM (VALUES {}) AS v WHERE webhook_deliveries.id = v.column1 \
             AND webhook_deliveries.claimed_by = v.column9 AND webhook_deliveries.status = 'pending'",
            if numbered { "" } else { " OR FAIL" },
            tuples(1 << shape, 9, "")
        );
        if numbered { sql } else { unnumbered(&sql) }
    };
    match TEXTS[usize::from(numbered)].get(shape) {
        Some(text) => text.get_or_init(make).as_str().into(),
        // Not met: chunks are at most FINISH_BATCH rows.
        None => make().into(),
    }
}

/// The claim of due deliveries (see [`Store::claim_on`]): `$1` the claimer, `$2` until when,
/// `$3` and `$4` now, `$5` true, `$6` the most to claim. It searches the pending deliveries
/// by when they are due, and each one's endpoint and elders by key.
fn claim_sql(postgres: bool) -> String {
    let skip_locked = if postgres {
        " FOR UPDATE SKIP LOCKED"
    } else {
        ""
    };
    format!(
        "UPDATE webhook_deliveries SET claimed_by = $1, claimed_until = $2 WHERE id IN (\
           SELECT d.id FROM webhook_deliveries d \
           WHERE d.status = 'pending' AND d.next_attempt_at <= $3 \
             AND (d.claimed_until IS NULL OR d.claimed_until < $4) \
             AND NOT EXISTS (SELECT 1 FROM webhook_deliveries e \
               WHERE e.status = 'pending' AND e.webhook_id = d.webhook_id \
                 AND e.conversation_id = d.conversation_id AND e.event_seq < d.event_seq) \
             AND EXISTS (SELECT 1 FROM webhooks w WHERE w.id = d.webhook_id AND w.enabled = $5) \
           ORDER BY d.next_attempt_at LIMIT $6{skip_locked})"
    )
}

/// The statement of a page of an endpoint's deliveries, newest first: `$1` the tenant, `$2`
/// the endpoint, then the status and the cursor where asked for, then the limit. It reads
/// the page's rows of the `(webhook_id, id)` index and stops (ids are UUIDv7s: the order
/// the deliveries were made in), never sorting all the endpoint's deliveries.
fn listing_sql(status: bool, before: bool) -> String {
    let mut sql = format!(
        "SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries WHERE tenant_id = $1 AND webhook_id = $2"
    );
    let mut mark = 2;
    if status {
        mark += 1;
        sql.push_str(&format!(" AND status = ${mark}"));
    }
    if before {
        mark += 1;
        sql.push_str(&format!(" AND id < ${mark}"));
    }
    sql.push_str(&format!(" ORDER BY id DESC LIMIT ${}", mark + 1));
    sql
}

/// `sql` with its marks `$1`, `$2`, ... made `?` (they come in order).
fn unnumbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
            out.push('?');
        } else {
            out.push(c);
        }
    }
    out
}

/// Writes new deliveries (an event's, in the transaction of the change that caused it).
pub(super) async fn insert_deliveries(
    store: &Store,
    db: &impl ConnectionTrait,
    deliveries: &[NewDelivery],
) -> Result<()> {
    if deliveries.is_empty() {
        return Ok(());
    }
    let rows: Vec<&NewDelivery> = deliveries.iter().collect();
    db.execute_raw(store.statement(
        &insert_deliveries_sql(rows.len(), true),
        delivery_values(&rows),
    ))
    .await?;
    Ok(())
}

/// The values of a row of [`insert_deliveries_sql`] per delivery.
pub(super) const DELIVERY_VALUES: usize = 11;

/// The statement that writes `rows` new deliveries, marks numbered (`$1`, for
/// [`Store::statement`]) or not (`?`, for a batch of statements). A row is written only
/// while its endpoint is there and enabled: an endpoint deleted or disabled on another node
/// since this one read the endpoints gets nothing (and takes no commit down with it).
pub(super) fn insert_deliveries_sql(rows: usize, numbered: bool) -> String {
    let tuples = if numbered {
        tuples(rows, DELIVERY_VALUES, "")
    } else {
        vec![format!("({})", ["?"; DELIVERY_VALUES].join(", ")); rows].join(", ")
    };
    let enabled = if numbered {
        format!("${}", rows * DELIVERY_VALUES + 1)
    } else {
        "?".to_owned()
    };
    // The unnumbered form is SQLite's (a batch's statements): `OR FAIL` spares the statement
    // its journal; a failure still fails the batch, which rolls back whole.
    let or_fail = if numbered { "" } else { " OR FAIL" };
    format!(
        "INSERT{or_fail} INTO webhook_deliveries (id, webhook_id, tenant_id, conversation_id, event_seq, \
         event_type, payload, next_attempt_at, expires_at, created_at, updated_at, claimed_by, \
         claimed_until, status, attempts, attempts_log) \
         SELECT v.column1, v.column2, v.column3, v.column4, v.column5, v.column6, v.column7, \
         v.column8, v.column9, v.column8, v.column8, v.column10, v.column11, 'pending', 0, '[]' \
         FROM (VALUES {tuples}) AS v \
         WHERE EXISTS (SELECT 1 FROM webhooks w WHERE w.id = v.column2 AND w.enabled = {enabled})"
    )
}

/// The values of `rows` for [`insert_deliveries_sql`], then its last (`true`).
pub(super) fn delivery_values(rows: &[&NewDelivery]) -> Vec<Value> {
    let mut values: Vec<Value> = Vec::with_capacity(rows.len() * DELIVERY_VALUES + 1);
    for row in rows {
        let (claimed_by, claimed_until) = match &row.claimed {
            Some((by, until)) => (Some(by.clone()), Some(*until)),
            None => (None, None),
        };
        values.extend([
            Value::from(row.id.as_str()),
            Value::from(row.webhook_id.as_str()),
            Value::from(row.tenant_id.as_str()),
            Value::from(row.conversation_id.as_str()),
            Value::from(row.event_seq),
            Value::from(row.event_type),
            Value::from(row.payload.as_str()),
            Value::from(row.created_at),
            Value::from(row.expires_at),
            Value::String(claimed_by),
            Value::BigInt(claimed_until),
        ]);
    }
    values.push(true.into());
    values
}

/// Writes outbox rows as an earlier release did (the fan-out still takes them).
#[cfg(test)]
pub(super) async fn insert_outbox(
    store: &Store,
    db: &impl ConnectionTrait,
    events: &[crate::model::WebhookEvent],
) -> Result<()> {
    for event in events {
        db.execute_raw(store.statement(
            "INSERT INTO webhook_outbox (tenant_id, conversation_id, event_type, payload, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
            vec![
                event.tenant_id.clone().into(),
                event.conversation_id.clone().into(),
                event.event_type.into(),
                event.payload.clone().into(),
                event.at.timestamp_millis().into(),
            ],
        ))
        .await?;
    }
    Ok(())
}

/// `rows` tuples of `width` marks each, numbered on from `$1`, each ending with `tail`:
/// `($1, $2, 'x'), ($3, $4, 'x')`.
fn tuples(rows: usize, width: usize, tail: &str) -> String {
    (0..rows)
        .map(|r| {
            let marks: Vec<String> = (1..=width).map(|c| format!("${}", r * width + c)).collect();
            format!("({}{tail})", marks.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The marks `$first, $first + 1, ...` of an `IN` list of `values`, padded first (its last
/// value repeated) to a power of two: the list takes a few lengths only, so the database
/// prepares each statement once and uses it again (a new length is a new statement, parsed
/// and planned). `values` must not be empty.
fn padded_marks(values: &mut Vec<Value>, first: usize) -> String {
    let n = values.len().next_power_of_two();
    if let Some(last) = values.last().cloned() {
        values.resize(n, last);
    }
    (first..first + values.len())
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `log` (a delivery's attempts as JSON) with `attempt` added, keeping the last
/// [`ATTEMPTS_KEPT`].
fn attempts_log_with(log: &str, attempt: &Attempt) -> String {
    let mut entries: Vec<serde_json::Value> = serde_json::from_str(log).unwrap_or_default();
    let mut entry = serde_json::json!({"at": attempt.at, "latency_ms": attempt.latency_ms});
    if let Some(status) = attempt.status {
        entry["status"] = status.into();
    }
    if let Some(error) = &attempt.error {
        entry["error"] = error.clone().into();
    }
    if let Some(excerpt) = &attempt.excerpt {
        entry["excerpt"] = excerpt.clone().into();
    }
    entries.push(entry);
    let drop = entries.len().saturating_sub(ATTEMPTS_KEPT);
    entries.drain(..drop);
    serde_json::Value::Array(entries).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{at, drop_postgres, postgres_store, sqlite_store};

    fn results_of(attempts: &[Attempt]) -> WebhookResults {
        WebhookResults {
            attempts: attempts.to_vec(),
            released: Vec::new(),
        }
    }

    fn attempt(delivery: &str, claimed_by: &str, at: i64, succeeded: bool) -> Attempt {
        Attempt {
            delivery_id: delivery.to_owned(),
            webhook_id: "wh_1".into(),
            tenant_id: "t".into(),
            claimed_by: claimed_by.to_owned(),
            log_before: "[]".into(),
            at,
            status: Some(if succeeded { 200 } else { 500 }),
            error: None,
            latency_ms: 3,
            excerpt: Some("ok".into()),
            succeeded,
            retry_at: (!succeeded).then_some(at + 1_000),
            disable: None,
        }
    }

    /// A cycle's results are written together, each under its own claim: a success, a
    /// failure to retry and a result whose claim another node took (its row not changed);
    /// the endpoint is failing since the failure that followed its success in the cycle,
    /// and answers again after a later success. The same statements, unnumbered, go with a
    /// batch of commits on SQLite.
    async fn results_are_written_under_their_claims(store: &Store) {
        let hook = Webhook {
            id: "wh_1".into(),
            tenant_id: "t".into(),
            url: "http://127.0.0.1:9/".into(),
            events: vec!["turn.completed".into()],
            description: None,
            enabled: true,
            disabled_reason: None,
            secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned().into(),
            previous_secret: None,
            previous_secret_until: None,
            failing_since: Some(1),
            created_at: 1,
            updated_at: 1,
        };
        store.insert_webhook(&hook).await.expect("an endpoint");
        let events: Vec<crate::model::WebhookEvent> = ["c1", "c2", "c3"]
            .iter()
            .map(|c| crate::model::WebhookEvent {
                tenant_id: "t".into(),
                conversation_id: (*c).to_owned(),
                event_type: "turn.completed",
                payload: "{}".into(),
                at: at(),
            })
            .collect();
        insert_outbox(store, store.writer(), &events)
            .await
            .expect("the outbox");
        let now = 10;
        let (claimed, mut mine) = store
            .webhook_cycle(now, 60_000, 256, "n1", now + 30_000, 10, &[], false)
            .await
            .expect("a cycle");
        assert_eq!(claimed, 3);
        assert_eq!(mine.len(), 3, "the claimed deliveries come with the cycle");
        let again = store
            .claimed_on(&store.db, "n1", &[])
            .await
            .expect("claimed");
        assert_eq!(again.len(), 3);
        mine.sort_by(|a, b| a.0.conversation_id.cmp(&b.0.conversation_id));
        let ids: Vec<String> = mine.iter().map(|(d, _)| d.id.clone()).collect();
        let finished = [
            attempt(&ids[0], "n1", 100, true),
            attempt(&ids[1], "n1", 200, false),
            // Another node's claim: its row is not changed, but its failure still tells of
            // the endpoint (whoever's claim it was made under).
            attempt(&ids[2], "n2", 300, false),
        ];
        store
            .finish_webhook_attempts(&results_of(&finished))
            .await
            .expect("results");
        let (claimed, held) = store
            .webhook_cycle(400, 60_000, 256, "n1", 400, 0, &[], true)
            .await
            .expect("a cycle");
        // A delivery its claim holds but was not sent (`held`) is handed out again though
        // the cycle claims nothing and nothing is in flight (the third: its result was
        // another node's claim's, so n1's claim still holds it).
        assert_eq!(claimed, 0);
        assert_eq!(
            held.iter().map(|(d, _)| d.id.clone()).collect::<Vec<_>>(),
            vec![ids[2].clone()]
        );
        let (_, none) = store
            .webhook_cycle(400, 60_000, 256, "n1", 400, 0, &[], false)
            .await
            .expect("a cycle");
        assert!(
            none.is_empty(),
            "nothing claimed, in flight or held: not read"
        );
        let read = |id: String| async move {
            store
                .webhook_delivery("t", "wh_1", &id)
                .await
                .expect("reads")
                .expect("there")
        };
        let first = read(ids[0].clone()).await;
        assert_eq!((first.status.as_str(), first.attempts), ("succeeded", 1));
        assert_eq!(first.last_status, Some(200));
        let log: serde_json::Value = serde_json::from_str(&first.attempts_log).expect("JSON");
        assert_eq!(log[0]["status"], 200);
        assert_eq!(log[0]["excerpt"], "ok");
        let second = read(ids[1].clone()).await;
        assert_eq!((second.status.as_str(), second.attempts), ("pending", 1));
        assert_eq!(second.next_attempt_at, 1_200);
        let third = read(ids[2].clone()).await;
        assert_eq!((third.status.as_str(), third.attempts), ("pending", 0));
        let hook = store
            .webhook("t", "wh_1")
            .await
            .expect("reads")
            .expect("there");
        assert_eq!(hook.failing_since, Some(200));

        // The retry succeeds: the endpoint answers again, and the delivery's log has both.
        let retry = store
            .webhook_cycle(
                1_300,
                60_000,
                256,
                "n1",
                40_000,
                10,
                &[ids[2].as_str()],
                false,
            )
            .await
            .expect("a cycle");
        // The retry is claimed again; the one in flight (`except`) is not handed out.
        assert_eq!(
            (
                retry.0,
                retry
                    .1
                    .iter()
                    .map(|(d, _)| d.id.clone())
                    .collect::<Vec<_>>()
            ),
            (1, vec![ids[1].clone()])
        );
        // The retry's attempt adds to the log it was sent with.
        let retried = Attempt {
            log_before: retry.1[0].0.attempts_log.clone(),
            ..attempt(&ids[1], "n1", 1_400, true)
        };
        store
            .finish_webhook_attempts(&results_of(&[retried]))
            .await
            .expect("results");
        let second = read(ids[1].clone()).await;
        assert_eq!((second.status.as_str(), second.attempts), ("succeeded", 2));
        let log: serde_json::Value = serde_json::from_str(&second.attempts_log).expect("JSON");
        assert_eq!(log.as_array().map(Vec::len), Some(2));
        let hook = store
            .webhook("t", "wh_1")
            .await
            .expect("reads")
            .expect("there");
        assert_eq!(hook.failing_since, None);
    }

    /// `IN` lists take the lengths 1, 2, 4, 8, ... only, padded with their last value.
    #[test]
    fn in_lists_are_padded_to_a_power_of_two() {
        let mut values: Vec<Value> = vec!["a".into(), "b".into(), "c".into()];
        assert_eq!(padded_marks(&mut values, 2), "$2, $3, $4, $5");
        assert_eq!(
            values,
            vec![Value::from("a"), "b".into(), "c".into(), "c".into()]
        );
        let mut one: Vec<Value> = vec![1i64.into()];
        assert_eq!(padded_marks(&mut one, 1), "$1");
        let mut four: Vec<Value> = (0..4i64).map(Value::from).collect();
        assert_eq!(padded_marks(&mut four, 1), "$1, $2, $3, $4");
        assert_eq!(four.len(), 4);
        assert_eq!(tuples(2, 2, ", 'x'"), "($1, $2, 'x'), ($3, $4, 'x')");
        assert_eq!(tuples(1, 3, ""), "($1, $2, $3)");
        assert_eq!(
            unnumbered("SET a = $1 WHERE b IN ($2, $13) AND c = '$x'"),
            "SET a = ? WHERE b IN (?, ?) AND c = '$x'"
        );
        // The statements of a batch take their marks in order, each with a value.
        let statements = finish_statements(
            &WebhookResults {
                attempts: vec![Attempt {
                    disable: Some("down".into()),
                    ..attempt("d1", "n1", 5, false)
                }],
                released: vec!["d2".into(), "d3".into()],
            },
            false,
        );
        for (sql, values) in &statements {
            assert!(!sql.contains('$'), "{sql}");
            assert_eq!(sql.matches('?').count(), values.len(), "{sql}");
        }
        assert_eq!(
            statements.len(),
            5,
            "released, results, failing, disabled, its deliveries failed"
        );
        // The results' texts, made once per shape, have a mark per value of their rows.
        for rows in [1, 2, 4, 8, 16, 32, 64] {
            assert_eq!(results_sql(rows, false).matches('?').count(), rows * 9);
            let numbered = results_sql(rows, true);
            assert!(numbered.contains(&format!("${},", rows * 9 - 1)), "{rows}");
            assert!(!numbered.contains(&format!("${}", rows * 9 + 1)), "{rows}");
            assert_eq!(results_sql(rows, true), numbered, "the same text again");
        }
    }

    /// SQLite's plan of `sql`, a line per step.
    async fn plan(store: &Store, sql: &str) -> Vec<String> {
        store
            .writer()
            .query_all_raw(sea_orm::Statement::from_string(
                DbBackend::Sqlite,
                format!("EXPLAIN QUERY PLAN {sql}"),
            ))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .iter()
            .map(|row| row.try_get::<String>("", "detail").expect("a step"))
            .collect()
    }

    /// A hostile tenant's thousand endpoints, or one endpoint's day of deliveries, cost no
    /// one else anything: the webhook statements that run with every batch of commits, in
    /// the dispatcher's cycles and for the API find their rows by key. None reads every
    /// endpoint or every delivery of the node (a delivery's insert read all enabled
    /// endpoints into a list for its `IN`), and a page of an endpoint's deliveries is not
    /// sorted from all of them. Pending deliveries are read through their partial indexes
    /// (only those not done are in them).
    #[tokio::test]
    async fn webhook_statements_find_their_rows_by_key() {
        let (store, dir) = sqlite_store("webhook-plans", &[]).await;
        let mut statements = vec![
            insert_deliveries_sql(1, false),
            insert_deliveries_sql(4, false),
            insert_deliveries_sql(2, true),
            claim_sql(false),
            listing_sql(false, false),
            listing_sql(true, true),
        ];
        let results = WebhookResults {
            attempts: vec![
                Attempt {
                    disable: Some("down".into()),
                    ..attempt("d1", "n1", 5, false)
                },
                attempt("d2", "n1", 6, true),
            ],
            released: vec!["d3".into()],
        };
        statements.extend(
            finish_statements(&results, false)
                .into_iter()
                .map(|(sql, _)| sql),
        );
        // One attempt's result: a text of its own.
        let one = WebhookResults {
            attempts: vec![attempt("d4", "n2", 7, true)],
            released: Vec::new(),
        };
        statements.extend(
            finish_statements(&one, false)
                .into_iter()
                .map(|(sql, _)| sql),
        );
        for sql in &statements {
            let steps = plan(&store, sql).await;
            for step in &steps {
                let whole_table = ["webhooks", "webhook_deliveries", "w", "d", "e"]
                    .iter()
                    .any(|table| step == &format!("SCAN {table}"));
                let unbounded = step.starts_with("SCAN ")
                    && step.contains("webhook")
                    && !step.contains("webhook_deliveries_due")
                    && !step.contains("webhook_deliveries_order");
                assert!(
                    !whole_table && !unbounded && !step.contains("TEMP B-TREE"),
                    "{step} in the plan of {sql}: {steps:#?}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Migration 22: the deliveries stored before it are kept (SQLite makes the table again,
    /// without its foreign key) and listed through the new index, newest first, a page at
    /// a time; deleting the endpoint still deletes its deliveries.
    #[tokio::test]
    async fn deliveries_stored_before_migration_22_are_kept_on_each_database() {
        let (store, dir) = crate::store::testing::sqlite_unmigrated("deliveries-22").await;
        deliveries_kept_through_22(&store).await;
        let _ = std::fs::remove_dir_all(dir);
        if let Some((store, name)) = crate::store::testing::postgres_unmigrated().await {
            deliveries_kept_through_22(&store).await;
            drop_postgres(store, &name).await;
        }
    }

    async fn deliveries_kept_through_22(store: &Store) {
        use migration::{Migrator, MigratorTrait};
        Migrator::up(&store.db, Some(21))
            .await
            .expect("the migrations before");
        store
            .db
            .execute_unprepared(
                "INSERT INTO webhooks (id, tenant_id, url, events, enabled, secret, created_at, \
                 updated_at) VALUES ('wh_1', 't', 'http://127.0.0.1:9/', '[]', true, 's', 1, 1)",
            )
            .await
            .expect("an endpoint");
        for n in 1..=3 {
            store
                .db
                .execute_unprepared(&format!(
                    "INSERT INTO webhook_deliveries (id, webhook_id, tenant_id, conversation_id, \
                     event_seq, event_type, payload, status, attempts, next_attempt_at, \
                     expires_at, attempts_log, created_at, updated_at) VALUES ('msg_{n}', \
                     'wh_1', 't', 'c', {n}, 'turn.completed', '{{}}', 'succeeded', 1, {n}, 9, \
                     '[]', {n}, {n})"
                ))
                .await
                .expect("a delivery");
        }
        Migrator::up(&store.db, None).await.expect("migration 22");
        let ids = |page: Vec<WebhookDelivery>| page.into_iter().map(|d| d.id).collect::<Vec<_>>();
        let first = store
            .webhook_deliveries("t", "wh_1", None, None, 2)
            .await
            .expect("a page");
        assert_eq!(ids(first), ["msg_3", "msg_2"]);
        let next = store
            .webhook_deliveries("t", "wh_1", Some("succeeded"), Some("msg_2"), 2)
            .await
            .expect("the next page");
        assert_eq!(ids(next), ["msg_1"]);
        let other = store
            .webhook_deliveries("u", "wh_1", None, None, 10)
            .await
            .expect("another tenant's page");
        assert!(other.is_empty(), "a tenant lists its own endpoints' only");
        assert!(store.delete_webhook("t", "wh_1").await.expect("deleted"));
        let left = store
            .webhook_deliveries("t", "wh_1", None, None, 10)
            .await
            .expect("a page");
        assert!(left.is_empty(), "the endpoint's deliveries go with it");
    }

    #[tokio::test]
    async fn results_are_written_under_their_claims_on_each_database() {
        let (store, dir) = sqlite_store("webhook-results", &[]).await;
        results_are_written_under_their_claims(&store).await;
        let _ = std::fs::remove_dir_all(dir);
        if let Some((store, name)) = postgres_store(&[]).await {
            results_are_written_under_their_claims(&store).await;
            drop_postgres(store, &name).await;
        }
    }
}
