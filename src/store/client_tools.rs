//! Calls of client tools (docs/api.md, "Client tools"): made when the client is asked,
//! resolved once (answered, expired or cancelled) by a conditional update from `pending`. A
//! pending call outlives a restart.

use chrono::{DateTime, Utc};
use entity::client_tool_calls;
use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    TransactionTrait,
};

use super::requests::stored_status;
use super::{Result, Store, StoreError};
use crate::model::{ClientToolCall, RequestStatus};

/// The most calls `client_tool_calls` lists.
const LISTED: u64 = 100;

impl Store {
    /// A conversation's call of a client tool, by its id.
    pub async fn client_tool_call(
        &self,
        conversation_id: &str,
        id: &str,
    ) -> Result<Option<ClientToolCall>> {
        client_tool_calls::Entity::find_by_id(id.to_owned())
            .filter(client_tool_calls::Column::ConversationId.eq(conversation_id))
            .one(&self.db)
            .await?
            .map(call)
            .transpose()
    }

    /// The call made for a tool call of the LLM's (by its key), if the client was asked
    /// already.
    pub async fn client_tool_call_for(
        &self,
        conversation_id: &str,
        key: &str,
    ) -> Result<Option<ClientToolCall>> {
        client_tool_calls::Entity::find()
            .filter(client_tool_calls::Column::ConversationId.eq(conversation_id))
            .filter(client_tool_calls::Column::CallKey.eq(key))
            .one(&self.db)
            .await?
            .map(call)
            .transpose()
    }

    /// A conversation's calls, newest first (at most 100); only the pending ones with
    /// `pending`.
    pub async fn client_tool_calls(
        &self,
        conversation_id: &str,
        pending: bool,
    ) -> Result<Vec<ClientToolCall>> {
        let mut query = client_tool_calls::Entity::find()
            .filter(client_tool_calls::Column::ConversationId.eq(conversation_id));
        if pending {
            query =
                query.filter(client_tool_calls::Column::Status.eq(RequestStatus::Pending.as_str()));
        }
        query
            .order_by_desc(client_tool_calls::Column::Id)
            .limit(LISTED)
            .all(&self.db)
            .await?
            .into_iter()
            .map(call)
            .collect()
    }

    /// Stores a call, and its webhook event's deliveries in the same transaction.
    pub(crate) async fn insert_client_tool_call(
        &self,
        call: &ClientToolCall,
        deliveries: &[crate::model::NewDelivery],
    ) -> Result<()> {
        let txn = self.writer().begin().await?;
        client_tool_calls::Entity::insert(client_tool_calls::ActiveModel {
            id: Set(call.id.clone()),
            conversation_id: Set(call.conversation_id.clone()),
            tool_use_id: Set(call.tool_use_id.clone()),
            call_key: Set(call.key.clone()),
            name: Set(call.name.clone()),
            input: Set(call.input.to_string()),
            status: Set(call.status.as_str().to_owned()),
            output: Set(call.output.clone()),
            is_error: Set(None),
            timeout_ms: Set(call.timeout_ms),
            expires_at: Set(call.expires_at.to_rfc3339()),
            created_at: Set(call.created_at.to_rfc3339()),
            resolved_at: Set(None),
        })
        .exec(&txn)
        .await?;
        super::webhooks::insert_deliveries(self, &txn, deliveries).await?;
        txn.commit().await?;
        Ok(())
    }

    /// Moves a pending call to `status` (answered with its output, expired, cancelled).
    /// Returns whether it was still pending: only one resolution ever wins.
    pub(crate) async fn resolve_client_tool_call(
        &self,
        id: &str,
        status: RequestStatus,
        answer: Option<(String, bool)>,
        at: DateTime<Utc>,
    ) -> Result<bool> {
        let (output, is_error) = answer.map_or((None, None), |(o, e)| (Some(o), Some(e)));
        let result = client_tool_calls::Entity::update_many()
            .col_expr(
                client_tool_calls::Column::Status,
                Expr::value(status.as_str()),
            )
            .col_expr(client_tool_calls::Column::Output, Expr::value(output))
            .col_expr(client_tool_calls::Column::IsError, Expr::value(is_error))
            .col_expr(
                client_tool_calls::Column::ResolvedAt,
                Expr::value(at.to_rfc3339()),
            )
            .filter(client_tool_calls::Column::Id.eq(id))
            .filter(client_tool_calls::Column::Status.eq(RequestStatus::Pending.as_str()))
            .exec(self.writer())
            .await?;
        Ok(result.rows_affected == 1)
    }
}

fn time(id: &str, field: &str, text: &str) -> Result<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| StoreError::Corrupt(format!("client tool call {id}: {field}: {e}")))
}

fn call(row: client_tool_calls::Model) -> Result<ClientToolCall> {
    Ok(ClientToolCall {
        status: stored_status(
            RequestStatus::parse,
            "client tool call",
            &row.id,
            &row.status,
        )?,
        input: serde_json::from_str(&row.input)
            .map_err(|e| StoreError::Corrupt(format!("client tool call {}: input: {e}", row.id)))?,
        expires_at: time(&row.id, "expires_at", &row.expires_at)?,
        created_at: time(&row.id, "created_at", &row.created_at)?,
        resolved_at: row
            .resolved_at
            .as_deref()
            .map(|at| time(&row.id, "resolved_at", at))
            .transpose()?,
        is_error: row.is_error.unwrap_or(false),
        id: row.id,
        conversation_id: row.conversation_id,
        tool_use_id: row.tool_use_id,
        key: row.call_key,
        name: row.name,
        output: row.output,
        timeout_ms: row.timeout_ms,
    })
}
