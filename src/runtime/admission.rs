//! Admission of a tool process: room in the tenant's workspace, then one of its process
//! slots. Shared by tool runs and background tasks.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::quotas::{Quota, Quotas, SlotWait};
use crate::state_machine::ToolOutcome;
use crate::tools::failed;

/// A failed result when the tenant's workspace is over its quota (measured at most every
/// `quotas.measure_every_ms`).
async fn workspace_full(quotas: &Quotas, tenant_id: &str) -> Option<ToolOutcome> {
    let bytes = quotas.workspace_bytes(tenant_id).await?;
    quotas
        .check(tenant_id, Quota::WorkspaceBytes, bytes)
        .await
        .err()
        .map(|exceeded| {
            let holds = if bytes == u64::MAX {
                "more than 1,000,000 files and directories, past what is measured".to_owned()
            } else {
                format!("{bytes} bytes")
            };
            failed(format!(
                "not run: the tenant's workspace holds {holds}; the {exceeded}"
            ))
        })
}

/// Admits one tool process of the tenant: room in its workspace, then one of its process
/// slots (waiting behind its own processes only, at most `wait`, and not past a cancel).
pub async fn admit(
    quotas: &Quotas,
    tenant_id: &str,
    wait: Duration,
    cancel: &CancellationToken,
) -> Result<tokio::sync::OwnedSemaphorePermit, ToolOutcome> {
    if let Some(refused) = workspace_full(quotas, tenant_id).await {
        return Err(refused);
    }
    quotas
        .tool_slot(tenant_id, wait, cancel)
        .await
        .map_err(|why| match why {
            SlotWait::Cancelled => failed("cancelled while waiting for a tool process slot"),
            SlotWait::TimedOut { waited, limit } => failed(format!(
                "not run: waited {} ms for one of the tenant's {limit} tool process slots (quota tool_processes); its other tools held them all",
                waited.as_millis()
            )),
        })
}
