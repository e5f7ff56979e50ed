//! The actor tree of ../shared/design.md:
//!
//! ```text
//!     root supervisor
//!     ├── persistence actor        the one owner of database writes
//!     ├── llm gateway              the only code that talks to LLM backends
//!     └── conversation actors      one per active conversation, started by the registry
//!         ├── tool run actors      one per tool run
//!         └── sub-agent supervisor one per spawn_sub_agents call
//!             └── sub-agent conversation actors
//! ```
//!
//! The event hub (src/hub.rs) carries frames from conversations to clients.

mod admission;
mod background;
mod cancel;
mod client_tools;
mod commit;
mod context;
mod conversation;
mod conversation_state;
mod effects;
mod hooks;
mod messages;
mod records;
mod recovery;
mod registry;
mod requests;
mod retention;
mod subagents;
mod system_events;
mod tool_run;
mod turn;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio_util::sync::CancellationToken;

pub use background::{BackgroundTasks, TaskSpec};
pub use cancel::{CancelOutcome, CancelSlot};
pub use client_tools::ToolResultError;
pub use commit::{Plan, apply as apply_commit, plan as plan_commit, plan_frames};
pub use messages::{Accepted, SendError};
pub use recovery::RecoveryReport;
use recovery::recover;
use registry::Registry;
pub use registry::{Fixed, Live, StartError, Unanswered, UserMessage};
pub use requests::{AnswerError, Asked, RequestBroker, check_reply};

use crate::config::Settings;
use crate::hub::EventHub;
use crate::llm::{Gateway, GatewayArgs, LlmGateway};
use crate::metrics::Metrics;
use crate::notice::Encode;
use crate::persistence::{Persistence, PersistenceActor};
use crate::sandbox::{Network, Sandbox};
use crate::store::Store;
use crate::tools::ToolLimits;

/// This node's life: the supervisor its conversations start under, and whether it is
/// shutting down.
#[derive(Clone, Debug)]
pub struct Lifecycle {
    root: ActorCell,
    shutdown: CancellationToken,
}

impl Lifecycle {
    /// The supervisor of conversation actors.
    pub fn root(&self) -> ActorCell {
        self.root.clone()
    }

    /// Once set, no new LLM request or tool run starts.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// Completes when the server starts shutting down.
    pub async fn shutting_down(&self) {
        self.shutdown.cancelled().await;
    }
}

/// The handles a conversation actor is given (the shared part of its `Arguments`), and
/// through it the tool runs, sub-agent supervisors, requests and background tasks it starts:
/// one per actor or service. Nothing outside the runtime sees it; the layers above get
/// [`Conversations`] and the handles they use themselves (the fields of [`Runtime`]).
#[derive(Debug)]
pub(crate) struct Handles {
    pub(crate) settings: Arc<Settings>,
    /// Reads (a conversation's row when it starts, a request's answer, an MCP server).
    pub(crate) store: Store,
    pub(crate) persistence: Persistence,
    pub(crate) hub: Arc<EventHub>,
    /// The format notices leave in (the API's, handed over by the composition root).
    pub(crate) format: Arc<dyn Encode>,
    /// What LLM requests read beyond the history they hold.
    pub(crate) records: Arc<dyn crate::llm::Records>,
    pub(crate) gateway: Gateway,
    pub(crate) registry: Registry,
    pub(crate) quotas: Arc<crate::quotas::Quotas>,
    pub(crate) tool_limits: ToolLimits,
    pub(crate) requests: RequestBroker,
    pub(crate) background: Arc<BackgroundTasks>,
    pub(crate) metrics: Arc<Metrics>,
    /// The HTTP client of calls to tenants' MCP servers (under `egress`).
    pub(crate) mcp_http: crate::egress::Client,
    /// This node of a cluster (Postgres); `None`: the only node.
    pub(crate) cluster: Option<Arc<crate::node::Cluster>>,
    pub(crate) lifecycle: Lifecycle,
    /// The tenants with webhooks: their conversations write events with their commits.
    pub(crate) webhooks: Arc<crate::webhooks::Subscribers>,
}

