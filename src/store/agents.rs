//! Tenants' agents (docs/api.md, "Agents"; migration 14): each name's versions, immutable
//! once made, and which is the latest. A conversation keeps what its version gave it in its
//! own row, so a deleted agent's versions go with it; its row stays, and created again its
//! versions go on from the last number, so `name@N` always means one definition.

use sea_orm::{ConnectionTrait as _, FromQueryResult, TransactionTrait as _};

use super::{Result, Store, StoreError};
use crate::model::{AgentDefinition, AgentVersion};

#[derive(Debug, FromQueryResult)]
struct VersionRow {
    name: String,
    version: i64,
    definition: String,
    created_at: String,
}

impl TryFrom<VersionRow> for AgentVersion {
    type Error = StoreError;

    fn try_from(row: VersionRow) -> Result<AgentVersion> {
        let definition = serde_json::from_str(&row.definition).map_err(|e| {
            StoreError::Corrupt(format!("agent {} version {}: {e}", row.name, row.version))
        })?;
        Ok(AgentVersion {
            version: u32::try_from(row.version)
                .map_err(|_| StoreError::Corrupt(format!("agent {}: version", row.name)))?,
            name: row.name,
            definition,
            created_at: row.created_at,
        })
    }
}

/// The versions of the tenant's live agents, joined: `{where}` narrows them.
const VERSIONS: &str = "SELECT v.name, v.version, v.definition, v.created_at \
     FROM agents a JOIN agent_versions v \
     ON v.tenant_id = a.tenant_id AND v.name = a.name \
     WHERE a.tenant_id = $1 AND a.deleted_at IS NULL";

/// How a version is made: the agent's first (or first again after a delete), or the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Making {
    /// `POST /v1/agents`: a live agent of that name is a conflict.
    Create,
    /// `PUT /v1/agents/{name}`: no live agent of that name is not found.
    Change,
}

