//! A conversation's history: its messages, its durable frames and its attachments.

use entity::{attachment_shares, attachments, conversation_frames, messages};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ActiveValue::Set, ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, PaginatorTrait,
    QueryFilter, QueryOrder, QuerySelect,
};

use super::codec;
use super::{Attachment, NewAttachment, Result, Store, StoreError, StoredRow, of_conversation};
use crate::model::{FrameRow, MessageRecord};

impl Store {
    /// Messages with a sequence id above `after`, ascending, at most `limit`.
    pub async fn messages_after(
        &self,
        conversation_id: &str,
        after: i64,
        limit: u64,
    ) -> Result<Vec<MessageRecord>> {
        messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                conversation_id,
            ))
            .filter(messages::Column::SequenceId.gt(after))
            .order_by_asc(messages::Column::SequenceId)
            .limit(limit)
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| message(conversation_id, row))
            .collect()
    }

    /// The sequence id of the first user message above `after`: when `after` is a turn's
    /// own user message, the message that started the next turn, if one did.
    pub async fn next_user_message(
        &self,
        conversation_id: &str,
        after: i64,
    ) -> Result<Option<i64>> {
        Ok(messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                conversation_id,
            ))
            .filter(messages::Column::SequenceId.gt(after))
            .filter(messages::Column::MessageType.eq("user"))
            .order_by_asc(messages::Column::SequenceId)
            .one(&self.db)
            .await?
            .map(|row| row.sequence_id))
    }

    /// The last `limit` messages, ascending.
    pub async fn recent_messages(
        &self,
        conversation_id: &str,
        limit: u64,
    ) -> Result<Vec<MessageRecord>> {
        let mut rows = messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                conversation_id,
            ))
            .order_by_desc(messages::Column::SequenceId)
            .limit(limit)
            .all(&self.db)
            .await?;
        rows.reverse();
        rows.into_iter()
            .map(|row| message(conversation_id, row))
            .collect()
    }

    /// The whole history, ascending (what the LLM is sent).
    pub async fn history(&self, conversation_id: &str) -> Result<Vec<MessageRecord>> {
        self.messages_after(conversation_id, 0, u64::MAX >> 1).await
    }

    /// The user message stored under a client's idempotency key.
    pub async fn message_by_client_id(
        &self,
        conversation_id: &str,
        client_message_id: &str,
    ) -> Result<Option<MessageRecord>> {
        messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                conversation_id,
            ))
            .filter(messages::Column::ClientMessageId.eq(client_message_id))
            .one(&self.db)
            .await?
            .map(|row| message(conversation_id, row))
            .transpose()
    }

    /// The rows of durable frames with frames after event `after`, ascending, at most
    /// `limit` rows.
    pub async fn frames_after(
        &self,
        conversation_id: &str,
        after: i64,
        limit: u64,
    ) -> Result<Vec<FrameRow>> {
        use conversation_frames::Column;
        // The items come back as the text they were stored as (Postgres keeps them as
        // `json`, which the driver would not read as text).
        conversation_frames::Entity::find()
            .select_only()
            .columns([
                Column::FirstEventId,
                Column::LastEventId,
                Column::PackedFrames,
            ])
            .column_as(
                Expr::col(Column::Frames).cast_as(sea_orm::sea_query::Alias::new("text")),
                "frames",
            )
            .filter(of_conversation(Column::ConversationKey, conversation_id))
            .filter(Column::LastEventId.gt(after))
            .order_by_asc(Column::LastEventId)
            .limit(limit)
            .into_model::<StoredRow>()
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| {
                let frames = super::packed::json_of(row.packed_frames.as_deref(), row.frames)
                    .map_err(|e| {
                        StoreError::Corrupt(format!(
                            "frames of {conversation_id} to {}: {e}",
                            row.last_event_id
                        ))
                    })?;
                Ok(FrameRow {
                    first_event_id: row.first_event_id,
                    last_event_id: row.last_event_id,
                    frames,
                })
            })
            .collect::<Result<_>>()
    }

    /// A conversation's messages with sequence ids `from..=to`, ascending.
    pub async fn messages_between(
        &self,
        conversation_id: &str,
        from: i64,
        to: i64,
    ) -> Result<Vec<MessageRecord>> {
        messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                conversation_id,
            ))
            .filter(messages::Column::SequenceId.between(from, to))
            .order_by_asc(messages::Column::SequenceId)
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| message(conversation_id, row))
            .collect()
    }

    /// A conversation's messages whose frames have event ids `from..=to`, with those ids,
    /// ascending: what stands for frames that are no longer stored.
    pub async fn messages_framed_between(
        &self,
        conversation_id: &str,
        from: i64,
        to: i64,
    ) -> Result<Vec<(i64, MessageRecord)>> {
        let rows = messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                conversation_id,
            ))
            .filter(messages::Column::EventId.between(from, to))
            .order_by_asc(messages::Column::SequenceId)
            .all(&self.db)
            .await?;
        rows.into_iter()
            .map(|row| {
                let event_id = row.event_id.unwrap_or(0);
                message(conversation_id, row).map(|record| (event_id, record))
            })
            .collect()
    }

    /// The event id of a conversation's oldest stored frame (`None` when it has none).
    pub async fn first_stored_event(&self, conversation_id: &str) -> Result<Option<i64>> {
        use conversation_frames::Column;
        #[derive(Debug, sea_orm::FromQueryResult)]
        struct First {
            first_event_id: i64,
        }
        Ok(conversation_frames::Entity::find()
            .select_only()
            .column(Column::FirstEventId)
            .filter(of_conversation(Column::ConversationKey, conversation_id))
            .order_by_asc(Column::LastEventId)
            .limit(1)
            .into_model::<First>()
            .one(&self.db)
            .await?
            .map(|row| row.first_event_id))
    }

    /// Removes up to `limit` rows of frames stored before `before` (milliseconds since the
    /// Unix epoch), oldest first; how many it removed.
    pub(crate) async fn prune_frames(&self, before: i64, limit: u64) -> Result<u64> {
        let sql = "DELETE FROM conversation_frames WHERE (conversation_key, last_event_id) IN \
                   (SELECT conversation_key, last_event_id FROM conversation_frames \
                    WHERE created_at < $1 ORDER BY created_at LIMIT $2)";
        let backend = self.backend();
        let sql = if backend == DbBackend::Sqlite {
            sql.replace("$1", "?").replace("$2", "?")
        } else {
            sql.to_owned()
        };
        let result = self
            .writer()
            .execute_raw(sea_orm::Statement::from_sql_and_values(
                backend,
                sql,
                [
                    sea_orm::Value::from(before),
                    sea_orm::Value::from(i64::try_from(limit).unwrap_or(i64::MAX)),
                ],
            ))
            .await?;
        Ok(result.rows_affected())
    }

    /// An attachment the conversation owns, or one shared with it (a fork's copied images).
    pub async fn attachment(&self, conversation_id: &str, id: &str) -> Result<Option<Attachment>> {
        let Some(row) = attachments::Entity::find_by_id(id.to_owned())
            .one(&self.db)
            .await?
        else {
            return Ok(None);
        };
        if row.conversation_id != conversation_id
            && attachment_shares::Entity::find_by_id((id.to_owned(), conversation_id.to_owned()))
                .one(&self.db)
                .await?
                .is_none()
        {
            return Ok(None);
        }
        Ok(Some(Attachment {
            id: row.id,
            media_type: row.media_type,
            data: row.data,
        }))
    }

    pub async fn count_messages(&self, conversation_id: &str) -> Result<u64> {
        Ok(messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                conversation_id,
            ))
            .count(&self.db)
            .await?)
    }

    // ---- Writes: only the persistence actor calls these ----

    pub(crate) async fn insert_attachments(&self, new: &[NewAttachment]) -> Result<()> {
        if new.is_empty() {
            return Ok(());
        }
        attachments::Entity::insert_many(new.iter().map(|a| attachments::ActiveModel {
            id: Set(a.id.clone()),
            tenant_id: Set(a.tenant_id.clone()),
            conversation_id: Set(a.conversation_id.clone()),
            media_type: Set(a.media_type.clone()),
            data: Set(a.data.clone()),
            width: Set(i32::try_from(a.width).unwrap_or(i32::MAX)),
            height: Set(i32::try_from(a.height).unwrap_or(i32::MAX)),
            created_at: Set(a.created_at),
        }))
        .exec(self.writer())
        .await?;
        Ok(())
    }
}

/// A stored message of the conversation `conversation_id`.
pub(super) fn message(conversation_id: &str, row: messages::Model) -> Result<MessageRecord> {
    let content = codec::parse_content(&row.message_type, &row.content)
        .map_err(|e| StoreError::Corrupt(format!("message {}: {e}", row.id)))?;
    Ok(MessageRecord {
        id: row.id,
        conversation_id: conversation_id.to_owned(),
        sequence_id: row.sequence_id,
        content,
        usage: row.usage_data.as_ref().and_then(codec::parse_usage),
        client_message_id: row.client_message_id,
        created_at: row.created_at,
    })
}
