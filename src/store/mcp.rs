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

/// How long a tenant found without MCP servers is taken to have none: a server registered
/// on another node of a cluster is used by this node's new conversations within it.
pub const NO_SERVERS_FOR: std::time::Duration = std::time::Duration::from_secs(2);

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
        // Read again from now on (a read that raced the insert may have marked it).
        self.no_mcp_servers.forget(tenant_id);
        Ok(McpServer {
            created_at,
            ..server.clone()
        })
    }

    /// The tenant's servers, by name. A tenant found without any is not read again for
    /// [`NO_SERVERS_FOR`] (every new conversation reads them; issue 41), unless it registers
    /// one on this node.
    pub async fn mcp_servers(&self, tenant_id: &str) -> Result<Vec<McpServer>> {
        if self.no_mcp_servers.known(tenant_id, NO_SERVERS_FOR) {
            return Ok(Vec::new());
        }
        let servers: Vec<McpServer> = Row::find_by_statement(self.statement(
            "SELECT name, url, headers, created_at FROM mcp_servers \
             WHERE tenant_id = $1 ORDER BY name",
            vec![tenant_id.into()],
        ))
        .all(&self.db)
        .await?
        .into_iter()
        .map(McpServer::from)
        .collect();
        if servers.is_empty() {
            self.no_mcp_servers.mark(tenant_id);
        }
        Ok(servers)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{at, sqlite_store};

    /// A tenant found without servers reads none for a while, but one it registers on this
    /// node is seen at once (its next conversation gets the server's tools).
    #[tokio::test]
    async fn a_server_registered_here_is_seen_at_once() {
        let (store, dir) = sqlite_store("mcp-absent", &[]).await;
        assert!(store.mcp_servers("t").await.expect("reads").is_empty());
        assert!(store.no_mcp_servers.known("t", NO_SERVERS_FOR));
        let server = McpServer {
            name: "docs".into(),
            url: "http://127.0.0.1:9/mcp".into(),
            headers: BTreeMap::new(),
            created_at: String::new(),
        };
        store
            .add_mcp_server("t", &server, at())
            .await
            .expect("registers");
        let found = store.mcp_servers("t").await.expect("reads");
        assert_eq!(
            found.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["docs"]
        );
        store.close().await.expect("closes");
        let _ = std::fs::remove_dir_all(dir);
    }
}
