//! A running actor tree on a fresh database with a fake LLM, without the HTTP layer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bedrock::config::Settings;
use bedrock::model::{ConversationRecord, MessageRecord, NewConversation};
use bedrock::persistence::WriteJob;
use bedrock::runtime::{Runtime, SendError};
use bedrock::state_machine::{
    ConvState, ErrorKind, IfBusy, ImageRef, MessageContent, validate_chain,
};
use bedrock::store::{Store, StoreOptions};
use bedrock::testkit::FakeLlm;

use super::{TestDb, WAIT, eventually};

pub struct TestRuntime {
    pub runtime: Runtime,
    pub llm: FakeLlm,
    pub store: Store,
    pub settings: Arc<Settings>,
    pub workspace: PathBuf,
    pub tenant_id: String,
}

/// The variables every test server gets: its database, the fake LLM, a workspace with its
/// data dir (the sandbox's mount point and temp dirs) beside it.
pub fn base_env(db_url: &str, llm: &FakeLlm, workspace: &std::path::Path) -> Vec<(String, String)> {
    vec![
        ("BEDROCK_DATABASE_URL".into(), db_url.to_owned()),
        ("BEDROCK_LLM_BASE_URL".into(), llm.base_url.clone()),
        ("BEDROCK_LLM_API_KEY".into(), "test-key".into()),
        ("BEDROCK_MODEL".into(), "fake-model".into()),
        (
            "BEDROCK_WORKSPACE_ROOT".into(),
            workspace.display().to_string(),
        ),
        ("BEDROCK_DATABASE__MAX_CONNECTIONS".into(), "4".into()),
        (
            "BEDROCK_DATA_DIR".into(),
            format!("{}-data", workspace.display()),
        ),
    ]
}

/// Settings for a test: the fake LLM, the database, a temp workspace, plus `extra`.
pub fn settings(
    db: &TestDb,
    llm: &FakeLlm,
    workspace: &std::path::Path,
    extra: &[(&str, &str)],
) -> Settings {
    let mut env = base_env(&db.url, llm, workspace);
    env.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    Settings::load_from(None, env).expect("test settings are valid")
}

/// The LLM API the runtime speaks to the fake (whose both sides answer the same script).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    OpenAi,
    Anthropic,
}

impl TestRuntime {
    pub async fn start(db: &TestDb, extra: &[(&str, &str)]) -> TestRuntime {
        Self::start_on(db, extra, Api::OpenAi).await
    }

    /// [`start`](Self::start), with every model reached through `api`.
    pub async fn start_on(db: &TestDb, extra: &[(&str, &str)], api: Api) -> TestRuntime {
        let llm = FakeLlm::start().await;
        let workspace = super::db::temp_dir("ws");
        let anthropic_base = llm.base_url.trim_end_matches("/v1").to_owned();
        let mut extra = extra.to_vec();
        if api == Api::Anthropic {
            extra.extend([
                ("BEDROCK_MODELS__DEFAULT__PROVIDER", "anthropic"),
                ("BEDROCK_ANTHROPIC__BASE_URL", anthropic_base.as_str()),
                ("BEDROCK_ANTHROPIC__API_KEY", "test-anthropic-key"),
            ]);
        }
        let settings = Arc::new(settings(db, &llm, &workspace, &extra));
        let store = Store::connect(&StoreOptions {
            url: settings.database_url(),
            max_connections: settings.database.max_connections,
            acquire_timeout: Duration::from_millis(settings.database.acquire_timeout_ms),
        })
        .await
        .expect("the test database connects");
        store.migrate().await.expect("migrations apply");
        let (runtime, _) = Runtime::start(
            settings.clone(),
            store.clone(),
            Arc::new(bedrock::wire::Frames),
        )
        .await
        .expect("the runtime starts");
        let tenant_id = "tenant-test".to_owned();
        runtime
            .persistence
            .write(WriteJob::EnsureTenant {
                tenant: bedrock::model::Tenant {
                    id: tenant_id.clone(),
                    name: "test".into(),
                },
                at: chrono::Utc::now(),
            })
            .await
            .expect("the tenant is stored");
        TestRuntime {
            runtime,
            llm,
            store,
            settings,
            workspace,
            tenant_id,
        }
    }

    /// A new idle conversation with its own cwd.
    pub async fn create_conversation(&self) -> String {
        self.create(None).await
    }

