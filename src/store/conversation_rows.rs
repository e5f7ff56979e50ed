//! Conversations: their rows, created, seeded, forked, archived and deleted.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use entity::{attachment_shares, attachments, conversations, messages};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    TransactionTrait,
};

use super::codec;
use super::{INTERNAL_KEY, Result, Store, StoreError, of_conversation};
use crate::model::{AgentRef, ConversationRecord, ForkPoint, NewConversation, Page, UsageTotals};
use crate::state_machine::ConvState;

impl Store {
    /// A tenant's conversation by id or slug.
    pub async fn conversation(
        &self,
        tenant_id: &str,
        id_or_slug: &str,
    ) -> Result<Option<ConversationRecord>> {
        let row = conversations::Entity::find()
            .filter(conversations::Column::TenantId.eq(tenant_id))
            .filter(
                conversations::Column::Id
                    .eq(id_or_slug)
                    .or(conversations::Column::Slug.eq(id_or_slug)),
            )
            .order_by_asc(conversations::Column::Id)
            .one(&self.db)
            .await?;
        row.map(conversation).transpose()
    }

    /// A conversation by id, whatever its tenant (for the runtime).
    pub async fn conversation_by_id(&self, id: &str) -> Result<Option<ConversationRecord>> {
        conversations::Entity::find_by_id(id.to_owned())
            .one(&self.db)
            .await?
            .map(conversation)
            .transpose()
    }

    /// A tenant's user-initiated conversations, newest first.
    pub async fn list_conversations(
        &self,
        tenant_id: &str,
        archived: bool,
        limit: u64,
        cursor: Option<&str>,
    ) -> Result<Page<ConversationRecord>> {
        let mut query = conversations::Entity::find()
            .filter(conversations::Column::TenantId.eq(tenant_id))
            .filter(conversations::Column::UserInitiated.eq(true))
            .filter(conversations::Column::Archived.eq(archived));
        if let Some(cursor) = cursor {
            query = query.filter(conversations::Column::Id.lt(cursor));
        }
        let rows = query
            .order_by_desc(conversations::Column::Id)
            .limit(limit + 1)
            .all(&self.db)
            .await?;
        let more = rows.len() as u64 > limit;
        let items = rows
            .into_iter()
            .take(limit as usize)
            .map(conversation)
            .collect::<Result<Vec<_>>>()?;
        let next_cursor = more.then(|| items.last().map(|c| c.id.clone())).flatten();
        Ok(Page { items, next_cursor })
    }

