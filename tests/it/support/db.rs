//! Fresh databases: a SQLite file in a temp dir, or a new Postgres database per test.

use std::path::PathBuf;
use std::sync::Once;

use sea_orm::{ConnectionTrait, Database};

/// One test's database.
#[derive(Debug)]
pub struct TestDb {
    /// The URL to give BEDROCK_DATABASE_URL.
    pub url: String,
    /// `sqlite` or `postgres`.
    pub backend: &'static str,
    /// The temp dir of a SQLite database (kept until the test ends).
    pub dir: Option<PathBuf>,
    admin: Option<(String, String)>,
}

static CLEAN_LEFTOVERS: Once = Once::new();

pub fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "bedrock-it-{tag}-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    dir
}

/// Drops test databases left by runs that died more than an hour ago (their names carry a
/// UUIDv7, whose first 48 bits are the creation time in ms).
async fn drop_stale(conn: &sea_orm::DatabaseConnection) {
    use sea_orm::{ConnectionTrait, Statement};
    let Ok(rows) = conn
        .query_all_raw(Statement::from_string(
            conn.get_database_backend(),
            "SELECT datname FROM pg_database WHERE datname LIKE 'bedrock_t_%'",
        ))
        .await
    else {
        return;
    };
    let now_ms = u64::try_from(chrono::Utc::now().timestamp_millis()).unwrap_or(0);
    for row in rows {
        let Ok(name) = row.try_get::<String>("", "datname") else {
            continue;
        };
        let Some(created_ms) = name
            .strip_prefix("bedrock_t_")
            .and_then(|hex| u64::from_str_radix(hex.get(..12)?, 16).ok())
        else {
            continue;
        };
        if now_ms.saturating_sub(created_ms) > 3_600_000 {
            let _ = conn
                .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .await;
        }
    }
}

impl TestDb {
    pub fn sqlite() -> TestDb {
        let dir = temp_dir("db");
        TestDb {
            url: format!("sqlite://{}?mode=rwc", dir.join("bedrock.db").display()),
            backend: "sqlite",
            dir: Some(dir),
            admin: None,
        }
    }

    /// A fresh Postgres database, when BEDROCK_TEST_DATABASE_URL names a server.
    pub async fn postgres() -> Option<TestDb> {
        let admin = std::env::var("BEDROCK_TEST_DATABASE_URL")
            .ok()
            .filter(|u| !u.is_empty())?;
        let conn = Database::connect(&admin)
            .await
            .expect("BEDROCK_TEST_DATABASE_URL connects");
        CLEAN_LEFTOVERS.call_once(|| {});
        let name = format!("bedrock_t_{}", uuid::Uuid::now_v7().simple());
        conn.execute_unprepared(&format!("CREATE DATABASE {name}"))
            .await
            .expect("CREATE DATABASE works");
        let _ = conn.close().await;
        let base = match admin.rfind('/') {
            Some(slash)
                if admin[..slash].contains("://") && slash > admin.find("://").unwrap_or(0) + 2 =>
            {
                &admin[..slash]
            }
            _ => admin.as_str(),
        };
        let query = admin.find('?').map(|q| &admin[q..]).unwrap_or_default();
        Some(TestDb {
            url: format!("{base}/{name}{query}"),
            backend: "postgres",
            dir: None,
            admin: Some((admin.clone(), name)),
        })
    }

    /// SQLite, and Postgres where configured: what every database test runs on.
    pub async fn each() -> Vec<TestDb> {
        let mut all = vec![TestDb::sqlite()];
        all.extend(TestDb::postgres().await);
        all
    }

    /// Removes the database.
    pub async fn drop_db(self) {
        if let Some((admin, name)) = &self.admin
            && let Ok(conn) = Database::connect(admin).await
        {
            let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
            let _ = conn.execute_unprepared(&sql).await;
            let _ = conn.close().await;
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
