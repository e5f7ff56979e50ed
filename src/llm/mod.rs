//! The LLM gateway: the only code that talks to LLM backends (desi-gateway-design.md).
//!
//! One actor owns the backend client and a concurrency limit; each request runs in its own
//! task, so the actor's mailbox never waits on a backend. Text deltas go to clients live;
//! the complete reply, a classified failure, or the confirmation of an abort goes back to
//! the conversation tagged with the request it answers. No retries happen here: the state
//! machine owns them.

pub mod anthropic;
mod budget;

pub use budget::Budgets;
pub mod chunk;
pub mod events;
mod history;
mod http;
pub mod request;
mod stream;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_openai::config::OpenAIConfig;
use futures::StreamExt;
use futures::future::BoxFuture;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use secrecy::ExposeSecret;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use history::{HistoryHandle, new_history};
pub use http::ErrorLines;
pub use request::{RequestContext, system_prompt};
pub use stream::{Accumulator, stream_error};

use crate::config::{Provider, Settings};
use crate::metrics::Metrics;
use crate::notice::Notice;
use crate::state_machine::{ErrorKind, Event, LlmFailure, LlmReply, LlmRequestTag};

/// A failure as the gateway classifies it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: ErrorKind,
    pub message: String,
    pub retry_after_ms: Option<u64>,
}

impl Failure {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            retry_after_ms: None,
        }
    }

    fn into_event(self, request: LlmRequestTag) -> Event {
        Event::LlmError {
            request,
            error: LlmFailure {
                kind: self.kind,
                message: self.message,
                retry_after_ms: self.retry_after_ms,
            },
        }
    }
}

/// Where the answer to a request goes.
pub type ReplyTo = Arc<dyn Fn(Event) + Send + Sync>;

/// Where what a request streams goes as it comes (text and reasoning deltas).
pub type Deltas = Arc<dyn Fn(Notice<'_>) + Send + Sync>;

/// Where a request reads what its conversation's history does not hold: messages stored
/// while no request ran here, a history emptied over its memory budget, and the images of
/// user messages. The runtime hands its job the store's.
pub trait Records: Send + Sync + std::fmt::Debug {
    /// Messages with a sequence id above `after`, ascending.
    fn messages_after<'a>(
        &'a self,
        conversation_id: &'a str,
        after: i64,
    ) -> BoxFuture<'a, Result<Vec<crate::model::MessageRecord>, String>>;
    /// A user message's image: its media type and bytes.
    fn image<'a>(
        &'a self,
        conversation_id: &'a str,
        image_id: &'a str,
    ) -> BoxFuture<'a, Option<(String, Vec<u8>)>>;
}

/// One LLM step to run.
pub struct LlmJob {
    pub request: LlmRequestTag,
    pub tenant_id: String,
    pub conversation_id: String,
    pub cwd: String,
    pub model: String,
    pub system_prompt: Option<String>,
    pub is_sub_agent: bool,
    /// A sub-agent's grace turn: submit_result is the only tool offered.
    pub only_submit: bool,
    /// The summary request (context continuation): no tools are offered.
    pub summary: bool,
    pub reply: ReplyTo,
    /// Where the reply's deltas go as they stream.
    pub deltas: Deltas,
    /// Where messages and images the history does not hold are read.
    pub records: Arc<dyn Records>,
    pub cancel: CancellationToken,
    /// The turn's span, parent of the request's.
    pub span: tracing::Span,
    /// Commits with messages stored since the conversation's last LLM request, in order:
    /// the history is brought up to date from them instead of a database read.
    pub recent: Vec<Arc<crate::model::ConversationCommit>>,
    /// The sequence id of the conversation's last stored message.
    pub through: i64,
    /// The conversation's history, which the conversation keeps between its requests.
    pub history: HistoryHandle,
    /// The conversation's own token budget and its tokens so far.
    pub budget: Option<(u64, u64)>,
    /// Its tenant's MCP tools, offered with the built-in ones.
    pub mcp_tools: Arc<Vec<crate::model::McpTool>>,
    /// The built-in tools its agent allows (`None`: all of them).
    pub tools: Option<Vec<String>>,
    /// The tools its client runs.
    pub client_tools: Arc<Vec<crate::model::ClientTool>>,
}

impl std::fmt::Debug for LlmJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmJob")
            .field("request", &self.request)
            .field("conversation_id", &self.conversation_id)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub enum GatewayMsg {
    Request(Box<LlmJob>),
}

/// The backend client, with our HTTP layer under it. Built once: building one loads the
/// system's root certificates.
type Backend = async_openai::Client<OpenAIConfig>;

tokio::task_local! {
    /// What the HTTP layer learns about the request of the current task.
    static PROBE: Arc<http::Probe>;
}