    /// The sub-agents of a conversation, oldest first.
    pub async fn children(&self, parent_id: &str) -> Result<Vec<ConversationRecord>> {
        conversations::Entity::find()
            .filter(conversations::Column::ParentConversationId.eq(parent_id))
            .order_by_asc(conversations::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(conversation)
            .collect()
    }

    /// Conversations whose state is not at rest: what restart recovery looks at.
    pub async fn busy_conversations(&self) -> Result<Vec<ConversationRecord>> {
        conversations::Entity::find()
            .filter(conversations::Column::State.is_not_in([
                "idle",
                "error",
                "completed",
                "context_exhausted",
            ]))
            .all(&self.db)
            .await?
            .into_iter()
            .map(conversation)
            .collect()
    }

    pub(crate) async fn insert_conversation(&self, new: &NewConversation) -> Result<()> {
        conversations::Entity::insert(conversation_row(new)?)
            .exec(self.writer())
            .await?;
        Ok(())
    }

    pub(crate) async fn set_archived(
        &self,
        id: &str,
        archived: bool,
        at: DateTime<Utc>,
    ) -> Result<()> {
        let result = conversations::Entity::update_many()
            .col_expr(conversations::Column::Archived, Expr::value(archived))
            .col_expr(conversations::Column::UpdatedAt, Expr::value(at))
            .filter(conversations::Column::Id.eq(id))
            .exec(self.writer())
            .await?;
        if result.rows_affected == 0 {
            return Err(StoreError::NotFound);
        }
        Ok(())
    }

    /// Deletes a conversation with its messages, events, attachments, requests, tasks and
    /// sub-agents (foreign keys cascade). An attachment shared with a fork is handed to one
    /// of the conversations it is shared with instead.
    pub(crate) async fn delete_conversation(&self, id: &str) -> Result<()> {
        let txn = self.writer().begin().await?;
        let owned: Vec<String> = attachments::Entity::find()
            .select_only()
            .column(attachments::Column::Id)
            .filter(attachments::Column::ConversationId.eq(id))
            .into_tuple()
            .all(&txn)
            .await?;
        if !owned.is_empty() {
            let shares = attachment_shares::Entity::find()
                .filter(attachment_shares::Column::AttachmentId.is_in(owned))
                .filter(attachment_shares::Column::ConversationId.ne(id))
                .order_by_asc(attachment_shares::Column::ConversationId)
                .all(&txn)
                .await?;
            let mut handed = std::collections::HashSet::new();
            for share in shares {
                if !handed.insert(share.attachment_id.clone()) {
                    continue;
                }
                attachments::Entity::update_many()
                    .col_expr(
                        attachments::Column::ConversationId,
                        Expr::value(share.conversation_id.clone()),
                    )
                    .filter(attachments::Column::Id.eq(share.attachment_id.clone()))
                    .exec(&txn)
                    .await?;
                attachment_shares::Entity::delete_by_id((
                    share.attachment_id,
                    share.conversation_id,
                ))
                .exec(&txn)
                .await?;
            }
        }
        let result = conversations::Entity::delete_by_id(id.to_owned())
            .exec(&txn)
            .await?;
        if result.rows_affected == 0 {
            return Err(StoreError::NotFound);
        }
        txn.commit().await?;
        Ok(())
    }

    /// Creates `new` as a fork of `from`: its history is a copy of the source's messages
    /// 1..=`from.sequence_id` (with ids of their own and no client keys), and every image
    /// they show is shared with it, not copied. One transaction.
    /// A conversation with its first message, in one transaction: a continuation of `from`
    /// (which must exist) seeded with its summary, or a new one with a notice.
    pub(crate) async fn insert_seeded(
        &self,
        new: &NewConversation,
        from: Option<&str>,
        message_id: &str,
        summary: &crate::state_machine::MessageContent,
    ) -> Result<()> {
        let txn = self.writer().begin().await?;
        if let Some(from) = from
            && conversations::Entity::find_by_id(from.to_owned())
                .one(&txn)
                .await?
                .is_none()
        {
            return Err(StoreError::NotFound);
        }
        let mut row = conversation_row(new)?;
        row.continued_from_id = Set(from.map(str::to_owned));
        row.next_sequence_id = Set(2);
        let key = inserted_key(&txn, row, &new.id).await?;
        messages::Entity::insert(messages::ActiveModel {
            conversation_key: Set(key),
            sequence_id: Set(1),
            id: Set(message_id.to_owned()),
            message_type: Set(summary.message_type().as_str().to_owned()),
            content: Set(codec::content(summary)),
            usage_data: Set(None),
            client_message_id: Set(None),
            created_at: Set(new.created_at),
            event_id: Set(None),
        })
        .exec(&txn)
        .await?;
        txn.commit().await?;
        Ok(())
    }

    pub(crate) async fn insert_fork(
        &self,
        new: &NewConversation,
        from: &ForkPoint,
        message_ids: &[String],
    ) -> Result<()> {
        let txn = self.writer().begin().await?;
        if conversations::Entity::find_by_id(from.conversation_id.clone())
            .one(&txn)
            .await?
            .is_none()
        {
            return Err(StoreError::NotFound);
        }
        let mut row = conversation_row(new)?;
        row.forked_from_id = Set(Some(from.conversation_id.clone()));
        row.forked_from_sequence = Set(Some(from.sequence_id));
        row.next_sequence_id = Set(from.sequence_id + 1);
        let key = inserted_key(&txn, row, &new.id).await?;
        let rows = messages::Entity::find()
            .filter(of_conversation(
                messages::Column::ConversationKey,
                &from.conversation_id,
            ))
            .filter(messages::Column::SequenceId.lte(from.sequence_id))
            .order_by_asc(messages::Column::SequenceId)
            .all(&txn)
            .await?;
        if rows.len() != message_ids.len() {
            return Err(StoreError::Conflict(format!(
                "the source has {} messages up to {}, {} expected",
                rows.len(),
                from.sequence_id,
                message_ids.len()
            )));
        }
        let mut images = Vec::new();
        let copies: Vec<messages::ActiveModel> = rows
            .into_iter()
            .zip(message_ids)
            .map(|(row, id)| {
                if row.message_type == "user"
                    && let Ok(crate::state_machine::MessageContent::User { images: shown, .. }) =
                        codec::parse_content(&row.message_type, &row.content)
                {
                    images.extend(shown.into_iter().map(|image| image.id));
                }
                messages::ActiveModel {
                    conversation_key: Set(key),
                    sequence_id: Set(row.sequence_id),
                    id: Set(id.clone()),
                    message_type: Set(row.message_type),
                    content: Set(row.content),
                    usage_data: Set(row.usage_data),
                    client_message_id: Set(None),
                    created_at: Set(row.created_at),
                    event_id: Set(None),
                }
            })
            .collect();
        // Well under every database's limit of bound values per statement.
        for chunk in copies.chunks(500) {
            messages::Entity::insert_many(chunk.to_vec())
                .exec(&txn)
                .await?;
        }
        images.sort();
        images.dedup();
        let existing: Vec<String> = attachments::Entity::find()
            .select_only()
            .column(attachments::Column::Id)
            .filter(attachments::Column::Id.is_in(images))
            .filter(attachments::Column::TenantId.eq(&new.tenant_id))
            .into_tuple()
            .all(&txn)
            .await?;
        for chunk in existing.chunks(500) {
            attachment_shares::Entity::insert_many(chunk.iter().map(|attachment_id| {
                attachment_shares::ActiveModel {
                    attachment_id: Set(attachment_id.clone()),
                    conversation_id: Set(new.id.clone()),
                }
            }))
            .exec(&txn)
            .await?;
        }
        txn.commit().await?;
        Ok(())
    }
}

/// The row of a new conversation: idle, nothing used, nothing numbered.
/// Inserts a conversation's row in `txn` and reads back the key its messages refer to it by.
async fn inserted_key(
    txn: &sea_orm::DatabaseTransaction,
    row: conversations::ActiveModel,
    id: &str,
) -> Result<i64> {
    conversations::Entity::insert(row).exec(txn).await?;
    let key: Option<i64> = conversations::Entity::find()
        .select_only()
        .column_as(Expr::col(INTERNAL_KEY), "key")
        .filter(conversations::Column::Id.eq(id))
        .into_tuple()
        .one(txn)
        .await?;
    key.ok_or_else(|| StoreError::Other(format!("conversation {id} has no key")))
}

pub(super) fn conversation_row(new: &NewConversation) -> Result<conversations::ActiveModel> {
    let state = serde_json::to_value(ConvState::Idle)
        .map_err(|e| StoreError::Other(format!("state does not serialise: {e}")))?;
    Ok(conversations::ActiveModel {
        id: Set(new.id.clone()),
        tenant_id: Set(new.tenant_id.clone()),
        slug: Set(new.slug.clone()),
        cwd: Set(new.cwd.clone()),
        model: Set(new.model.clone()),
        system_prompt: Set(new.system_prompt.clone()),
        parent_conversation_id: Set(new.parent_id.clone()),
        user_initiated: Set(new.user_initiated),
        require_approval: Set(serde_json::json!(new.require_approval)),
        network: Set(new.network),
        state: Set("idle".into()),
        state_data: Set(state),
        state_updated_at: Set(new.created_at),
        created_at: Set(new.created_at),
        updated_at: Set(new.created_at),
        archived: Set(false),
        input_tokens: Set(0),
        output_tokens: Set(0),
        context_tokens: Set(0),
        next_sequence_id: Set(1),
        next_event_id: Set(1),
        forked_from_id: Set(None),
        forked_from_sequence: Set(None),
        budget_tokens: Set(new
            .budget_tokens
            .map(|b| i64::try_from(b).unwrap_or(i64::MAX))),
        continued_from_id: Set(None),
        mcp_tools: Set((!new.mcp_tools.is_empty())
            .then(|| serde_json::to_string(&new.mcp_tools).unwrap_or_default())),
        agent_name: Set(new.agent.as_ref().map(|agent| agent.name.clone())),
        agent_version: Set(new.agent.as_ref().map(|agent| i64::from(agent.version))),
        tools: Set(new
            .tools
            .as_ref()
            .map(|tools| serde_json::to_string(tools).unwrap_or_default())),
        permissions: Set((!new.permissions.is_empty())
            .then(|| serde_json::to_string(&new.permissions).unwrap_or_default())),
        client_tools: Set((!new.client_tools.is_empty())
            .then(|| serde_json::to_string(&new.client_tools).unwrap_or_default())),
        hooks: Set(new
            .pre_tool_use
            .as_ref()
            .map(|hook| serde_json::to_string(hook).unwrap_or_default())),
        limits: Set((!new.bounds.is_empty())
            .then(|| serde_json::to_string(&new.bounds).unwrap_or_default())),
    })
}

pub(super) fn conversation(row: conversations::Model) -> Result<ConversationRecord> {
    let state: ConvState = serde_json::from_value(row.state_data)
        .map_err(|e| StoreError::Corrupt(format!("conversation {}: state_data: {e}", row.id)))?;
    let require_approval: Vec<String> =
        serde_json::from_value(row.require_approval).map_err(|e| {
            StoreError::Corrupt(format!("conversation {}: require_approval: {e}", row.id))
        })?;
    let tools = match row.tools.as_deref() {
        Some(json) => Some(
            serde_json::from_str(json)
                .map_err(|e| StoreError::Corrupt(format!("conversation {}: tools: {e}", row.id)))?,
        ),
        None => None,
    };
    let permissions = match row.permissions.as_deref() {
        Some(json) => serde_json::from_str(json).map_err(|e| {
            StoreError::Corrupt(format!("conversation {}: permissions: {e}", row.id))
        })?,
        None => Vec::new(),
    };
    let client_tools = match row.client_tools.as_deref() {
        Some(json) => serde_json::from_str(json).map_err(|e| {
            StoreError::Corrupt(format!("conversation {}: client_tools: {e}", row.id))
        })?,
        None => Vec::new(),
    };
    let pre_tool_use = match row.hooks.as_deref() {
        Some(json) => Some(Arc::new(serde_json::from_str(json).map_err(|e| {
            StoreError::Corrupt(format!("conversation {}: hooks: {e}", row.id))
        })?)),
        None => None,
    };
    let bounds = match row.limits.as_deref() {
        Some(json) => serde_json::from_str(json)
            .map_err(|e| StoreError::Corrupt(format!("conversation {}: limits: {e}", row.id)))?,
        None => crate::model::Bounds::default(),
    };
    Ok(ConversationRecord {
        id: row.id,
        tenant_id: row.tenant_id,
        slug: row.slug,
        cwd: row.cwd,
        model: row.model,
        system_prompt: row.system_prompt,
        parent_id: row.parent_conversation_id,
        user_initiated: row.user_initiated,
        require_approval,
        network: row.network,
        state,
        archived: row.archived,
        usage: UsageTotals {
            input_tokens: u64::try_from(row.input_tokens).unwrap_or(0),
            output_tokens: u64::try_from(row.output_tokens).unwrap_or(0),
            context_tokens: u64::try_from(row.context_tokens).unwrap_or(0),
        },
        next_sequence_id: row.next_sequence_id,
        next_event_id: row.next_event_id,
        created_at: row.created_at,
        updated_at: row.updated_at,
        lease: None,
        budget_tokens: row.budget_tokens.and_then(|b| u64::try_from(b).ok()),
        continued_from: row.continued_from_id,
        mcp_tools: Arc::new(
            row.mcp_tools
                .as_deref()
                .and_then(|json| serde_json::from_str(json).ok())
                .unwrap_or_default(),
        ),
        agent: row
            .agent_name
            .zip(row.agent_version.and_then(|v| u32::try_from(v).ok()))
            .map(|(name, version)| AgentRef { name, version }),
        tools,
        permissions,
        client_tools: Arc::new(client_tools),
        pre_tool_use,
        bounds,
        forked_from: row.forked_from_id.zip(row.forked_from_sequence).map(
            |(conversation_id, sequence_id)| ForkPoint {
                conversation_id,
                sequence_id,
            },
        ),
    })
}
