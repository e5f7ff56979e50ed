//! The replay log (issue 40; migration 19): each commit's steps, on its last row of
//! `conversation_frames` (or, for a commit without frames, a row of `conversation_steps`),
//! written by the group commit (sqlite.rs, postgres.rs). Reads are open: the conversation actor's next step number, a conversation's
//! rows for `bedrock replay` and the trace, the messages they refer to.

use std::collections::HashMap;

use entity::messages;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, FromQueryResult, QueryFilter};

use super::{Result, Store, StoreError, of_conversation};
use crate::replay::{Recalled, StepRow};

#[derive(Debug, FromQueryResult)]
struct Last {
    last: Option<i64>,
}

#[derive(Debug, FromQueryResult)]
struct Row {
    first_step: i64,
    created_at: i64,
    /// Before migration 21; `''` or NULL on a packed row.
    steps: Option<String>,
    packed_steps: Option<Vec<u8>>,
}

#[derive(Debug, FromQueryResult)]
struct Target {
    id: String,
}

#[derive(Debug, FromQueryResult)]
struct Key {
    id: String,
    internal_key: i64,
}

#[derive(Debug, FromQueryResult)]
struct KeyedRow {
    conversation_key: i64,
    first_step: i64,
    created_at: i64,
    steps: Option<String>,
    packed_steps: Option<Vec<u8>>,
}

/// A stored row of steps read: its JSON from the packed column where it has one.
fn parse_row(
    first_step: i64,
    created_at: i64,
    packed: Option<&[u8]>,
    text: Option<String>,
) -> std::result::Result<StepRow, String> {
    let json = super::packed::json_of(packed, text)?;
    StepRow::parse(first_step, created_at, &json)
}

/// What a replay of one conversation reads: its rows of steps and the messages they may
/// refer to, by sequence id.
#[derive(Debug)]
pub struct ReplayInput {
    pub conversation_id: String,
    pub rows: Vec<StepRow>,
    pub messages: HashMap<i64, Recalled>,
    /// Why one of its rows of steps does not read, if one does not.
    pub unreadable: Option<String>,
}

/// The conversations whose steps `bedrock replay --all` re-runs.
#[derive(Clone, Debug, Default)]
pub struct ReplayFilter {
    pub tenant_id: Option<String>,
    /// Only conversations changed since (milliseconds since the Unix epoch).
    pub since: Option<i64>,
}

impl Store {
    /// The number a conversation's next step gets: one after its last stored step.
    pub async fn next_step(&self, conversation_id: &str) -> Result<i64> {
        // The latest step is on the conversation's latest row of frames that has steps, or
        // on a row of steps of its own (a commit without frames).
        let sql = "SELECT MAX(last) AS last FROM (\
             SELECT (SELECT f.last_step FROM conversation_frames f \
                WHERE f.conversation_key = k.internal_key AND f.last_step IS NOT NULL \
                ORDER BY f.last_event_id DESC LIMIT 1) AS last \
               FROM conversations k WHERE k.id = $1 \
             UNION ALL \
             SELECT MAX(s.last_step) AS last FROM conversation_steps s \
               WHERE s.conversation_key = (SELECT internal_key FROM conversations WHERE id = $1)\
             ) AS both_tables";
        let last = Last::find_by_statement(self.statement(sql, vec![conversation_id.into()]))
            .one(&self.db)
            .await?
            .and_then(|row| row.last);
        Ok(last.unwrap_or(0) + 1)
    }

    /// A conversation's stored rows of steps, in order, up to the row that holds step
    /// `upto` (the end of a trace's page: nothing after it is read).
    pub async fn steps_of(&self, conversation_id: &str, upto: i64) -> Result<Vec<StepRow>> {
        let sql = "SELECT f.first_step, f.created_at, f.steps, f.packed_steps \
             FROM conversation_frames f \
             WHERE f.conversation_key = (SELECT internal_key FROM conversations WHERE id = $1) \
               AND f.last_step IS NOT NULL AND f.first_step <= $2 \
             UNION ALL \
             SELECT s.first_step, s.created_at, s.steps, s.packed_steps FROM conversation_steps s \
             WHERE s.conversation_key = (SELECT internal_key FROM conversations WHERE id = $1) \
               AND s.first_step <= $2 \
             ORDER BY 1";
        let rows =
            Row::find_by_statement(self.statement(sql, vec![conversation_id.into(), upto.into()]))
                .all(&self.db)
                .await?;
        rows.into_iter()
            .map(|row| {
                parse_row(
                    row.first_step,
                    row.created_at,
                    row.packed_steps.as_deref(),
                    row.steps,
                )
                .map_err(|e| StoreError::Corrupt(format!("steps of {conversation_id}: {e}")))
            })
            .collect()
    }

    /// A conversation's messages with these sequence ids, as the replay log refers to them.
    pub async fn message_contents(
        &self,
        conversation_id: &str,
        seqs: &[i64],
    ) -> Result<HashMap<i64, Recalled>> {
        let mut found = HashMap::with_capacity(seqs.len());
        for chunk in seqs.chunks(500) {
            let rows = messages::Entity::find()
                .filter(of_conversation(
                    messages::Column::ConversationKey,
                    conversation_id,
                ))
                .filter(messages::Column::SequenceId.is_in(chunk.iter().copied()))
                .all(&self.db)
                .await?;
            for row in rows {
                let record = super::history::message(conversation_id, row)?;
                found.insert(
                    record.sequence_id,
                    Recalled {
                        content: record.content,
                        usage: record.usage,
                    },
                );
            }
        }
        Ok(found)
    }

