//! Tenants' own MCP tool servers (docs/api.md, "MCP"). Headers (credentials for the server)
//! are stored as given and never shown again: the API lists their names only.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait as _, FromQueryResult};

use super::{Result, Store, StoreError};

/// A registered MCP server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct McpServer {
    pub name: String,
    pub url: String,
    pub headers: BTreeMap<String, String>,
    pub created_at: String,
}

#[derive(Debug, FromQueryResult)]
struct Row {
    name: String,
    url: String,
    headers: String,
    created_at: String,
}

impl From<Row> for McpServer {
    fn from(row: Row) -> Self {
        McpServer {
            name: row.name,
            url: row.url,
            headers: serde_json::from_str(&row.headers).unwrap_or_default(),
            created_at: row.created_at,
        }
    }
}

impl Store {
    /// Registers a server; a name the tenant uses already is a conflict.
    pub async fn add_mcp_server(
        &self,
        tenant_id: &str,
        server: &McpServer,
        now: DateTime<Utc>,
    ) -> Result<McpServer> {
        let created_at = now.to_rfc3339();
        let headers =
            serde_json::to_string(&server.headers).map_err(|e| StoreError::Other(e.to_string()))?;
        self.writer()
            .execute_raw(self.statement(
                "INSERT INTO mcp_servers (tenant_id, name, url, headers, created_at) \
                 VALUES ($1, $2, $3, $4, $5)",
                vec![
                    tenant_id.into(),
                    server.name.clone().into(),
                    server.url.clone().into(),
                    headers.into(),
                    created_at.clone().into(),
                ],
            ))
            .await?;
        Ok(McpServer {
            created_at,
            ..server.clone()
        })
    }

    /// The tenant's servers, by name.
    pub async fn mcp_servers(&self, tenant_id: &str) -> Result<Vec<McpServer>> {
        Ok(Row::find_by_statement(self.statement(
            "SELECT name, url, headers, created_at FROM mcp_servers \
             WHERE tenant_id = $1 ORDER BY name",
            vec![tenant_id.into()],
        ))
        .all(&self.db)
        .await?
        .into_iter()
        .map(McpServer::from)
        .collect())
    }

    /// One of the tenant's servers.
    pub async fn mcp_server(&self, tenant_id: &str, name: &str) -> Result<Option<McpServer>> {
        Ok(Row::find_by_statement(self.statement(
            "SELECT name, url, headers, created_at FROM mcp_servers \
             WHERE tenant_id = $1 AND name = $2",
            vec![tenant_id.into(), name.into()],
        ))
        .one(&self.db)
        .await?
        .map(McpServer::from))
    }

    /// Removes one; whether it was there.
    pub async fn delete_mcp_server(&self, tenant_id: &str, name: &str) -> Result<bool> {
        let result = self
            .writer()
            .execute_raw(self.statement(
                "DELETE FROM mcp_servers WHERE tenant_id = $1 AND name = $2",
                vec![tenant_id.into(), name.into()],
            ))
            .await?;
        Ok(result.rows_affected() == 1)
    }
}
