//! The replay log (issue 40; migration 19): each commit's steps, one row of
//! `conversation_steps` per commit that has any, written by the group commit (sqlite.rs,
//! postgres.rs). Reads are open: the conversation actor's next step number, a conversation's
//! rows for `bedrock replay` and the trace, the messages they refer to.

use std::collections::HashMap;

use entity::messages;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, FromQueryResult, QueryFilter, Statement,
};

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
    steps: String,
}

#[derive(Debug, FromQueryResult)]
struct Target {
    id: String,
}

/// The conversations whose steps `bedrock replay --all` re-runs.
#[derive(Clone, Debug, Default)]
pub struct ReplayFilter {
    pub tenant_id: Option<String>,
    /// Only conversations changed since (milliseconds since the Unix epoch).
    pub since: Option<i64>,
}

impl Store {
    fn sql(&self, text: &str) -> String {
        if self.backend() == DbBackend::Sqlite {
            let mut out = text.to_owned();
            for n in (1..=9).rev() {
                out = out.replace(&format!("${n}"), "?");
            }
            out
        } else {
            text.to_owned()
        }
    }

    /// The number a conversation's next step gets: one after its last stored step.
    pub async fn next_step(&self, conversation_id: &str) -> Result<i64> {
        let sql = self.sql(
            "SELECT MAX(s.last_step) AS last FROM conversation_steps s \
             WHERE s.conversation_key = (SELECT internal_key FROM conversations WHERE id = $1)",
        );
        let last = Last::find_by_statement(Statement::from_sql_and_values(
            self.backend(),
            sql,
            [conversation_id.into()],
        ))
        .one(&self.db)
        .await?
        .and_then(|row| row.last);
        Ok(last.unwrap_or(0) + 1)
    }

    /// A conversation's stored rows of steps, in order.
    pub async fn steps_of(&self, conversation_id: &str) -> Result<Vec<StepRow>> {
        let sql = self.sql(
            "SELECT s.first_step, s.created_at, s.steps FROM conversation_steps s \
             WHERE s.conversation_key = (SELECT internal_key FROM conversations WHERE id = $1) \
             ORDER BY s.last_step",
        );
        let rows = Row::find_by_statement(Statement::from_sql_and_values(
            self.backend(),
            sql,
            [conversation_id.into()],
        ))
        .all(&self.db)
        .await?;
        rows.into_iter()
            .map(|row| {
                StepRow::parse(row.first_step, row.created_at, &row.steps)
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

    /// The conversations with stored steps that `filter` picks, oldest first.
    pub async fn replay_targets(&self, filter: &ReplayFilter) -> Result<Vec<String>> {
        let mut sql = String::from(
            "SELECT c.id FROM conversations c WHERE EXISTS \
             (SELECT 1 FROM conversation_steps s WHERE s.conversation_key = c.internal_key)",
        );
        let mut values: Vec<sea_orm::Value> = Vec::new();
        if let Some(tenant) = &filter.tenant_id {
            values.push(tenant.as_str().into());
            sql.push_str(&format!(" AND c.tenant_id = ${}", values.len()));
        }
        if let Some(since) = filter.since {
            values.push(since.into());
            sql.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM conversation_steps s \
                 WHERE s.conversation_key = c.internal_key AND s.created_at >= ${})",
                values.len()
            ));
        }
        sql.push_str(" ORDER BY c.internal_key");
        let sql = self.sql(&sql);
        Ok(
            Target::find_by_statement(Statement::from_sql_and_values(self.backend(), sql, values))
                .all(&self.db)
                .await?
                .into_iter()
                .map(|row| row.id)
                .collect(),
        )
    }

    /// Removes up to `limit` rows of steps stored before `before` (milliseconds since the Unix
    /// epoch), oldest first; how many it removed. Under the frames' retention window.
    pub(crate) async fn prune_steps(&self, before: i64, limit: u64) -> Result<u64> {
        let sql = self.sql(
            "DELETE FROM conversation_steps WHERE (conversation_key, last_step) IN \
             (SELECT conversation_key, last_step FROM conversation_steps \
              WHERE created_at < $1 ORDER BY created_at LIMIT $2)",
        );
        let result = self
            .writer()
            .execute_raw(Statement::from_sql_and_values(
                self.backend(),
                sql,
                [
                    sea_orm::Value::from(before),
                    sea_orm::Value::from(i64::try_from(limit).unwrap_or(i64::MAX)),
                ],
            ))
            .await?;
        Ok(result.rows_affected())
    }
}
