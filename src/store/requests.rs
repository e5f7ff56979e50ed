//! Requests to clients and background tasks: created, resolved, finished, expired.

use chrono::{DateTime, Utc};
use entity::{background_tasks, client_requests};
use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveValue::Set, ColumnTrait, EntityTrait, QueryFilter, QueryOrder, TransactionTrait,
};

use super::{Result, Store, StoreError};
use crate::model::{BackgroundTask, ClientRequest, RequestStatus, TaskStatus};

impl Store {
    /// A conversation's client request.
    pub async fn client_request(
        &self,
        conversation_id: &str,
        id: &str,
    ) -> Result<Option<ClientRequest>> {
        client_requests::Entity::find_by_id(id.to_owned())
            .filter(client_requests::Column::ConversationId.eq(conversation_id))
            .one(&self.db)
            .await?
            .map(client_request)
            .transpose()
    }

    /// The pending requests of a conversation, oldest first, as the snapshot lists them.
    pub async fn pending_requests(&self, conversation_id: &str) -> Result<Vec<ClientRequest>> {
        client_requests::Entity::find()
            .filter(client_requests::Column::ConversationId.eq(conversation_id))
            .filter(client_requests::Column::Status.eq(RequestStatus::Pending.as_str()))
            .order_by_asc(client_requests::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(client_request)
            .collect()
    }

    /// A conversation's background tasks, oldest first.
    pub async fn background_tasks(&self, conversation_id: &str) -> Result<Vec<BackgroundTask>> {
        background_tasks::Entity::find()
            .filter(background_tasks::Column::ConversationId.eq(conversation_id))
            .order_by_asc(background_tasks::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| {
                Ok(BackgroundTask {
                    status: stored_status(
                        TaskStatus::parse,
                        "background task",
                        &row.id,
                        &row.status,
                    )?,
                    id: row.id,
                    conversation_id: row.conversation_id,
                    tool_use_id: row.tool_use_id,
                    tool_name: row.tool_name,
                    command: row.command,
                    output: row.output,
                    exit_code: row.exit_code,
                    wake: row.wake,
                    created_at: row.created_at,
                    finished_at: row.finished_at,
                })
            })
            .collect()
    }

    /// Stores a request, and its webhook event's deliveries in the same transaction.
    pub(crate) async fn insert_client_request(
        &self,
        request: &ClientRequest,
        deliveries: &[crate::model::NewDelivery],
    ) -> Result<()> {
        let txn = self.writer().begin().await?;
        client_requests::Entity::insert(client_requests::ActiveModel {
            id: Set(request.id.clone()),
            conversation_id: Set(request.conversation_id.clone()),
            tool_use_id: Set(request.tool_use_id.clone()),
            request_type: Set(request.request_type.clone()),
            status: Set(request.status.as_str().to_owned()),
            response: Set(request.response.clone()),
            timeout_ms: Set(request.timeout_ms),
            expires_at: Set(request.expires_at),
            created_at: Set(request.created_at),
            resolved_at: Set(None),
        })
        .exec(&txn)
        .await?;
        super::webhooks::insert_deliveries(self, &txn, deliveries).await?;
        txn.commit().await?;
        Ok(())
    }

    /// Moves a pending request to `status` (answered with `response`, expired, cancelled).
    /// Returns whether it was still pending: only one resolution ever wins.
    pub(crate) async fn resolve_client_request(
        &self,
        id: &str,
        status: RequestStatus,
        response: Option<serde_json::Value>,
        at: DateTime<Utc>,
    ) -> Result<bool> {
        let result = client_requests::Entity::update_many()
            .col_expr(
                client_requests::Column::Status,
                Expr::value(status.as_str()),
            )
            .col_expr(client_requests::Column::Response, Expr::value(response))
            .col_expr(client_requests::Column::ResolvedAt, Expr::value(at))
            .filter(client_requests::Column::Id.eq(id))
            .filter(client_requests::Column::Status.eq(RequestStatus::Pending.as_str()))
            .exec(self.writer())
            .await?;
        Ok(result.rows_affected == 1)
    }

    pub(crate) async fn insert_background_task(&self, task: &BackgroundTask) -> Result<()> {
        background_tasks::Entity::insert(background_tasks::ActiveModel {
            id: Set(task.id.clone()),
            conversation_id: Set(task.conversation_id.clone()),
            tool_use_id: Set(task.tool_use_id.clone()),
            tool_name: Set(task.tool_name.clone()),
            command: Set(task.command.clone()),
            status: Set(task.status.as_str().to_owned()),
            output: Set(task.output.clone()),
            exit_code: Set(task.exit_code),
            wake: Set(task.wake),
            created_at: Set(task.created_at),
            finished_at: Set(task.finished_at),
        })
        .exec(self.writer())
        .await?;
        Ok(())
    }

    /// Records how a running background task ended; false when it was no longer running.
    pub(crate) async fn finish_background_task(
        &self,
        id: &str,
        status: TaskStatus,
        output: &str,
        exit_code: Option<i32>,
        at: DateTime<Utc>,
    ) -> Result<bool> {
        let result = background_tasks::Entity::update_many()
            .col_expr(
                background_tasks::Column::Status,
                Expr::value(status.as_str()),
            )
            .col_expr(background_tasks::Column::Output, Expr::value(output))
            .col_expr(background_tasks::Column::ExitCode, Expr::value(exit_code))
            .col_expr(background_tasks::Column::FinishedAt, Expr::value(at))
            .filter(background_tasks::Column::Id.eq(id))
            .filter(background_tasks::Column::Status.eq(TaskStatus::Running.as_str()))
            .exec(self.writer())
            .await?;
        Ok(result.rows_affected == 1)
    }

    /// Marks every pending client request expired and every running background task failed
    /// (restart recovery), of one conversation or of all. Returns how many of each.
    pub(crate) async fn expire_pending_work(
        &self,
        at: DateTime<Utc>,
        conversation: Option<&str>,
    ) -> Result<(u64, u64)> {
        let requests =
            client_requests::Entity::update_many()
                .col_expr(
                    client_requests::Column::Status,
                    Expr::value(RequestStatus::Expired.as_str()),
                )
                .col_expr(client_requests::Column::ResolvedAt, Expr::value(at))
                .filter(client_requests::Column::Status.eq(RequestStatus::Pending.as_str()))
                .filter(sea_orm::Condition::all().add_option(
                    conversation.map(|id| client_requests::Column::ConversationId.eq(id)),
                ))
                .exec(self.writer())
                .await?;
        let tasks =
            background_tasks::Entity::update_many()
                .col_expr(
                    background_tasks::Column::Status,
                    Expr::value(TaskStatus::Failed.as_str()),
                )
                .col_expr(
                    background_tasks::Column::Output,
                    Expr::value("interrupted by server restart"),
                )
                .col_expr(background_tasks::Column::FinishedAt, Expr::value(at))
                .filter(background_tasks::Column::Status.eq(TaskStatus::Running.as_str()))
                .filter(sea_orm::Condition::all().add_option(
                    conversation.map(|id| background_tasks::Column::ConversationId.eq(id)),
                ))
                .exec(self.writer())
                .await?;
        Ok((requests.rows_affected, tasks.rows_affected))
    }
}

/// A status as stored; a name no version wrote is corrupt data, not a status.
pub(super) fn stored_status<T>(
    parse: fn(&str) -> Option<T>,
    of: &str,
    id: &str,
    name: &str,
) -> Result<T> {
    parse(name).ok_or_else(|| StoreError::Corrupt(format!("{of} {id} has the status {name:?}")))
}

pub(super) fn client_request(row: client_requests::Model) -> Result<ClientRequest> {
    Ok(ClientRequest {
        status: stored_status(RequestStatus::parse, "client request", &row.id, &row.status)?,
        id: row.id,
        conversation_id: row.conversation_id,
        tool_use_id: row.tool_use_id,
        request_type: row.request_type,
        response: row.response,
        timeout_ms: row.timeout_ms,
        expires_at: row.expires_at,
        created_at: row.created_at,
    })
}