impl Store {
    /// Makes a version of the tenant's agent `name` and answers it.
    pub async fn put_agent(
        &self,
        tenant_id: &str,
        name: &str,
        definition: &AgentDefinition,
        making: Making,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<AgentVersion> {
        self.put_agent_versions(
            tenant_id,
            name,
            std::slice::from_ref(definition),
            making,
            now,
        )
        .await?
        .pop()
        .ok_or(StoreError::NotFound)
    }

    /// Makes versions of the tenant's agent `name`, in order and all or none (an import),
    /// the first as `making` says, and answers them. Each name's versions are numbered by
    /// one conditional statement on the agent's row, so two changes at once (on two nodes,
    /// say) get two numbers.
    pub async fn put_agent_versions(
        &self,
        tenant_id: &str,
        name: &str,
        definitions: &[AgentDefinition],
        making: Making,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<AgentVersion>> {
        let created_at = now.to_rfc3339();
        let txn = self.writer().begin().await?;
        let mut made = Vec::with_capacity(definitions.len());
        for (i, definition) in definitions.iter().enumerate() {
            let making = if i == 0 { making } else { Making::Change };
            made.push(
                self.put_version(&txn, tenant_id, name, definition, making, &created_at)
                    .await?,
            );
        }
        txn.commit().await?;
        Ok(made)
    }

    async fn put_version(
        &self,
        txn: &sea_orm::DatabaseTransaction,
        tenant_id: &str,
        name: &str,
        definition: &AgentDefinition,
        making: Making,
        created_at: &str,
    ) -> Result<AgentVersion> {
        let json =
            serde_json::to_string(definition).map_err(|e| StoreError::Other(e.to_string()))?;
        let created_at = created_at.to_owned();
        let numbered = match making {
            Making::Create => self.statement(
                "INSERT INTO agents (tenant_id, name, latest, created_at, updated_at, deleted_at) \
                 VALUES ($1, $2, 1, $3, $3, NULL) \
                 ON CONFLICT (tenant_id, name) DO UPDATE \
                 SET latest = agents.latest + 1, updated_at = $3, deleted_at = NULL \
                 WHERE agents.deleted_at IS NOT NULL \
                 RETURNING latest",
                vec![tenant_id.into(), name.into(), created_at.clone().into()],
            ),
            Making::Change => self.statement(
                "UPDATE agents SET latest = latest + 1, updated_at = $3 \
                 WHERE tenant_id = $1 AND name = $2 AND deleted_at IS NULL \
                 RETURNING latest",
                vec![tenant_id.into(), name.into(), created_at.clone().into()],
            ),
        };
        let Some(row) = txn.query_one_raw(numbered).await? else {
            return Err(match making {
                Making::Create => StoreError::Conflict(format!("agent {name} exists")),
                Making::Change => StoreError::NotFound,
            });
        };
        let version: i64 = row.try_get("", "latest")?;
        txn.execute_raw(self.statement(
            "INSERT INTO agent_versions (tenant_id, name, version, definition, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
            vec![
                tenant_id.into(),
                name.into(),
                version.into(),
                json.into(),
                created_at.clone().into(),
            ],
        ))
        .await?;
        Ok(AgentVersion {
            name: name.to_owned(),
            version: u32::try_from(version)
                .map_err(|_| StoreError::Corrupt(format!("agent {name}: version")))?,
            definition: definition.clone(),
            created_at,
        })
    }

    /// Deletes the tenant's agent `name` and its versions (its row keeps the last number);
    /// whether it was live.
    pub async fn delete_agent(
        &self,
        tenant_id: &str,
        name: &str,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<bool> {
        let txn = self.writer().begin().await?;
        let result = txn
            .execute_raw(self.statement(
                "UPDATE agents SET deleted_at = $3, updated_at = $3 \
                 WHERE tenant_id = $1 AND name = $2 AND deleted_at IS NULL",
                vec![tenant_id.into(), name.into(), now.to_rfc3339().into()],
            ))
            .await?;
        txn.execute_raw(self.statement(
            "DELETE FROM agent_versions WHERE tenant_id = $1 AND name = $2",
            vec![tenant_id.into(), name.into()],
        ))
        .await?;
        txn.commit().await?;
        Ok(result.rows_affected() == 1)
    }

    /// How many versions the tenant's live agent `name` holds.
    pub async fn agent_version_count(&self, tenant_id: &str, name: &str) -> Result<u64> {
        self.count_of(
            "SELECT COUNT(*) AS n FROM agent_versions WHERE tenant_id = $1 AND name = $2",
            vec![tenant_id.into(), name.into()],
        )
        .await
    }

    /// The latest version of each of the tenant's live agents, by name.
    pub async fn agents(&self, tenant_id: &str) -> Result<Vec<AgentVersion>> {
        self.versions_where(
            "AND v.version = a.latest ORDER BY a.name",
            vec![tenant_id.into()],
        )
        .await
    }

    /// A version of the tenant's live agent `name`: `version`, or its latest.
    pub async fn agent(
        &self,
        tenant_id: &str,
        name: &str,
        version: Option<u32>,
    ) -> Result<Option<AgentVersion>> {
        let found = match version {
            Some(version) => {
                self.versions_where(
                    "AND a.name = $2 AND v.version = $3",
                    vec![tenant_id.into(), name.into(), i64::from(version).into()],
                )
                .await?
            }
            None => {
                self.versions_where(
                    "AND a.name = $2 AND v.version = a.latest",
                    vec![tenant_id.into(), name.into()],
                )
                .await?
            }
        };
        Ok(found.into_iter().next())
    }

    /// Every version of the tenant's live agent `name`, oldest first (none: no such agent).
    pub async fn agent_versions(&self, tenant_id: &str, name: &str) -> Result<Vec<AgentVersion>> {
        self.versions_where(
            "AND a.name = $2 ORDER BY v.version",
            vec![tenant_id.into(), name.into()],
        )
        .await
    }

    /// How many live agents the tenant has.
    pub async fn agent_count(&self, tenant_id: &str) -> Result<u64> {
        self.count_of(
            "SELECT COUNT(*) AS n FROM agents WHERE tenant_id = $1 AND deleted_at IS NULL",
            vec![tenant_id.into()],
        )
        .await
    }

    async fn versions_where(
        &self,
        narrowed: &str,
        values: Vec<sea_orm::Value>,
    ) -> Result<Vec<AgentVersion>> {
        VersionRow::find_by_statement(self.statement(&format!("{VERSIONS} {narrowed}"), values))
            .all(&self.db)
            .await?
            .into_iter()
            .map(AgentVersion::try_from)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{at, sqlite_store};

    fn definition(model: &str) -> AgentDefinition {
        AgentDefinition {
            model: model.to_owned(),
            ..AgentDefinition::default()
        }
    }

    /// Versions are numbered per name and never reused: a change makes the next, a delete
    /// hides the agent (not its versions), and the name created again goes on numbering.
    #[tokio::test]
    async fn versions_are_numbered_and_never_reused() {
        let (store, dir) = sqlite_store("agents", &[]).await;
        let first = store
            .put_agent("t", "coder", &definition("m1"), Making::Create, at())
            .await
            .expect("creates");
        assert_eq!(first.version, 1);
        assert!(matches!(
            store
                .put_agent("t", "coder", &definition("m1"), Making::Create, at())
                .await,
            Err(StoreError::Conflict(_))
        ));
        assert!(matches!(
            store
                .put_agent("t", "other", &definition("m"), Making::Change, at())
                .await,
            Err(StoreError::NotFound)
        ));
        let second = store
            .put_agent("t", "coder", &definition("m2"), Making::Change, at())
            .await
            .expect("changes");
        assert_eq!(second.version, 2);
        let latest = store.agent("t", "coder", None).await.expect("reads");
        assert_eq!(latest.map(|v| v.definition.model), Some("m2".to_owned()));
        let pinned = store.agent("t", "coder", Some(1)).await.expect("reads");
        assert_eq!(pinned.map(|v| v.definition.model), Some("m1".to_owned()));
        assert!(
            store
                .agent("u", "coder", None)
                .await
                .expect("reads")
                .is_none()
        );
        assert_eq!(store.agent_count("t").await.expect("counts"), 1);

        assert!(
            store
                .delete_agent("t", "coder", at())
                .await
                .expect("deletes")
        );
        assert!(
            !store
                .delete_agent("t", "coder", at())
                .await
                .expect("deletes")
        );
        assert!(
            store
                .agent("t", "coder", Some(1))
                .await
                .expect("reads")
                .is_none()
        );
        assert!(store.agents("t").await.expect("lists").is_empty());
        let again = store
            .put_agent("t", "coder", &definition("m3"), Making::Create, at())
            .await
            .expect("creates again");
        assert_eq!(again.version, 3, "numbering goes on after a delete");
        let versions = store.agent_versions("t", "coder").await.expect("lists");
        assert_eq!(
            versions.iter().map(|v| v.version).collect::<Vec<_>>(),
            [3],
            "a deleted agent's versions went with it"
        );
        assert_eq!(
            store
                .agent_version_count("t", "coder")
                .await
                .expect("counts"),
            1
        );
        store.close().await.expect("closes");
        let _ = std::fs::remove_dir_all(dir);
    }
}
