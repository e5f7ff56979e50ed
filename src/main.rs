//! The `bedrock` command line.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "bedrock",
    version,
    about = "Runs LLM agent conversations as supervised actors"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve HTTP, WebSocket and SSE on BEDROCK_LISTEN.
    Serve,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve => {
            println!("bedrock {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
    }
}
