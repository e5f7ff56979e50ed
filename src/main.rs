//! The `bedrock` command line: serve, migrate, tenant create, config.

// A command line reports its failures on stderr.
#![allow(clippy::print_stderr)]

use std::path::PathBuf;

use anyhow::Context;
use bedrock::app::{
    Application, create_key, create_tenant, export_agent, import_agent, list_keys, list_schedules,
    open_store, revoke_key, set_tenant_budget, set_tenant_quotas, set_tenant_rate,
};
use bedrock::config::BudgetPeriod;
use bedrock::config::Settings;
use clap::{Parser, Subcommand};

/// The server allocates and frees many small objects across threads (frames, JSON, messages,
/// requests); mimalloc does that for a fraction of glibc malloc's CPU (docs/benchmarks.md).
/// The `system-allocator` feature leaves it out, for heap profilers that hook malloc.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "bedrock",
    version,
    about = "Runs LLM agent conversations as supervised actors"
)]
struct Cli {
    /// A TOML file of settings over config/default.toml (environment variables win).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve HTTP, WebSocket and SSE on BEDROCK_LISTEN (applies migrations first).
    Serve,
    /// Apply the database migrations.
    Migrate,
    /// Manage tenants.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// A tenant's agents as documents: export one, import one.
    Agent {
        #[command(subcommand)]
        command: AgentCommand,
    },
    /// Tenants' schedules, for operators.
    Schedule {
        #[command(subcommand)]
        command: ScheduleCommand,
    },
    /// Re-run stored conversations' steps through the core and compare every decision with
    /// the stored one (the replay log: docs/operations.md, "Upgrades"). Prints a JSON line
    /// per conversation that decides differently (its first divergent step, the event and
    /// both sides), then a summary on standard error; exits 1 on any divergence.
    Replay {
        /// A conversation's id.
        conversation: Option<String>,
        /// Every conversation with stored steps.
        #[arg(long)]
        all: bool,
        /// With --all: only conversations with steps stored since (RFC 3339, or a span
        /// back from now such as 24h).
        #[arg(long)]
        since: Option<String>,
        /// With --all: only this tenant's conversations (its name).
        #[arg(long)]
        tenant: Option<String>,
        /// A line for every conversation, also those that decide the same.
        #[arg(long, short)]
        verbose: bool,
        /// Tests only: replay with a deliberately changed decision (every tool result
        /// stored as its opposite), to show that a divergence is found.
        #[arg(long, hide = true)]
        test_changed_decision: bool,
    },
    /// Print the effective configuration, secrets masked.
    Config,
    /// Print the OpenAPI document of the API (what GET /openapi.json serves).
    Openapi,
}

#[derive(Debug, Subcommand)]
enum TenantCommand {
    /// Create a tenant; prints {"tenant_id", "api_key"} once.
    Create { name: String },
    /// Give a tenant its own token budget (input and output tokens per period), or
    /// `--default` to go back to [budgets] of the configuration; prints the budget.
    Budget {
        name: String,
        /// Tokens per period; 0: no budget for this tenant.
        #[arg(long, required_unless_present = "default")]
        tokens: Option<u64>,
        /// `day` or `month` (default: [budgets] period).
        #[arg(long, value_parser = ["day", "month"])]
        period: Option<String>,
        #[arg(long, conflicts_with_all = ["tokens", "period"])]
        default: bool,
    },
    /// Give a tenant its own request rate per API key, or `--default` to go back to
    /// [rate_limits] of the configuration.
    Rate {
        name: String,
        /// Requests per second, sustained; 0: no limit for this tenant.
        #[arg(long, required_unless_present = "default")]
        per_second: Option<f64>,
        /// Requests at once after a quiet spell (default: [rate_limits] burst).
        #[arg(long)]
        burst: Option<u32>,
        #[arg(long, conflicts_with_all = ["per_second", "burst"])]
        default: bool,
    },
    /// Give a tenant its own quotas (`tool_processes=4`), or `QUOTA=default` to go back to
    /// [quotas] of the configuration; prints the tenant's quotas. Quotas: conversations,
    /// concurrent_turns, tool_processes, background_tasks, streams, mcp_servers,
    /// llm_concurrency, workspace_bytes, agents. Servers apply a change within
    /// quotas.cache_ms.
    Quota {
        name: String,
        #[arg(value_name = "QUOTA=VALUE")]
        set: Vec<String>,
    },
    /// A tenant's API keys: create another, list them, revoke one.
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
}