impl Handles {
    /// A frame that is not stored (a sub-agent's progress, a tool's, a delta), as the hub
    /// carries it.
    pub(crate) fn live(&self, notice: crate::notice::Notice<'_>) -> Arc<crate::hub::Frame> {
        let frame = self.format.frame(notice, None);
        Arc::new(crate::hub::Frame::new(frame.kind, None, frame.json.into()))
    }

    /// The tool limits of a conversation (`network`: what it was given at creation).
    pub(crate) fn tool_limits_for(&self, network: bool) -> ToolLimits {
        let mut limits = self.tool_limits.clone();
        limits.network = if network { Network::On } else { Network::Off };
        limits
    }
}

/// The conversations of this node, for the layers above the runtime (REST, the WebSocket,
/// SSE, MCP, the cluster): find or start one, then act on it through its [`Live`] door.
#[derive(Clone, Debug)]
pub struct Conversations {
    handles: Arc<Handles>,
}

impl Conversations {
    /// The running actor of a conversation, started from its row if needed.
    pub async fn get_or_start(&self, id: &str) -> Result<Live, StartError> {
        self.handles.registry.get_or_start(&self.handles, id).await
    }

    /// [`get_or_start`](Self::get_or_start) with the row when it was just read or written.
    pub async fn start_from(
        &self,
        record: crate::model::ConversationRecord,
    ) -> Result<Live, StartError> {
        self.handles
            .registry
            .start_from(&self.handles, record)
            .await
    }

    /// [`start_from`](Self::start_from) for a conversation just written (created, forked or
    /// continued), whose replay log starts at its first step without a read.
    pub async fn start_created(
        &self,
        record: crate::model::ConversationRecord,
    ) -> Result<Live, StartError> {
        self.handles
            .registry
            .start_created(&self.handles, record)
            .await
    }

    /// The running actor of a conversation, if it runs.
    pub fn get(&self, id: &str) -> Option<Live> {
        self.handles.registry.get(id)
    }

    /// Whether a conversation runs or is starting here.
    pub fn contains(&self, id: &str) -> bool {
        self.handles.registry.contains(id)
    }

    /// Every running conversation.
    pub fn running(&self) -> Vec<(String, Live)> {
        self.handles.registry.running()
    }

    /// How many of `tenant`'s top-level conversations other than `except` run a turn now.
    pub fn running_turns(&self, tenant: &str, except: Option<&str>) -> u64 {
        self.handles.registry.running_turns(tenant, except)
    }

    /// How many conversations run here.
    pub fn count(&self) -> usize {
        self.handles.registry.len()
    }

    /// Posts a client's system event to a conversation (system-bus-plan.md); whether it
    /// was new (not a repeat of a deduplicated one).
    pub async fn post_event(
        &self,
        conversation_id: &str,
        event: crate::notice::SystemEvent,
    ) -> Result<bool, String> {
        system_events::post(&self.handles, conversation_id, event).await
    }

    /// Answers a pending request once; a second answer, or one after the timeout, is refused.
    pub async fn answer_request(
        &self,
        conversation_id: &str,
        request_id: &str,
        payload: serde_json::Value,
    ) -> Result<(), AnswerError> {
        requests::answer_request(&self.handles, conversation_id, request_id, payload).await
    }

    /// Answers a pending client tool call once with its output; a second answer, or one
    /// after its timeout, is refused.
    pub async fn answer_tool_call(
        &self,
        conversation_id: &str,
        call_id: &str,
        output: String,
        is_error: bool,
    ) -> Result<(), ToolResultError> {
        client_tools::answer(&self.handles, conversation_id, call_id, output, is_error).await
    }
}

/// The root supervisor: it outlives every failure below it and logs them.
#[derive(Debug)]
pub struct Root;