/// What every request task shares.
struct Shared {
    settings: Arc<Settings>,
    metrics: Arc<Metrics>,
    budgets: Budgets,
    backend: Backend,
    /// The same HTTP client, for Anthropic's API (anthropic.rs).
    http: reqwest::Client,
    permits: Arc<Semaphore>,
    /// Each tenant's share of the permits.
    quotas: Arc<crate::quotas::Quotas>,
    /// Writes the usage of responses with the group commit.
    persistence: crate::persistence::Persistence,
    /// The bytes every conversation's history holds, against `llm.history_cache_bytes`.
    held: Arc<history::Held>,
}

#[derive(Debug)]
pub struct LlmGateway;

#[derive(Debug)]
pub struct GatewayArgs {
    pub settings: Arc<Settings>,
    /// Token budgets: reserved in the database before each request.
    pub budgets: Budgets,
    pub metrics: Arc<Metrics>,
    pub quotas: Arc<crate::quotas::Quotas>,
    /// Where the usage of responses is written, with the group commit.
    pub persistence: crate::persistence::Persistence,
}

pub struct GatewayState {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for GatewayState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewayState").finish_non_exhaustive()
    }
}

impl Actor for LlmGateway {
    type Msg = GatewayMsg;
    type State = GatewayState;
    type Arguments = GatewayArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: GatewayArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let llm = &args.settings.llm;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(llm.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_secs(90))
            .build()?;
        let config = OpenAIConfig::new()
            .with_api_base(llm.base_url.trim_end_matches('/'))
            .with_api_key(llm.api_key.expose_secret());
        let limits = http::HttpLimits {
            first_byte: Duration::from_millis(llm.first_byte_timeout_ms),
            idle: Duration::from_millis(llm.idle_timeout_ms),
            max_response_bytes: llm.max_response_bytes,
        };
        let client = http.clone();
        let service = tower::service_fn(move |factory| {
            // Every request runs inside `PROBE.scope`; outside one, nothing is learnt.
            let probe = PROBE.try_with(Arc::clone).unwrap_or_default();
            http::execute(client.clone(), factory, limits, probe)
        });
        let backend = async_openai::Client::with_config(config).with_http_service(service);
        let permits = Arc::new(Semaphore::new(llm.max_concurrency));
        let held = history::Held::new(llm.history_cache_bytes);
        Ok(GatewayState {
            shared: Arc::new(Shared {
                settings: args.settings,
                metrics: args.metrics,
                budgets: args.budgets,
                backend,
                http,
                permits,
                quotas: args.quotas,
                persistence: args.persistence,
                held,
            }),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            GatewayMsg::Request(job) => {
                let shared = state.shared.clone();
                // Boxed: a task's future is copied as the task is made and again as it
                // ends, and a job's is some 4 KB (issue 41).
                tokio::spawn(Box::pin(run_job(shared, *job)));
            }
        }
        Ok(())
    }
}