    pub async fn create(&self, system_prompt: Option<&str>) -> String {
        let id = uuid::Uuid::now_v7().to_string();
        let cwd = self.workspace.join(&id);
        std::fs::create_dir_all(&cwd).expect("the cwd");
        self.runtime
            .persistence
            .write(WriteJob::CreateConversation(NewConversation {
                slug: format!("c-{}", &id[id.len() - 12..]),
                system_prompt: system_prompt.map(str::to_owned),
                ..NewConversation::user(
                    &id,
                    &self.tenant_id,
                    cwd.display().to_string(),
                    "fake-model",
                    chrono::Utc::now(),
                )
            }))
            .await
            .expect("the conversation is stored");
        id
    }

    pub fn cwd(&self, id: &str) -> PathBuf {
        self.workspace.join(id)
    }

    pub async fn send(&self, id: &str, text: &str) -> Result<MessageRecord, SendError> {
        self.send_with(id, text, Vec::new()).await
    }

    pub async fn send_with(
        &self,
        id: &str,
        text: &str,
        images: Vec<ImageRef>,
    ) -> Result<MessageRecord, SendError> {
        let live = self
            .runtime
            .conversations
            .get_or_start(id)
            .await
            .expect("the conversation starts");
        let text = text.to_owned();
        let message = bedrock::runtime::UserMessage {
            text,
            images,
            client_message_id: None,
            if_busy: IfBusy::Reject,
        };
        match live.send(message, Duration::from_secs(20)).await {
            Ok(Ok(bedrock::runtime::Accepted::Stored(message))) => Ok(message),
            Ok(Ok(waiting)) => panic!("a plain send waits: {waiting:?}"),
            Ok(Err(error)) => Err(error),
            Err(unanswered) => panic!("the send call failed: {unanswered:?}"),
        }
    }

    /// Cancels, as the API does, and returns what the cancel reported.
    pub async fn cancel(&self, id: &str) -> bedrock::runtime::CancelOutcome {
        let live = self
            .runtime
            .conversations
            .get_or_start(id)
            .await
            .expect("the conversation starts");
        let answer = live.cancel_turn();
        tokio::time::timeout(WAIT, answer)
            .await
            .expect("the cancel is answered in time")
            .expect("the cancel is answered")
    }

    pub async fn record(&self, id: &str) -> ConversationRecord {
        self.store
            .conversation_by_id(id)
            .await
            .expect("a readable row")
            .expect("the conversation exists")
    }

    pub async fn wait_state(
        &self,
        id: &str,
        what: &str,
        pred: impl Fn(&ConvState) -> bool,
    ) -> ConversationRecord {
        eventually(what, WAIT, || async {
            let record = self.record(id).await;
            pred(&record.state).then_some(record)
        })
        .await
    }

    pub async fn wait_idle(&self, id: &str) -> ConversationRecord {
        self.wait_state(id, "idle", |s| matches!(s, ConvState::Idle))
            .await
    }

    /// Waits for the error state; returns its kind and message.
    pub async fn wait_error(&self, id: &str) -> (ErrorKind, String) {
        eventually("error", WAIT, || async {
            match self.record(id).await.state {
                ConvState::Error {
                    error_kind,
                    message,
                } => Some((error_kind, message)),
                _ => None,
            }
        })
        .await
    }

    pub async fn messages(&self, id: &str) -> Vec<MessageRecord> {
        self.store.history(id).await.expect("the history reads")
    }

    /// The output of the stored result of tool call `tool_use_id` in conversation `id`.
    pub async fn tool_output(&self, id: &str, tool_use_id: &str) -> String {
        self.messages(id)
            .await
            .into_iter()
            .find_map(|m| match m.content {
                MessageContent::Tool(r) if r.tool_use_id == tool_use_id => Some(r.output),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no result of {tool_use_id} in {id}"))
    }

    /// The history is a valid chain for an LLM: every tool_use answered once, in order.
    pub async fn assert_chain_valid(&self, id: &str) {
        let history = self.messages(id).await;
        let contents: Vec<&MessageContent> = history.iter().map(|m| &m.content).collect();
        validate_chain(contents, false).expect("the stored chain is valid");
        for (i, m) in history.iter().enumerate() {
            assert_eq!(m.sequence_id, i as i64 + 1, "sequence ids have no gaps");
        }
    }

    pub async fn stop(self) {
        self.runtime.shutdown(Duration::from_secs(5)).await;
        self.store.close().await.ok();
        let _ = std::fs::remove_dir_all(&self.workspace);
    }
}
