//! Tenants' own quotas (docs/security.md, "Quotas") and the counts they are checked against.

use sea_orm::{ConnectionTrait as _, FromQueryResult};

use super::{Result, Store};

#[derive(FromQueryResult)]
struct QuotaRow {
    name: String,
    value: i64,
}

#[derive(FromQueryResult)]
struct Count {
    n: i64,
}

impl Store {
    /// The quotas `bedrock tenant quota` gave the tenant: (name, value).
    pub async fn tenant_quotas(&self, tenant_id: &str) -> Result<Vec<(String, u64)>> {
        Ok(QuotaRow::find_by_statement(self.statement(
            "SELECT name, value FROM tenant_quotas WHERE tenant_id = $1",
            vec![tenant_id.into()],
        ))
        .all(&self.db)
        .await?
        .into_iter()
        .map(|row| (row.name, u64::try_from(row.value).unwrap_or(0)))
        .collect())
    }

    /// Gives the tenant its own value of quota `name` (`None`: the default again).
    pub async fn set_tenant_quota(
        &self,
        tenant_id: &str,
        name: &str,
        value: Option<u64>,
    ) -> Result<()> {
        let statement = match value {
            Some(value) => self.statement(
                "INSERT INTO tenant_quotas (tenant_id, name, value) VALUES ($1, $2, $3) \
                 ON CONFLICT (tenant_id, name) DO UPDATE SET value = excluded.value",
                vec![
                    tenant_id.into(),
                    name.into(),
                    i64::try_from(value).unwrap_or(i64::MAX).into(),
                ],
            ),
            None => self.statement(
                "DELETE FROM tenant_quotas WHERE tenant_id = $1 AND name = $2",
                vec![tenant_id.into(), name.into()],
            ),
        };
        self.writer().execute_raw(statement).await?;
        Ok(())
    }

    /// How many conversations the tenant has, sub-agents not counted: one row, kept by the
    /// database's triggers on `conversations` (migration 13). Counting the tenant's
    /// conversations on every create cost a read per conversation it had (issue 41: 4.6 ms a
    /// created conversation at 3,000 of them, on SQLite).
    pub async fn conversation_count(&self, tenant_id: &str) -> Result<u64> {
        self.count(
            "SELECT n FROM tenant_conversation_counts WHERE tenant_id = $1",
            tenant_id,
        )
        .await
    }

    /// How many MCP servers the tenant registered.
    pub async fn mcp_server_count(&self, tenant_id: &str) -> Result<u64> {
        self.count(
            "SELECT COUNT(*) AS n FROM mcp_servers WHERE tenant_id = $1",
            tenant_id,
        )
        .await
    }

    /// The working directories of the tenant's conversations.
    pub async fn conversation_cwds(&self, tenant_id: &str) -> Result<Vec<String>> {
        #[derive(FromQueryResult)]
        struct Cwd {
            cwd: String,
        }
        Ok(Cwd::find_by_statement(self.statement(
            "SELECT DISTINCT cwd FROM conversations WHERE tenant_id = $1",
            vec![tenant_id.into()],
        ))
        .all(&self.db)
        .await?
        .into_iter()
        .map(|row| row.cwd)
        .collect())
    }

    async fn count(&self, sql: &str, tenant_id: &str) -> Result<u64> {
        self.count_of(sql, vec![tenant_id.into()]).await
    }

    /// The `n` that `sql` (with `values`) selects, 0 when it selects no row.
    pub(super) async fn count_of(&self, sql: &str, values: Vec<sea_orm::Value>) -> Result<u64> {
        Ok(Count::find_by_statement(self.statement(sql, values))
            .one(&self.db)
            .await?
            .map_or(0, |row| u64::try_from(row.n).unwrap_or(0)))
    }
}