/// Runs one job and answers it exactly once, whatever happens (a panic included).
async fn run_job(shared: Arc<Shared>, job: LlmJob) {
    let span = tracing::info_span!(
        target: crate::telemetry::STEP,
        parent: job.span.id(),
        "llm.request",
        tenant = %job.tenant_id,
        conversation = %job.conversation_id,
        model = %job.model,
        step = job.request.step,
        attempt = job.request.attempt,
        input_tokens = tracing::field::Empty,
        output_tokens = tracing::field::Empty,
        ttft_ms = tracing::field::Empty,
        cache_read_tokens = tracing::field::Empty,
        cache_write_tokens = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let request = job.request.clone();
    let reply = job.reply.clone();
    let cancel = job.cancel.clone();
    let metrics = shared.metrics.clone();
    let (tenant, model) = (job.tenant_id.clone(), job.model.clone());
    let started = Instant::now();
    // The call runs in this task, its panic caught here (issue 41: no second task a request).
    let mut tokens = None;
    let work = crate::crash::caught(Box::pin(call(&shared, &job).instrument(span.clone())));
    let (event, outcome) = tokio::select! {
        biased;
        // Dropping the call as the select ends releases the HTTP connection at once (its
        // drops, the budget's hold and the permits, do not panic: nothing catches them).
        () = cancel.cancelled() => (Event::LlmAborted { request }, "aborted"),
        joined = work => match joined {
            Ok(Ok(reply)) => {
                tokens = Some((reply.usage.input_tokens, reply.usage.output_tokens));
                metrics.tokens(&tenant, &model, "input", reply.usage.input_tokens);
                metrics.tokens(&tenant, &model, "output", reply.usage.output_tokens);
                (Event::LlmResponse { request, reply }, "ok")
            }
            Ok(Err(failure)) => {
                let kind = failure.kind.as_str();
                (failure.into_event(request), kind)
            }
            Err(panic) => (
                Failure::new(ErrorKind::Unknown, format!("the gateway task crashed: {panic}")).into_event(request),
                "crashed",
            ),
        },
    };
    // One record for all: each makes the log's layer write the span's fields again.
    match tokens {
        Some((input, output)) => {
            tracing::record_all!(
                span,
                input_tokens = input,
                output_tokens = output,
                outcome = outcome
            );
        }
        None => {
            span.record("outcome", outcome);
        }
    }
    metrics.llm_request(outcome, started.elapsed().as_secs_f64());
    reply(event);
}

async fn call(shared: &Shared, job: &LlmJob) -> Result<LlmReply, Failure> {
    let settings = &shared.settings;
    let llm = &settings.llm;
    let model_settings = settings.model(&job.model);
    let provider = model_settings.provider;
    if let Some(failure) = missing_key(settings, &job.model, provider) {
        return Err(failure);
    }
    // The tenant's share first, so a tenant that floods the node waits behind its own
    // requests and holds no more than its share of the node's slots.
    let _tenant_permit = shared.quotas.llm_slot(&job.tenant_id).await;
    let _permit = shared
        .permits
        .acquire()
        .await
        .map_err(|_| Failure::new(ErrorKind::Unknown, "the gateway is shutting down"))?;
    // Budgets before anything is sent, once the request may go (docs/api.md, "Budgets and
    // limits"): a request waiting for a slot holds none of the budget.
    let mut budget = budget::reserve(shared, job, model_settings.max_output_tokens).await?;
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(llm.total_timeout_ms);

    let mut history = history::current(
        &job.history,
        &shared.held,
        &*job.records,
        &shared.metrics,
        &job.conversation_id,
        &job.recent,
        job.through,
        provider,
    )
    .await
    .map_err(|e| {
        Failure::new(
            ErrorKind::Network,
            format!("cannot read the conversation's history: {e}"),
        )
    })?;
    let images = images_of(job, &history.messages).await;
    let ctx = RequestContext {
        model: &job.model,
        cwd: &job.cwd,
        system_prompt: job.system_prompt.as_deref(),
        is_sub_agent: job.is_sub_agent,
        only_submit: job.only_submit,
        no_tools: job.summary,
        mcp_tools: &job.mcp_tools,
        tools: job.tools.as_deref(),
        client_tools: &job.client_tools,
        max_output_tokens: model_settings.max_output_tokens,
        echo_reasoning: model_settings.echo_reasoning,
    };
    let encoding = |e: serde_json::Error| {
        Failure::new(
            ErrorKind::InvalidRequest,
            format!("cannot encode the request: {e}"),
        )
    };
    let too_big = |size: usize| {
        (size > llm.max_request_bytes).then(|| {
            Failure::new(
                ErrorKind::Limit,
                format!(
                    "the request is {size} bytes, over the limit of {} bytes",
                    llm.max_request_bytes
                ),
            )
        })
    };
    let loader = |id: &str| images.get(id).cloned();
    let reply = match provider {
        Provider::Openai => {
            let converted = request::images(&history.messages, &loader).map_err(encoding)?;
            drop(images);
            let body = request::body(&ctx, &history.messages, history.turn_from, &converted)
                .map_err(encoding)?;
            // Counted only where the bound from its pieces' lengths might be over.
            if body.size_at_most() > llm.max_request_bytes
                && let Some(failure) = too_big(body.size().map_err(encoding)?)
            {
                return Err(failure);
            }
            let probe = Arc::new(http::Probe::default());
            PROBE
                .scope(
                    probe.clone(),
                    stream_reply(shared, job, &body, deadline, started, probe),
                )
                .await
        }
        Provider::Anthropic => {
            let converted = anthropic::images(&history.messages, &loader).map_err(encoding)?;
            drop(images);
            let body = anthropic::body(&ctx, &history.messages, &converted).map_err(encoding)?;
            if let Some(failure) = too_big(request::json_size(&body).map_err(encoding)?) {
                return Err(failure);
            }
            anthropic::stream_reply(shared, job, &body, deadline, started).await
        }
    };
    history::settle(&mut history, &shared.held);
    if let Ok(reply) = &reply {
        budget.settle(reply.usage);
    }
    reply
}

/// A backend that needs a key and has none configured: the request fails at once, saying
/// which setting to give.
fn missing_key(settings: &Settings, model: &str, provider: Provider) -> Option<Failure> {
    match provider {
        Provider::Openai
            if settings.llm.api_key.expose_secret().is_empty()
                && settings.llm.base_url.contains("api.openai.com") =>
        {
            Some(Failure::new(
                ErrorKind::Auth,
                "no LLM API key is configured: set BEDROCK_LLM_API_KEY (or OPENAI_API_KEY), or point BEDROCK_LLM_BASE_URL at a backend that needs none",
            ))
        }
        Provider::Anthropic
            if settings.anthropic.api_key.expose_secret().is_empty()
                && settings.anthropic.base_url.contains("api.anthropic.com") =>
        {
            Some(Failure::new(
                ErrorKind::Auth,
                format!(
                    "model {model} is served by Anthropic's API and no key is configured for it: set ANTHROPIC_API_KEY (or BEDROCK_ANTHROPIC__API_KEY)"
                ),
            ))
        }
        Provider::Openai | Provider::Anthropic => None,
    }
}

/// The images of the history's user messages, by id, read through the job's records (one
/// that cannot be read is left out).
async fn images_of(job: &LlmJob, history: &[request::Wire]) -> HashMap<String, (String, Vec<u8>)> {
    let mut images = HashMap::new();
    for message in history {
        if let request::Wire::Images(crate::state_machine::MessageContent::User {
            images: refs,
            ..
        }) = message
        {
            for image in refs {
                if let Some(found) = job.records.image(&job.conversation_id, &image.id).await {
                    images.insert(image.id.clone(), found);
                }
            }
        }
    }
    images
}

/// Sends `request` and accumulates the streamed reply, forwarding text deltas live. The body
/// is serialised once, into the request async-openai sends.
async fn stream_reply(
    shared: &Shared,
    job: &LlmJob,
    request: &request::Body<'_>,
    deadline: tokio::time::Instant,
    started: Instant,
    probe: Arc<http::Probe>,
) -> Result<LlmReply, Failure> {
    let llm = &shared.settings.llm;
    let total_limit = || {
        Failure::new(
            ErrorKind::Network,
            format!(
                "the request took longer than the limit of {} ms",
                llm.total_timeout_ms
            ),
        )
    };
    let chat = shared.backend.chat();
    // Chunks are read into the gateway's own tolerant type (chunk.rs), not async-openai's.
    let mut stream = tokio::time::timeout_at(
        deadline,
        chat.create_stream_byot::<_, chunk::Chunk>(request),
    )
    .await
    .map_err(|_| total_limit())?
    .map_err(|e| http::classify(&e, &probe))?;
    let mut accumulator = Accumulator::new(llm.max_tool_args_bytes, generated_ids(&job.request));
    let mut first_token = None;
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => return Err(total_limit()),
            Ok(None) => break,
            // One chunk that cannot be read at all is skipped: the reply fails only if what
            // is left is not a complete answer.
            Ok(Some(Err(async_openai::error::OpenAIError::JSONDeserialize(error, content)))) => {
                shared.metrics.llm_chunk_skipped();
                tracing::warn!(
                    %error,
                    chunk = %crate::tools::preview(&content, 200),
                    "skipped a chunk of the LLM stream that could not be read"
                );
            }
            Ok(Some(Err(error))) => return Err(http::classify(&error, &probe)),
            Ok(Some(Ok(chunk))) => {
                let added = accumulator.push(chunk)?;
                forward(job, added, started, &mut first_token);
            }
        }
    }
    if let Some(failure) = probe.failure() {
        return Err(failure);
    }
    accumulator.finish(probe.saw_done())
}

