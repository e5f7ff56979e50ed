//! Settings: config/default.toml (built in), an optional file, then environment variables.
//!
//! Loaded once at start and passed down explicitly; nothing below reads the environment.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Format, Toml};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize, Serializer};

use crate::state_machine::TurnLimits;

/// The built-in defaults; also the documentation of every setting.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub database: DatabaseSettings,
    pub data: DataSettings,
    pub workspace: WorkspaceSettings,
    pub llm: LlmSettings,
    /// Anthropic's Messages API, for the models whose provider is `anthropic`.
    pub anthropic: AnthropicSettings,
    pub models: BTreeMap<String, ModelOverrides>,
    pub turn: TurnSettings,
    pub tools: ToolSettings,
    pub sub_agents: SubAgentSettings,
    pub requests: RequestSettings,
    /// Bedrock's own MCP endpoint, `/mcp`.
    pub mcp: McpSettings,
    pub conversations: ConversationSettings,
    pub budgets: BudgetSettings,
    pub rate_limits: RateLimitSettings,
    pub quotas: QuotaSettings,
    pub events: EventSettings,
    pub sandbox: SandboxSettings,
    pub cluster: ClusterSettings,
    pub egress: EgressSettings,
    pub metrics: MetricsSettings,
    pub webhooks: WebhookSettings,
    pub schedules: ScheduleSettings,
}

/// Tenants' schedules (docs/api.md, "Schedules"): how often each node looks for due
/// firings, how long its claim on one lasts, and when a firing counts as missed.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSettings {
    pub poll_ms: u64,
    /// A node's claim on a firing; one it did not finish (it died) is taken over after it.
    pub claim_ms: u64,
    /// A firing found more than this late (no node ran) is missed: `catch_up` decides.
    pub late_ms: u64,
    /// Schedules claimed at once by a node.
    pub batch: u64,
    /// Finished runs are kept this long, then removed.
    pub keep_runs_ms: u64,
}

/// Tenants' webhooks (docs/api.md, "Webhooks"): how their deliveries are made and retried.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSettings {
    /// How often a node looks for events and due deliveries (it also looks at once after a
    /// commit of its own wrote some).
    pub poll_ms: u64,
    /// An attempt's time to answer.
    pub timeout_ms: u64,
    /// The first retry's delay; each doubles it (with jitter), up to `retry_max_delay_ms`.
    pub retry_initial_ms: u64,
    pub retry_max_delay_ms: u64,
    /// How long a delivery is retried before it fails for good.
    pub retry_for_ms: u64,
    /// An endpoint whose every attempt failed for this long is disabled.
    pub disable_after_ms: u64,
    /// How long a node's claim on a delivery lasts (a dead node's runs out).
    pub claim_ms: u64,
    /// Attempts in flight on a node, and of one tenant.
    pub concurrency: usize,
    pub per_tenant: usize,
    /// After a rotation, the old secret signs beside the new one this long.
    pub rotation_overlap_ms: u64,
    /// Finished deliveries (succeeded or failed) are kept this long, then removed.
    pub keep_ms: u64,
}

/// What the server may connect to on a tenant's behalf (tenants' MCP servers): everything
/// public, and the internal addresses and names listed here (src/egress.rs).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EgressSettings {
    /// CIDRs (`10.1.0.0/16`), addresses, host names (`mcp.internal`) and `*.suffix` names
    /// allowed although internal.
    pub allow: Vec<String>,
}

/// Several nodes on one Postgres (docs/operations.md, "Scaling"). SQLite is one node.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettings {
    /// This node's id; `""` makes one at start.
    pub node_id: String,
    /// The base URL other nodes reach this node's API on; `""` is `http://` and the
    /// listen address.
    pub advertise: String,
    /// How long a node's leases last without a heartbeat, in milliseconds.
    pub lease_ttl_ms: u64,
    /// How often a node renews its leases (one statement for all of them).
    pub heartbeat_ms: u64,
}

/// Durable frames, kept for clients that reconnect (docs/api.md, "Resuming").
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EventSettings {
    /// How long frames are kept, e.g. `"7d"` or `"12h"`; `""` keeps them forever. Messages
    /// are always kept: a resume from before the window gets them instead of the frames.
    pub retain: String,
}