impl Actor for Root {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _myself: ActorRef<()>, _args: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<()>,
        event: SupervisionEvent,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(cell, error) = event {
            tracing::error!(actor = %cell.get_id(), name = ?cell.get_name(), %error, "an actor failed");
        }
        Ok(())
    }
}

/// The running actor tree, and the handles the layers above it are given (the composition
/// root, src/app.rs, hands each component the ones it uses).
#[derive(Debug)]
pub struct Runtime {
    pub settings: Arc<Settings>,
    pub store: Store,
    pub persistence: Persistence,
    pub hub: Arc<EventHub>,
    pub conversations: Conversations,
    pub quotas: Arc<crate::quotas::Quotas>,
    pub tool_limits: ToolLimits,
    pub background: Arc<BackgroundTasks>,
    pub metrics: Arc<Metrics>,
    /// What the server may connect to on a tenant's behalf (its MCP servers).
    pub egress: crate::egress::Egress,
    /// The HTTP client of calls to tenants' MCP servers, under `egress`.
    pub mcp_http: crate::egress::Client,
    /// This node of a cluster (Postgres); `None`: the only node.
    pub cluster: Option<Arc<crate::node::Cluster>>,
    pub lifecycle: Lifecycle,
    /// The tenants with webhooks (the API adds one at once when it makes an endpoint).
    pub webhooks: Arc<crate::webhooks::Subscribers>,
    root: ActorRef<()>,
}

impl Runtime {
    /// Starts the tree on a migrated store and runs restart recovery.
    pub async fn start(
        settings: Arc<Settings>,
        store: Store,
        format: Arc<dyn Encode>,
    ) -> anyhow::Result<(Runtime, RecoveryReport)> {
        Self::start_node(settings, store, format, Arc::new(Metrics::default()), None).await
    }