    /// The stored steps of several conversations and the messages they may refer to, in
    /// three queries (their keys, their rows of steps, their messages of the kinds steps refer
    /// to), for `bedrock replay --all`; in the order of `ids`, those that exist.
    pub async fn replay_batch(&self, ids: &[String]) -> Result<Vec<ReplayInput>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let list = |from: usize, n: usize| {
            (from..from + n)
                .map(|i| format!("${i}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let keys: Vec<Key> = Key::find_by_statement(self.statement(
            &format!(
                "SELECT id, internal_key FROM conversations WHERE id IN ({})",
                list(1, ids.len())
            ),
            ids.iter().map(|id| id.as_str().into()).collect(),
        ))
        .all(&self.db)
        .await?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let id_of: HashMap<i64, &str> = keys
            .iter()
            .map(|k| (k.internal_key, k.id.as_str()))
            .collect();
        let key_values =
            || -> Vec<sea_orm::Value> { keys.iter().map(|k| k.internal_key.into()).collect() };
        let n = keys.len();
        let mut values = key_values();
        values.extend(key_values());
        let rows = KeyedRow::find_by_statement(self.statement(
            &format!(
                "SELECT f.conversation_key AS conversation_key, f.first_step, f.created_at, f.steps, \
                 f.packed_steps \
                 FROM conversation_frames f WHERE f.conversation_key IN ({}) AND f.last_step IS NOT NULL \
                 UNION ALL \
                 SELECT s.conversation_key AS conversation_key, s.first_step, s.created_at, s.steps, \
                 s.packed_steps \
                 FROM conversation_steps s WHERE s.conversation_key IN ({}) \
                 ORDER BY 1, 2",
                list(1, n),
                list(n + 1, n)
            ),
            values,
        ))
        .all(&self.db)
        .await?;
        let mut steps: HashMap<i64, Vec<StepRow>> = HashMap::with_capacity(n);
        // A row that does not read is that conversation's to report, not the whole run's.
        let mut unreadable: HashMap<i64, String> = HashMap::new();
        for row in rows {
            match parse_row(
                row.first_step,
                row.created_at,
                row.packed_steps.as_deref(),
                row.steps,
            ) {
                Ok(parsed) => steps.entry(row.conversation_key).or_default().push(parsed),
                Err(e) => {
                    unreadable
                        .entry(row.conversation_key)
                        .or_insert_with(|| format!("the row from step {}: {e}", row.first_step));
                }
            }
        }
        let mut messages: HashMap<i64, HashMap<i64, Recalled>> = HashMap::with_capacity(n);
        let rows = messages::Entity::find()
            .filter(messages::Column::ConversationKey.is_in(keys.iter().map(|k| k.internal_key)))
            .filter(messages::Column::MessageType.is_in(["user", "agent", "tool"]))
            .all(&self.db)
            .await?;
        for row in rows {
            let key = row.conversation_key;
            let record = super::history::message(id_of.get(&key).copied().unwrap_or("?"), row)?;
            messages.entry(key).or_default().insert(
                record.sequence_id,
                Recalled {
                    content: record.content,
                    usage: record.usage,
                },
            );
        }
        let by_id: HashMap<&str, i64> = keys
            .iter()
            .map(|k| (k.id.as_str(), k.internal_key))
            .collect();
        Ok(ids
            .iter()
            .filter_map(|id| {
                let key = *by_id.get(id.as_str())?;
                Some(ReplayInput {
                    conversation_id: id.clone(),
                    rows: steps.remove(&key).unwrap_or_default(),
                    messages: messages.remove(&key).unwrap_or_default(),
                    unreadable: unreadable.remove(&key),
                })
            })
            .collect())
    }

    /// The conversations with stored steps that `filter` picks, oldest first.
    pub async fn replay_targets(&self, filter: &ReplayFilter) -> Result<Vec<String>> {
        let mut sql = String::from(
            "SELECT c.id FROM conversations c WHERE (EXISTS \
             (SELECT 1 FROM conversation_frames f \
              WHERE f.conversation_key = c.internal_key AND f.last_step IS NOT NULL) \
             OR EXISTS (SELECT 1 FROM conversation_steps s WHERE s.conversation_key = c.internal_key))",
        );
        let mut values: Vec<sea_orm::Value> = Vec::new();
        if let Some(tenant) = &filter.tenant_id {
            values.push(tenant.as_str().into());
            sql.push_str(&format!(" AND c.tenant_id = ${}", values.len()));
        }
        if let Some(since) = filter.since {
            values.push(since.into());
            sql.push_str(&format!(
                " AND (EXISTS (SELECT 1 FROM conversation_frames f \
                 WHERE f.conversation_key = c.internal_key AND f.last_step IS NOT NULL \
                 AND f.created_at >= ${n}) \
                 OR EXISTS (SELECT 1 FROM conversation_steps s \
                 WHERE s.conversation_key = c.internal_key AND s.created_at >= ${n}))",
                n = values.len()
            ));
        }
        sql.push_str(" ORDER BY c.internal_key");
        Ok(Target::find_by_statement(self.statement(&sql, values))
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| row.id)
            .collect())
    }

    /// Removes up to `limit` rows of steps stored before `before` (milliseconds since the Unix
    /// epoch), oldest first; how many it removed. Under the frames' retention window.
    pub(crate) async fn prune_steps(&self, before: i64, limit: u64) -> Result<u64> {
        let sql = "DELETE FROM conversation_steps WHERE (conversation_key, last_step) IN \
             (SELECT conversation_key, last_step FROM conversation_steps \
              WHERE created_at < $1 ORDER BY created_at LIMIT $2)";
        let result = self
            .writer()
            .execute_raw(self.statement(
                sql,
                vec![
                    sea_orm::Value::from(before),
                    sea_orm::Value::from(i64::try_from(limit).unwrap_or(i64::MAX)),
                ],
            ))
            .await?;
        Ok(result.rows_affected())
    }
}