impl EventSettings {
    /// The retention window; `None` keeps frames forever.
    pub fn retention(&self) -> Option<Duration> {
        let retain = self.retain.trim();
        (!retain.is_empty())
            .then(|| humantime::parse_duration(retain).ok())
            .flatten()
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RequestSettings {
    pub confirm_timeout_ms: u64,
    pub prompt_timeout_ms: u64,
    pub select_timeout_ms: u64,
    pub custom_timeout_ms: u64,
    pub approval_timeout_ms: u64,
    /// How long a call of a client tool waits for the client's answer, when the tool sets
    /// no `timeout_ms` of its own.
    pub client_tool_timeout_ms: u64,
    /// The longest timeout a request may have: what the model asks for (`ask_user`'s
    /// `timeout_ms`) is cut to it, and the defaults above may not pass it.
    pub max_timeout_ms: u64,
}

impl RequestSettings {
    /// The default timeout of a request of `kind`.
    pub fn timeout(&self, kind: &str) -> Duration {
        Duration::from_millis(match kind {
            "confirm" => self.confirm_timeout_ms,
            "prompt" => self.prompt_timeout_ms,
            "select" => self.select_timeout_ms,
            _ => self.custom_timeout_ms,
        })
    }

    /// The longest timeout a request may have.
    pub fn max_timeout(&self) -> Duration {
        Duration::from_millis(self.max_timeout_ms)
    }
}

/// Bedrock's own MCP endpoint (`/mcp`, docs/api.md "MCP"). On the 2026-07-28 protocol a
/// `send_message` whose turn asks the client something answers with an input-required result
/// and keeps a round in the node's memory until the client retries; these cap the rounds
/// kept. Past a cap the oldest round (of the key, of the tenant, of the node) is dropped.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct McpSettings {
    /// Rounds one API key may leave waiting.
    pub rounds_per_key: u64,
    /// Rounds one tenant's keys may leave waiting together.
    pub rounds_per_tenant: u64,
    /// Rounds the node keeps in all.
    pub rounds_per_node: u64,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AuthMode {
    Required,
    Dev,
    Auto,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    pub listen: SocketAddr,
    pub auth: AuthMode,
    pub shutdown_grace_ms: u64,
    pub max_body_bytes: usize,
    pub max_text_bytes: usize,
    pub max_images_per_message: usize,
    pub max_ws_frame_bytes: usize,
    pub client_lag_frames: usize,
    /// How long a client has to send a request's head (request line and headers), from the
    /// connection's accept or from the moment a kept-alive connection waits for its next
    /// request.
    pub header_read_timeout_ms: u64,
    /// How long a client has to send a request's whole body, from the end of its head.
    pub body_read_timeout_ms: u64,
    /// How long a connection with no request in flight stays open (keep-alive).
    pub keep_alive_timeout_ms: u64,
    /// Open client connections (WebSockets included); more are closed at accept. 0: derived
    /// from the open-file limit (see [`ServerSettings::connection_cap`]).
    pub max_connections: usize,
    /// A WebSocket that has sent nothing for this long is sent a ping.
    pub ws_ping_interval_ms: u64,
    /// A WebSocket that has sent nothing (no frame, no pong) for this long is closed.
    pub ws_idle_timeout_ms: u64,
    /// Browser origins, besides the server's own, allowed to open WebSockets and call /mcp
    /// (`scheme://host[:port]`).
    pub allowed_origins: Vec<String>,
    /// The host name (optionally `host:port`) clients reach this server by, besides
    /// loopback names: in dev mode any other `Host` is refused (DNS rebinding).
    pub public_host: String,
    /// How long a verified API key is trusted without asking the database again: a revoked
    /// key is refused on every node within this bound.
    pub key_cache_ms: u64,
}

impl ServerSettings {
    /// The cap on open client connections: `max_connections`, or when that is 0 the
    /// open-file limit `nofile` less room for everything else the process opens (the
    /// database pool, LLM and MCP connections, tool pipes, log and database files): a fifth
    /// of the limit, and at least 256 plus the pool and LLM concurrency.
    pub fn connection_cap(&self, nofile: u64, database: u32, llm: usize) -> usize {
        if self.max_connections > 0 {
            return self.max_connections;
        }
        let reserve = (nofile / 5).max(256 + u64::from(database) + llm as u64);
        let cap = nofile.saturating_sub(reserve).max(nofile / 2).max(1);
        usize::try_from(cap).unwrap_or(usize::MAX)
    }
}

/// The operator's listener: metrics and the detailed status, apart from the public API.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsSettings {
    /// The address of the operator listener (`GET /metrics`, `GET /status`); `""` or
    /// `"off"`: none.
    pub listen: String,
    /// The token of the admin API on the operator listener (`Authorization: Bearer`); `""`:
    /// no admin API.
    #[serde(serialize_with = "masked")]
    pub admin_token: SecretString,
}

impl MetricsSettings {
    /// The operator listener's address, if it is on.
    pub fn address(&self) -> Result<Option<SocketAddr>, ConfigError> {
        let listen = self.listen.trim();
        if listen.is_empty() || listen.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        listen.parse().map(Some).map_err(|e| {
            ConfigError(format!(
                "metrics.listen must be an address such as 127.0.0.1:9464, \"\" or \"off\", got {listen:?}: {e}"
            ))
        })
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    #[serde(serialize_with = "masked_url")]
    pub url: SecretString,
    pub max_connections: u32,
    pub acquire_timeout_ms: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataSettings {
    pub dir: PathBuf,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkspaceSettings {
    pub root: PathBuf,
    /// The most bytes of files a fork copies from its source's workspace (413 beyond).
    pub fork_max_bytes: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LlmSettings {
    pub base_url: String,
    #[serde(serialize_with = "masked")]
    pub api_key: SecretString,
    pub model: String,
    pub max_concurrency: usize,
    pub connect_timeout_ms: u64,
    pub first_byte_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub total_timeout_ms: u64,
    pub max_request_bytes: usize,
    pub max_response_bytes: usize,
    pub max_tool_args_bytes: usize,
    /// The bytes all activated conversations' LLM histories may hold together.
    pub history_cache_bytes: usize,
}

/// The API a model is reached through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Provider {
    /// OpenAI's chat completions, as `[llm]` configures it (and every compatible server).
    #[default]
    Openai,
    /// Anthropic's Messages API, as `[anthropic]` configures it.
    Anthropic,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AnthropicSettings {
    pub base_url: String,
    #[serde(serialize_with = "masked")]
    pub api_key: SecretString,
}

/// A model's section: each field overrides `[models.default]` when set.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelOverrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_image_px: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub echo_reasoning: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<Provider>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuation_threshold: Option<f64>,
}

/// The settings of one model, defaults applied.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelSettings {
    pub context_window: u64,
    pub max_output_tokens: u32,
    pub max_image_px: u32,
    /// Send the model's reasoning back, in the field the backend streamed it in, with the
    /// assistant messages of the turn in progress (docs/backends.md).
    pub echo_reasoning: bool,
    pub provider: Provider,
    /// The share of the context window at which the conversation is summarised and must
    /// go on in a new one (0: never).
    pub continuation_threshold: f64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TurnSettings {
    pub max_llm_steps: u32,
    pub max_tool_calls: u32,
    pub max_sub_agents: u32,
    /// Messages that may wait in a busy conversation (`if_busy=enqueue` and `steer`).
    pub max_queued: u32,
    /// Their text, in bytes, all together: they are stored with the conversation's state,
    /// which every step of the running turn writes again.
    pub max_queued_bytes: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSettings {
    pub bash_timeout_ms: u64,
    pub bash_max_timeout_ms: u64,
    pub output_cap_bytes: usize,
    pub search_max_results: usize,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SubAgentSettings {
    /// A sub-agent's wall time before its grace turn: the default and the most a
    /// spawn_sub_agents task may ask for (`timeout_ms`).
    pub timeout_ms: u64,
    /// A sub-agent's LLM steps before its grace turn: the default and the most a task may
    /// ask for (`max_steps`).
    pub max_steps: u32,
    /// How long the grace turn may take before the sub-agent fails.
    pub grace_ms: u64,
}

/// The period a token budget counts over; it resets at its start (UTC).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BudgetPeriod {
    Day,
    #[default]
    Month,
}

impl BudgetPeriod {
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetPeriod::Day => "day",
            BudgetPeriod::Month => "month",
        }
    }

    pub fn parse(text: &str) -> Option<BudgetPeriod> {
        match text {
            "day" => Some(BudgetPeriod::Day),
            "month" => Some(BudgetPeriod::Month),
            _ => None,
        }
    }
}

/// Every tenant's token budget, unless `bedrock tenant budget` gave it its own.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSettings {
    /// Tokens (input and output) per period; 0: no budget.
    pub tenant_tokens: u64,
    pub period: BudgetPeriod,
}

/// Requests per API key, as a token bucket, unless `bedrock tenant rate` gave the tenant
/// its own; WebSocket client frames count too.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitSettings {
    /// The sustained rate; 0: no limit.
    pub per_second: f64,
    /// How many may come at once after a quiet spell.
    pub burst: u32,
}

/// What one tenant may hold of a node, unless `bedrock tenant quota` gave it its own
/// (docs/security.md, "Quotas"). Each must be at least 1.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaSettings {
    /// Conversations the tenant has (sub-agents not counted).
    pub conversations: u64,
    /// Turns running at once (top-level conversations not at rest), per node.
    pub concurrent_turns: u64,
    /// Tool processes (bash runs, background tasks included) at once, per node; more wait
    /// their turn behind the tenant's own.
    pub tool_processes: u64,
    /// Background tasks running at once.
    pub background_tasks: u64,
    /// Open WebSocket and SSE streams, per node.
    pub streams: u64,
    /// Registered MCP servers.
    pub mcp_servers: u64,
    /// Agents (not deleted).
    pub agents: u64,
    /// Webhook endpoints (POST /v1/webhooks).
    pub webhooks: u64,
    /// Schedules (POST /v1/schedules).
    pub schedules: u64,
    /// LLM requests in flight at once, per node (its share of `llm.max_concurrency`); more
    /// wait their turn behind the tenant's own.
    pub llm_concurrency: u64,
    /// Bytes in the tenant's workspace, measured at most every `measure_every_ms`.
    pub workspace_bytes: u64,
    pub measure_every_ms: u64,
    /// How long a tenant's own quotas are cached before they are read again.
    pub cache_ms: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConversationSettings {
    pub idle_timeout_ms: u64,
}

/// Whether tool processes run confined (docs/security.md).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SandboxMode {
    /// Confined; `bedrock serve` refuses to start where the kernel cannot do it.
    Enforce,
    /// Not confined: tools see what the server sees. A warning at start and in /readyz.
    Off,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSettings {
    pub mode: SandboxMode,
    /// Where the sandbox keeps its mount point and the private temp dirs; empty: <data.dir>/sandbox.
    pub dir: PathBuf,
    /// The user and group tool processes run as when the server runs as root.
    pub uid: u32,
    pub gid: u32,
    /// Read-only (and executable) paths of the host a tool sees; missing ones are skipped.
    pub read_only_paths: Vec<PathBuf>,
    /// Paths under those that a tool never sees (each reads as empty).
    pub hidden_paths: Vec<PathBuf>,
    /// Variables of the server's environment passed through to tool processes.
    pub env_passthrough: Vec<String>,
    /// Limits of every tool process (the process count is per tool run).
    pub cpu_seconds: u64,
    pub address_space_bytes: u64,
    pub max_processes: u64,
    pub max_open_files: u64,
    pub max_file_bytes: u64,
    /// Output past this ends the run as failed (what is kept is `tools.output_cap_bytes`).
    pub max_output_bytes: u64,
    /// CPU priority (nice value, 0-19) of tool processes, below the server's.
    pub nice: i32,
    /// Tool processes run in the kernel's idle scheduling class (`SCHED_IDLE`).
    pub idle_scheduling: bool,
    pub network: NetworkSettings,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSettings {
    /// Tenants whose tool processes have network access in every conversation.
    pub tenants: Vec<String>,
    /// Tenants that may turn it on per conversation (`"network": true` at creation).
    pub per_conversation_tenants: Vec<String>,
    /// With network on, the TCP ports a tool may connect to (never the server's or the
    /// database's).
    pub tcp_ports: Vec<u16>,
}

impl SandboxSettings {
    /// The sandbox's own directory.
    pub fn dir(&self, data: &DataSettings) -> PathBuf {
        if self.dir.as_os_str().is_empty() {
            data.dir.join("sandbox")
        } else {
            self.dir.clone()
        }
    }
}

/// A setting that cannot be used; the message names it and the expected form.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

/// The contract's variables, and the settings they set.
const NAMED_VARIABLES: [(&str, &str); 8] = [
    ("LISTEN", "server.listen"),
    ("AUTH", "server.auth"),
    ("DATABASE_URL", "database.url"),
    ("DATA_DIR", "data.dir"),
    ("WORKSPACE_ROOT", "workspace.root"),
    ("LLM_BASE_URL", "llm.base_url"),
    ("LLM_API_KEY", "llm.api_key"),
    ("MODEL", "llm.model"),
];

/// A variable's value, parsed leniently like figment's Env provider: "7" is a number,
/// "true" a bool, "[a, b]" a list. Except a value with both a backslash and a non-ASCII
/// character, which is taken as it is: figment 0.10's unescaping indexes the text by
/// characters as if by bytes and panics on it (found by the `config` fuzz target).
fn env_value(value: &str) -> figment::value::Value {
    if value.contains('\\') && !value.is_ascii() {
        return figment::value::Value::from(value.to_owned());
    }
    value.parse().unwrap_or_else(|never| match never {})
}

impl Settings {
    /// Loads the layers from the process environment.
    pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
        Self::load_from(file, std::env::vars())
    }

    /// Loads the layers with the given environment (tests pass their own).
    pub fn load_from(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        let mut figment = Figment::from(Toml::string(DEFAULT_TOML));
        if let Some(file) = file {
            if !file.is_file() {
                return Err(ConfigError(format!(
                    "--config {}: no such file",
                    file.display()
                )));
            }
            figment = figment.merge(Toml::file_exact(file));
        }
        Self::layered(figment, env)
    }

    /// [`load_from`](Self::load_from) with the file's text given (the fuzz target `config`).
    pub fn load_from_toml(
        toml: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        let figment = Figment::from(Toml::string(DEFAULT_TOML)).merge(Toml::string(toml));
        Self::layered(figment, env)
    }

    /// The default and file layers, then the environment's, validated.
    fn layered(
        mut figment: Figment,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        let env: Vec<(String, String)> = env.into_iter().collect();
        // OPENAI_API_KEY and ANTHROPIC_API_KEY are read too, below BEDROCK_LLM_API_KEY and
        // BEDROCK_ANTHROPIC__API_KEY.
        if let Some((_, key)) = env.iter().find(|(name, _)| name == "OPENAI_API_KEY") {
            figment = figment.merge(("llm.api_key", key.clone()));
        }
        if let Some((_, key)) = env.iter().find(|(name, _)| name == "ANTHROPIC_API_KEY") {
            figment = figment.merge(("anthropic.api_key", key.clone()));
        }
        for (name, value) in &env {
            let Some(rest) = name.strip_prefix("BEDROCK_") else {
                continue;
            };
            let key = match NAMED_VARIABLES.iter().find(|(var, _)| *var == rest) {
                Some((_, key)) => (*key).to_owned(),
                None if rest.contains("__") => rest.to_ascii_lowercase().replace("__", "."),
                // Other BEDROCK_* variables (e.g. BEDROCK_TEST_DATABASE_URL) are not settings.
                None => continue,
            };
            let value = env_value(value);
            figment = figment.merge((key, value));
        }
        let settings: Settings = figment.extract().map_err(|e| ConfigError(describe(&e)))?;
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("server.max_body_bytes", self.server.max_body_bytes as u64),
            ("server.max_text_bytes", self.server.max_text_bytes as u64),
            (
                "server.max_ws_frame_bytes",
                self.server.max_ws_frame_bytes as u64,
            ),
            (
                "server.client_lag_frames",
                self.server.client_lag_frames as u64,
            ),
            (
                "database.max_connections",
                u64::from(self.database.max_connections),
            ),
            ("llm.max_concurrency", self.llm.max_concurrency as u64),
            ("requests.max_timeout_ms", self.requests.max_timeout_ms),
            ("mcp.rounds_per_key", self.mcp.rounds_per_key),
            ("mcp.rounds_per_tenant", self.mcp.rounds_per_tenant),
            ("mcp.rounds_per_node", self.mcp.rounds_per_node),
            ("quotas.conversations", self.quotas.conversations),
            ("quotas.concurrent_turns", self.quotas.concurrent_turns),
            ("quotas.tool_processes", self.quotas.tool_processes),
            ("quotas.background_tasks", self.quotas.background_tasks),
            ("quotas.streams", self.quotas.streams),
            ("quotas.mcp_servers", self.quotas.mcp_servers),
            ("quotas.agents", self.quotas.agents),
            ("quotas.webhooks", self.quotas.webhooks),
            ("quotas.schedules", self.quotas.schedules),
            ("schedules.poll_ms", self.schedules.poll_ms),
            ("schedules.claim_ms", self.schedules.claim_ms),
            ("schedules.late_ms", self.schedules.late_ms),
            ("schedules.batch", self.schedules.batch),
            ("schedules.keep_runs_ms", self.schedules.keep_runs_ms),
            ("webhooks.keep_ms", self.webhooks.keep_ms),
            ("webhooks.poll_ms", self.webhooks.poll_ms),
            ("webhooks.timeout_ms", self.webhooks.timeout_ms),
            ("webhooks.retry_initial_ms", self.webhooks.retry_initial_ms),
            (
                "webhooks.retry_max_delay_ms",
                self.webhooks.retry_max_delay_ms,
            ),
            ("webhooks.retry_for_ms", self.webhooks.retry_for_ms),
            ("webhooks.disable_after_ms", self.webhooks.disable_after_ms),
            ("webhooks.claim_ms", self.webhooks.claim_ms),
            ("webhooks.concurrency", self.webhooks.concurrency as u64),
            ("webhooks.per_tenant", self.webhooks.per_tenant as u64),
            ("quotas.llm_concurrency", self.quotas.llm_concurrency),
            ("quotas.workspace_bytes", self.quotas.workspace_bytes),
            ("quotas.measure_every_ms", self.quotas.measure_every_ms),
            ("llm.total_timeout_ms", self.llm.total_timeout_ms),
            ("llm.max_response_bytes", self.llm.max_response_bytes as u64),
            ("turn.max_llm_steps", u64::from(self.turn.max_llm_steps)),
            ("turn.max_tool_calls", u64::from(self.turn.max_tool_calls)),
            ("sub_agents.timeout_ms", self.sub_agents.timeout_ms),
            ("sub_agents.max_steps", u64::from(self.sub_agents.max_steps)),
            ("sub_agents.grace_ms", self.sub_agents.grace_ms),
            ("tools.bash_timeout_ms", self.tools.bash_timeout_ms),
            ("tools.output_cap_bytes", self.tools.output_cap_bytes as u64),
            (
                "conversations.idle_timeout_ms",
                self.conversations.idle_timeout_ms,
            ),
            ("cluster.lease_ttl_ms", self.cluster.lease_ttl_ms),
            ("cluster.heartbeat_ms", self.cluster.heartbeat_ms),
            (
                "server.header_read_timeout_ms",
                self.server.header_read_timeout_ms,
            ),
            (
                "server.body_read_timeout_ms",
                self.server.body_read_timeout_ms,
            ),
            (
                "server.keep_alive_timeout_ms",
                self.server.keep_alive_timeout_ms,
            ),
            (
                "server.ws_ping_interval_ms",
                self.server.ws_ping_interval_ms,
            ),
            ("server.ws_idle_timeout_ms", self.server.ws_idle_timeout_ms),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(ConfigError(format!(
                    "{name} must be a positive whole number"
                )));
            }
        }
        let retain = self.events.retain.trim();
        if !retain.is_empty() {
            match humantime::parse_duration(retain) {
                Ok(window) if !window.is_zero() => {}
                Ok(_) => {
                    return Err(ConfigError(
                        "events.retain must be longer than nothing (\"\" keeps frames forever)"
                            .into(),
                    ));
                }
                Err(e) => {
                    return Err(ConfigError(format!(
                        "events.retain must be a duration such as \"7d\" or \"12h\": {e}"
                    )));
                }
            }
        }
        let requests = &self.requests;
        for (name, value) in [
            ("confirm_timeout_ms", requests.confirm_timeout_ms),
            ("prompt_timeout_ms", requests.prompt_timeout_ms),
            ("select_timeout_ms", requests.select_timeout_ms),
            ("custom_timeout_ms", requests.custom_timeout_ms),
            ("approval_timeout_ms", requests.approval_timeout_ms),
            ("client_tool_timeout_ms", requests.client_tool_timeout_ms),
        ] {
            if value > requests.max_timeout_ms {
                return Err(ConfigError(format!(
                    "requests.{name} ({value}) must be at most requests.max_timeout_ms ({})",
                    requests.max_timeout_ms
                )));
            }
        }
        let hooks = &self.webhooks;
        if hooks.claim_ms <= hooks.timeout_ms {
            return Err(ConfigError(format!(
                "webhooks.claim_ms ({}) must be above webhooks.timeout_ms ({}): a claim must outlast its attempt",
                hooks.claim_ms, hooks.timeout_ms
            )));
        }
        for (name, value) in [
            ("retry_for_ms", hooks.retry_for_ms),
            ("disable_after_ms", hooks.disable_after_ms),
            ("rotation_overlap_ms", hooks.rotation_overlap_ms),
            ("retry_max_delay_ms", hooks.retry_max_delay_ms),
        ] {
            if value > 10 * 366 * 24 * 3600 * 1000 {
                return Err(ConfigError(format!(
                    "webhooks.{name} ({value}) must be at most ten years"
                )));
            }
        }
        // A timestamp a timeout away must stay a date (chrono's bound is some 292 million
        // years; a year is far more than any question waits).
        const YEAR_MS: u64 = 366 * 24 * 3600 * 1000;
        if requests.max_timeout_ms > YEAR_MS {
            return Err(ConfigError(format!(
                "requests.max_timeout_ms ({}) must be at most a year ({YEAR_MS})",
                requests.max_timeout_ms
            )));
        }
        if self.cluster.heartbeat_ms * 2 > self.cluster.lease_ttl_ms {
            return Err(ConfigError(format!(
                "cluster.heartbeat_ms ({}) must be at most half of cluster.lease_ttl_ms ({}): \
                 a lease must outlive a missed heartbeat",
                self.cluster.heartbeat_ms, self.cluster.lease_ttl_ms
            )));
        }
        let advertise = &self.cluster.advertise;
        if !(advertise.is_empty()
            || advertise.starts_with("http://")
            || advertise.starts_with("https://"))
        {
            return Err(ConfigError(format!(
                "cluster.advertise must be empty or an http:// or https:// URL, got {advertise:?}"
            )));
        }
        if self.cluster.node_id.len() > 128 {
            return Err(ConfigError(
                "cluster.node_id must be at most 128 bytes".into(),
            ));
        }
        if self.server.ws_idle_timeout_ms <= self.server.ws_ping_interval_ms {
            return Err(ConfigError(format!(
                "server.ws_idle_timeout_ms ({}) must be longer than server.ws_ping_interval_ms ({}): \
                 a client needs time to answer the ping",
                self.server.ws_idle_timeout_ms, self.server.ws_ping_interval_ms
            )));
        }
        for origin in &self.server.allowed_origins {
            if crate::origin::parse_origin(origin).is_none() {
                return Err(ConfigError(format!(
                    "server.allowed_origins: {origin:?} is not an origin such as \"https://app.example.com\" or \"http://localhost:3000\""
                )));
            }
        }
        let public = self.server.public_host.trim();
        if !public.is_empty() && crate::origin::parse_host(public).is_none() {
            return Err(ConfigError(format!(
                "server.public_host must be a host name, optionally with :port (e.g. \"bedrock.example.com\"), got {public:?}"
            )));
        }
        self.metrics.address()?;
        if !(0..=19).contains(&self.sandbox.nice) {
            return Err(ConfigError(format!(
                "sandbox.nice must be 0 to 19, got {}",
                self.sandbox.nice
            )));
        }
        let base = &self.llm.base_url;
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ConfigError(format!(
                "llm.base_url must be an http:// or https:// URL, got {base:?}"
            )));
        }
        let url = self.database.url.expose_secret();
        if !(url.is_empty()
            || url.starts_with("sqlite:")
            || url.starts_with("postgres://")
            || url.starts_with("postgresql://"))
        {
            return Err(ConfigError(
                "database.url must be empty, sqlite://PATH?mode=rwc or postgres://...".into(),
            ));
        }
        crate::egress::Egress::new(&self.egress.allow)
            .map_err(|e| ConfigError(format!("egress.allow: {e}")))?;
        if self.models.get("default").is_none_or(|d| {
            d.context_window.is_none() || d.max_output_tokens.is_none() || d.max_image_px.is_none()
        }) {
            return Err(ConfigError(
                "[models.default] must set context_window, max_output_tokens and max_image_px"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The database URL, with the embedded SQLite default applied.
    pub fn database_url(&self) -> String {
        let url = self.database.url.expose_secret();
        if url.is_empty() {
            format!(
                "sqlite://{}?mode=rwc",
                self.data.dir.join("bedrock.db").display()
            )
        } else {
            url.to_owned()
        }
    }

    /// The settings of `model`, with `[models.default]` filling what it does not set.
    pub fn model(&self, model: &str) -> ModelSettings {
        let default = self.models.get("default").cloned().unwrap_or_default();
        let own = self.models.get(model).cloned().unwrap_or_default();
        // A model without a section of its own gets the smallest window configured: the
        // safe guess.
        let smallest = self.models.values().filter_map(|m| m.context_window).min();
        let window = if self.models.contains_key(model) {
            own.context_window.or(default.context_window)
        } else {
            smallest
        };
        ModelSettings {
            context_window: window.unwrap_or(128_000),
            max_output_tokens: own
                .max_output_tokens
                .or(default.max_output_tokens)
                .unwrap_or(4096),
            max_image_px: own.max_image_px.or(default.max_image_px).unwrap_or(1568),
            echo_reasoning: own
                .echo_reasoning
                .or(default.echo_reasoning)
                .unwrap_or(true),
            provider: own.provider.or(default.provider).unwrap_or_default(),
            continuation_threshold: own
                .continuation_threshold
                .or(default.continuation_threshold)
                .unwrap_or(0.9),
        }
    }

    pub fn turn_limits(&self) -> TurnLimits {
        TurnLimits {
            max_llm_steps: self.turn.max_llm_steps,
            max_tool_calls: self.turn.max_tool_calls,
            max_sub_agents: self.turn.max_sub_agents,
            max_queued: self.turn.max_queued,
            max_queued_bytes: self.turn.max_queued_bytes,
            sub_agent_max_steps: self.sub_agents.max_steps,
            sub_agent_timeout_ms: self.sub_agents.timeout_ms,
        }
    }

    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.conversations.idle_timeout_ms)
    }

    /// The effective settings as TOML, with secrets masked (`bedrock config`).
    pub fn masked_toml(&self) -> String {
        let mut shown = self.clone();
        shown.database.url = SecretString::from(self.database_url());
        toml::to_string_pretty(&shown)
            .unwrap_or_else(|e| format!("# the settings could not be printed: {e}\n"))
    }
}