#[derive(Debug, Subcommand)]
enum AgentCommand {
    /// Print the tenant's agent as one document (every version, or `--latest`), as
    /// GET /v1/agents/{name}/export gives it.
    Export {
        tenant: String,
        agent: String,
        #[arg(long)]
        latest: bool,
    },
    /// Make an agent of the tenant's from a document (a file, or `-` for standard input),
    /// as POST /v1/agents/import does; prints the versions made.
    Import {
        tenant: String,
        file: PathBuf,
        /// The name to import it as (default: the document's).
        #[arg(long = "as", value_name = "NAME")]
        as_name: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum ScheduleCommand {
    /// Every schedule (or one tenant's), a JSON object per line: its tenant, what it runs,
    /// when, whether it is enabled, its next and last firings, and its latest run.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum KeyCommand {
    /// A new key for the tenant; prints {"tenant_id", "key_id", "api_key"} once.
    Create { name: String },
    /// The tenant's keys: ids, prefixes, creation and revocation times (never the keys).
    List { name: String },
    /// Revoke a key, named by its id or prefix: every node refuses it (401) within
    /// server.key_cache_ms.
    Revoke { name: String, key: String },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("bedrock: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("bedrock: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command, settings)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bedrock: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, settings: Settings) -> anyhow::Result<()> {
    match command {
        Command::Serve => {
            bedrock::install_crypto();
            // One id per process until clusters name their nodes.
            let instance = uuid::Uuid::now_v7().to_string();
            let telemetry = bedrock::telemetry::init(
                std::env::var("BEDROCK_LOG_FORMAT").is_ok_and(|f| f == "json"),
                &instance,
            )?;
            let app = Application::build_with(settings, telemetry.metrics()).await?;
            match app.metrics_addr {
                Some(metrics) => {
                    tracing::info!(addr = %app.addr, metrics_addr = %metrics, "listening")
                }
                None => tracing::info!(addr = %app.addr, "listening"),
            }
            let token = app.shutdown_token();
            tokio::spawn(async move {
                wait_for_signal().await;
                token.cancel();
            });
            let outcome = app.run_until_stopped().await;
            // Flush the spans of the last moments before the process ends.
            telemetry.shutdown();
            outcome
        }
        Command::Migrate => {
            let store = open_store(&settings).await?;
            store.close().await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Tenant {
            command: TenantCommand::Create { name },
        } => {
            let (tenant, key) = create_tenant(&settings, &name).await?;
            println!(
                "{}",
                serde_json::json!({"tenant_id": tenant.id, "api_key": key})
            );
            Ok(())
        }
        Command::Tenant {
            command:
                TenantCommand::Budget {
                    name,
                    tokens,
                    period,
                    default,
                },
        } => {
            let period = period.as_deref().and_then(BudgetPeriod::parse);
            let tokens = if default { None } else { tokens };
            let budget = set_tenant_budget(&settings, &name, tokens, period).await?;
            println!("{budget}");
            Ok(())
        }
        Command::Tenant {
            command:
                TenantCommand::Rate {
                    name,
                    per_second,
                    burst,
                    default,
                },
        } => {
            let (per_second, burst) = if default {
                (None, None)
            } else {
                (per_second, burst)
            };
            let rate = set_tenant_rate(&settings, &name, per_second, burst).await?;
            println!("{rate}");
            Ok(())
        }
        Command::Tenant {
            command: TenantCommand::Quota { name, set },
        } => {
            let quotas = set_tenant_quotas(&settings, &name, &set).await?;
            println!("{quotas}");
            Ok(())
        }
        Command::Tenant {
            command: TenantCommand::Key { command },
        } => {
            let answer = match command {
                KeyCommand::Create { name } => create_key(&settings, &name).await?,
                KeyCommand::List { name } => list_keys(&settings, &name).await?,
                KeyCommand::Revoke { name, key } => revoke_key(&settings, &name, &key).await?,
            };
            println!("{answer}");
            Ok(())
        }
        Command::Agent {
            command:
                AgentCommand::Export {
                    tenant,
                    agent,
                    latest,
                },
        } => {
            let document = export_agent(&settings, &tenant, &agent, latest).await?;
            println!("{document}");
            Ok(())
        }
        Command::Agent {
            command:
                AgentCommand::Import {
                    tenant,
                    file,
                    as_name,
                },
        } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("cannot read standard input")?
            } else {
                std::fs::read_to_string(&file)
                    .with_context(|| format!("cannot read {}", file.display()))?
            };
            let made = import_agent(&settings, &tenant, &text, as_name).await?;
            println!("{made}");
            Ok(())
        }
        Command::Schedule {
            command: ScheduleCommand::List { tenant },
        } => {
            for line in list_schedules(&settings, tenant.as_deref()).await? {
                println!("{line}");
            }
            Ok(())
        }
        Command::Replay {
            conversation,
            all,
            since,
            tenant,
            verbose,
            test_changed_decision,
        } => {
            let target = bedrock::app::ReplayTarget {
                conversation,
                all,
                since,
                tenant,
                changed_decision: test_changed_decision,
            };
            let mut out = std::io::stdout().lock();
            let summary = bedrock::app::replay(&settings, &target, &mut out, verbose).await?;
            let rate = summary.steps as f64 / summary.seconds.max(1e-9);
            eprintln!(
                "replay: {} conversations, {} steps the same, {} diverged, {} steps skipped (their segment's start is past retention), {:.2} s, {:.0} steps/s",
                summary.conversations,
                summary.steps,
                summary.diverged,
                summary.skipped,
                summary.seconds,
                rate
            );
            anyhow::ensure!(
                summary.diverged == 0,
                "{} of {} conversations decide differently",
                summary.diverged,
                summary.conversations
            );
            Ok(())
        }
        Command::Config => {
            print!("{}", settings.masked_toml());
            Ok(())
        }
        Command::Openapi => {
            print!("{}", bedrock::api::openapi_json());
            Ok(())
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await.context("no signal handler");
        }
    }
}