/// Sends what a chunk added to the conversation's clients live (a `delta` frame), noting
/// the time to the first token on the request's span.
fn forward(job: &LlmJob, added: stream::Added, started: Instant, first_token: &mut Option<u64>) {
    if added.text.is_none() && added.reasoning.is_none() {
        return;
    }
    if first_token.is_none() {
        let ms = started.elapsed().as_millis() as u64;
        *first_token = Some(ms);
        tracing::Span::current().record("ttft_ms", ms);
    }
    (job.deltas)(Notice::Delta {
        text: added.text.as_deref().unwrap_or_default(),
        reasoning: added.reasoning.as_deref(),
    });
}

/// What the ids of tool calls that come without one are made from: the same for the same
/// request, different for every request of a conversation (its turn and step).
fn generated_ids(request: &LlmRequestTag) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("{}/{}", request.turn, request.step).as_bytes());
    format!("call_{}", &hex::encode(digest)[..16])
}

/// A cheap handle on the gateway actor.
#[derive(Clone, Debug)]
pub struct Gateway {
    actor: ActorRef<GatewayMsg>,
}

impl Gateway {
    pub fn new(actor: ActorRef<GatewayMsg>) -> Self {
        Self { actor }
    }

    /// Starts `job`; its answer goes to `job.reply`.
    pub fn request(&self, job: LlmJob) {
        let reply = job.reply.clone();
        let request = job.request.clone();
        if self.actor.cast(GatewayMsg::Request(Box::new(job))).is_err() {
            reply(
                Failure::new(ErrorKind::Unknown, "the LLM gateway has stopped").into_event(request),
            );
        }
    }
}