/// A secret as `********` (empty stays empty, so "not set" shows).
fn masked<S: Serializer>(secret: &SecretString, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(if secret.expose_secret().is_empty() {
        ""
    } else {
        "********"
    })
}

/// A database URL with its password, if any, masked: `postgres://user:********@host/db`.
fn masked_url<S: Serializer>(url: &SecretString, serializer: S) -> Result<S::Ok, S::Error> {
    let url = url.expose_secret();
    let shown = match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:********{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    };
    serializer.serialize_str(&shown)
}

/// A figment error as one sentence that names the setting.
fn describe(error: &figment::Error) -> String {
    error
        .clone()
        .into_iter()
        .map(|e| {
            let path = e.path.join(".");
            let source = e
                .metadata
                .as_ref()
                .map(|m| format!(" (from {})", m.name))
                .unwrap_or_default();
            if path.is_empty() {
                format!("{}{source}", e.kind)
            } else {
                format!("{path}: {}{source}", e.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzzing: a variable with a backslash after a non-ASCII character crashed
    /// the loader inside figment; it is now taken as it is.
    #[test]
    fn a_variable_with_escapes_and_non_ascii_text_loads() {
        let env = [(
            "BEDROCK_LLM__MODEL".to_owned(),
            "\"caf\u{e9}\\t\"".to_owned(),
        )];
        let settings = Settings::load_from(None, env).expect("it loads");
        assert_eq!(settings.llm.model, "\"caf\u{e9}\\t\"");
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_load_and_the_contract_variables_apply() {
        let settings = Settings::load_from(
            None,
            env(&[
                ("BEDROCK_LISTEN", "127.0.0.1:9999"),
                ("BEDROCK_DATABASE_URL", "postgres://u:secret@db/bedrock"),
                ("BEDROCK_LLM_BASE_URL", "http://127.0.0.1:11434/v1"),
                ("OPENAI_API_KEY", "from-openai"),
                ("BEDROCK_MODEL", "llama3"),
                ("BEDROCK_WORKSPACE_ROOT", "/srv/ws"),
                ("BEDROCK_AUTH", "required"),
                ("BEDROCK_TURN__MAX_TOOL_CALLS", "7"),
                ("BEDROCK_TEST_DATABASE_URL", "ignored"),
            ]),
        )
        .expect("valid settings");
        assert_eq!(settings.server.listen.port(), 9999);
        assert_eq!(settings.database_url(), "postgres://u:secret@db/bedrock");
        assert_eq!(settings.llm.base_url, "http://127.0.0.1:11434/v1");
        assert_eq!(settings.llm.api_key.expose_secret(), "from-openai");
        assert_eq!(settings.llm.model, "llama3");
        assert_eq!(settings.workspace.root, PathBuf::from("/srv/ws"));
        assert_eq!(settings.server.auth, AuthMode::Required);
        assert_eq!(settings.turn.max_tool_calls, 7);
        let shown = settings.masked_toml();
        assert!(!shown.contains("secret"), "{shown}");
        assert!(!shown.contains("from-openai"), "{shown}");
        assert!(
            shown.contains("postgres://u:********@db/bedrock"),
            "{shown}"
        );
    }

    #[test]
    fn bedrock_llm_api_key_wins_over_openai_api_key() {
        let settings = Settings::load_from(
            None,
            env(&[("OPENAI_API_KEY", "low"), ("BEDROCK_LLM_API_KEY", "high")]),
        )
        .expect("valid settings");
        assert_eq!(settings.llm.api_key.expose_secret(), "high");
        // Anthropic's key likewise, and the claude models are reached through it.
        let settings = Settings::load_from(None, env(&[("ANTHROPIC_API_KEY", "sk-ant")]))
            .expect("valid settings");
        assert_eq!(settings.anthropic.api_key.expose_secret(), "sk-ant");
        assert_eq!(
            settings.model("claude-sonnet-4-5").provider,
            Provider::Anthropic
        );
        assert_eq!(settings.model("gpt-4o").provider, Provider::Openai);
        let settings = Settings::load_from(
            None,
            env(&[
                ("ANTHROPIC_API_KEY", "low"),
                ("BEDROCK_ANTHROPIC__API_KEY", "high"),
            ]),
        )
        .expect("valid settings");
        assert_eq!(settings.anthropic.api_key.expose_secret(), "high");
    }

    #[test]
    fn a_bad_setting_names_itself_and_the_expected_form() {
        let error = Settings::load_from(None, env(&[("BEDROCK_LISTEN", "not an address")]))
            .expect_err("an invalid address");
        assert!(error.to_string().contains("server.listen"), "{error}");
        let error = Settings::load_from(None, env(&[("BEDROCK_TURN__MAX_LLM_STEPS", "0")]))
            .expect_err("zero steps");
        assert!(
            error
                .to_string()
                .contains("turn.max_llm_steps must be a positive"),
            "{error}"
        );
        let error = Settings::load_from(None, env(&[("BEDROCK_SANDBOX__NICE", "-5")]))
            .expect_err("a tool above the server's priority");
        assert!(
            error.to_string().contains("sandbox.nice must be 0 to 19"),
            "{error}"
        );
        let error = Settings::load_from(None, env(&[("BEDROCK_AUTH", "maybe")]))
            .expect_err("an unknown auth mode");
        assert!(error.to_string().contains("server.auth"), "{error}");
    }

    #[test]
    fn the_egress_allow_list_is_read_from_a_variable_and_checked() {
        assert!(
            Settings::load_from(None, env(&[]))
                .expect("valid settings")
                .egress
                .allow
                .is_empty()
        );
        let settings = Settings::load_from(
            None,
            env(&[(
                "BEDROCK_EGRESS__ALLOW",
                r#"["10.1.0.0/16", "mcp.internal", "fd00::/8"]"#,
            )]),
        )
        .expect("valid settings");
        assert_eq!(
            settings.egress.allow,
            ["10.1.0.0/16", "mcp.internal", "fd00::/8"]
        );
        let settings = Settings::load_from_toml("[egress]\nallow = [\"127.0.0.1\"]\n", env(&[]))
            .expect("valid settings");
        assert_eq!(settings.egress.allow, ["127.0.0.1"]);
        for bad in [r#"["10.1.0.0/33"]"#, r#"["not a host"]"#, r#"[""]"#] {
            let error =
                Settings::load_from(None, env(&[("BEDROCK_EGRESS__ALLOW", bad)])).expect_err(bad);
            assert!(error.to_string().contains("egress.allow"), "{error}");
        }
        let error = Settings::load_from(None, env(&[("BEDROCK_EGRESS__ALLOW", "10.0.0.0/8")]))
            .expect_err("not a list");
        assert!(error.to_string().contains("egress.allow"), "{error}");
    }

    #[test]
    fn models_inherit_the_default_section() {
        let settings = Settings::load_from(
            None,
            env(&[("BEDROCK_MODELS__TINY__CONTEXT_WINDOW", "4096")]),
        )
        .expect("valid settings");
        assert_eq!(settings.model("tiny").context_window, 4096);
        assert_eq!(settings.model("tiny").max_output_tokens, 4096);
        // A model without a section gets the smallest window configured (issue 25).
        assert_eq!(settings.model("unknown").context_window, 4096);
        assert_eq!(settings.model("unknown").continuation_threshold, 0.9);
        assert!(settings.database_url().starts_with("sqlite://"));
    }
}