    /// [`start`](Self::start) with the process's metrics (exported as configured), as a
    /// node of a cluster when `cluster` is given: start-up recovery takes only
    /// conversations nobody live holds. The caller then starts the node's part in the
    /// cluster (`cluster::start`: heartbeat, frames across nodes, takeovers).
    pub async fn start_node(
        settings: Arc<Settings>,
        store: Store,
        format: Arc<dyn Encode>,
        metrics: Arc<Metrics>,
        cluster: Option<Arc<crate::node::Cluster>>,
    ) -> anyhow::Result<(Runtime, RecoveryReport)> {
        crate::install_crypto();
        let (root, _) = Actor::spawn(None, Root, ()).await?;
        let (persistence, _) = Actor::spawn_linked(
            None,
            PersistenceActor,
            (store.clone(), metrics.clone()),
            root.get_cell(),
        )
        .await?;
        // How long a caller waits for a write before reporting the database unavailable.
        let write_timeout =
            Duration::from_millis(settings.database.acquire_timeout_ms.max(1000) * 2);
        let hub = Arc::new(EventHub::new(settings.server.client_lag_frames));
        let sandbox = match Sandbox::new(&settings)? {
            Some(sandbox) => {
                let sandbox = Arc::new(sandbox);
                crate::tools::sandbox_self_test(&sandbox, &settings).await?;
                tracing::info!(sandbox = %sandbox.describe(), "tool sandbox enforced");
                Some(sandbox)
            }
            None => {
                tracing::warn!(
                    "sandbox.mode is off: tool processes run unconfined, with the server's \
                     view of the filesystem and network"
                );
                None
            }
        };
        let egress = crate::egress::Egress::new(&settings.egress.allow)
            .map_err(|e| anyhow::anyhow!("invalid configuration: egress.allow: {e}"))?;
        let mcp_http = crate::mcp_client::http_client(&egress)?;
        let tools = &settings.tools;
        let workspace_root = &settings.workspace.root;
        let workspaces = crate::workspace::Workspaces::open(
            workspace_root,
            sandbox.as_ref().and_then(|s| s.owner()),
        )
        .with_context(|| {
            format!(
                "cannot open the workspace root {}",
                workspace_root.display()
            )
        })?;
        let workspaces = Arc::new(workspaces);
        let quotas = Arc::new(crate::quotas::Quotas::new(
            settings.quotas.clone(),
            cluster.is_some(),
            store.clone(),
            workspaces.clone(),
        ));
        let (gateway, _) = Actor::spawn_linked(
            None,
            LlmGateway,
            GatewayArgs {
                settings: settings.clone(),
                budgets: crate::llm::Budgets::new(store.clone()),
                metrics: metrics.clone(),
                quotas: quotas.clone(),
                persistence: Persistence::new(persistence.clone(), write_timeout),
            },
            root.get_cell(),
        )
        .await?;
        let tool_limits = ToolLimits {
            bash_timeout: Duration::from_millis(tools.bash_timeout_ms),
            bash_max_timeout: Duration::from_millis(tools.bash_max_timeout_ms),
            output_cap_bytes: tools.output_cap_bytes,
            max_output_bytes: settings.sandbox.max_output_bytes,
            search_max_results: tools.search_max_results,
            sandbox,
            network: Network::Off,
            workspaces,
        };
        let lifecycle = Lifecycle {
            root: root.get_cell(),
            shutdown: CancellationToken::new(),
        };
        let persistence = Persistence::new(persistence, write_timeout);
        let background = Arc::new(BackgroundTasks::default());
        // Before recovery: the turns it ends are told to the tenants' webhooks.
        let node_name = cluster
            .as_ref()
            .map_or_else(|| "local".to_owned(), |node| node.node_id.clone());
        let webhooks = Arc::new(
            crate::webhooks::Subscribers::load(&store, &settings.webhooks, &node_name).await?,
        );
        let handles = Arc::new(Handles {
            settings: settings.clone(),
            store: store.clone(),
            persistence: persistence.clone(),
            hub: hub.clone(),
            format,
            records: Arc::new(records::Stored(store.clone())),
            gateway: Gateway::new(gateway),
            registry: Registry::new(conversation::spawn),
            quotas: quotas.clone(),
            tool_limits: tool_limits.clone(),
            requests: RequestBroker::default(),
            background: background.clone(),
            metrics: metrics.clone(),
            mcp_http: mcp_http.clone(),
            cluster: cluster.clone(),
            lifecycle: lifecycle.clone(),
            webhooks: webhooks.clone(),
        });
        let report = recover(&handles).await?;
        retention::start(&settings, &persistence, &lifecycle);
        crate::webhooks::Dispatcher {
            store: store.clone(),
            persistence: persistence.clone(),
            egress: egress.clone(),
            settings: settings.webhooks.clone(),
            subscribers: webhooks.clone(),
            metrics: metrics.clone(),
            node: node_name,
        }
        .start(lifecycle.shutdown.clone())?;
        let runtime = Runtime {
            settings,
            store,
            persistence,
            hub,
            conversations: Conversations { handles },
            quotas,
            tool_limits,
            background,
            metrics,
            egress,
            mcp_http,
            cluster,
            lifecycle,
            webhooks,
            root,
        };
        Ok((runtime, report))
    }

    /// Graceful shutdown: no new LLM request or tool run starts; every running conversation
    /// interrupts its turn (running tools are killed and recorded as interrupted) and stops;
    /// then the tree stops. Bounded by `grace`.
    pub async fn shutdown(&self, grace: Duration) {
        self.lifecycle.shutdown.cancel();
        self.background.cancel_everything();
        let running = self.conversations.running();
        let stops = running.into_iter().map(|(_, live)| async move {
            live.cancel.stop_work();
            let _ = live.shutdown(grace).await;
        });
        let _ = tokio::time::timeout(grace, futures::future::join_all(stops)).await;
        // Let the last commits land before the persistence actor goes.
        self.root.stop_and_wait(None, Some(grace)).await.ok();
        // The next node to need one of our conversations takes it at once.
        if let Some(cluster) = &self.cluster
            && let Err(error) = self.store.leave(cluster.node()).await
        {
            tracing::warn!(node = %cluster.node_id, %error, "leases not released; they expire after the TTL");
        }
    }
}
