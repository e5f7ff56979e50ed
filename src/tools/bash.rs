//! The bash tool: `bash -c` in its own process group, with a timeout, an output cap and a
//! cancel that kills the whole group (grandchildren included) at once.

use std::os::fd::OwnedFd;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

use crate::sandbox::{Launched, Network, SETUP_FAILED, Sandbox};
use crate::state_machine::ToolOutcome;
use crate::workspace::Pinned;

/// How a bash run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BashOutcome {
    /// stdout and stderr merged, capped.
    pub output: String,
    pub exit_code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub cancelled: bool,
    /// It printed more than `sandbox.max_output_bytes` and was killed.
    pub output_exceeded: bool,
}

impl BashOutcome {
    pub fn ok(&self) -> bool {
        self.exit_code == Some(0) && !self.timed_out && !self.cancelled && !self.output_exceeded
    }

    /// The result the LLM sees.
    pub fn into_outcome(self) -> ToolOutcome {
        let ok = self.ok();
        let mut output = self.output;
        let note = if self.cancelled {
            Some("[cancelled: the process group was killed]".to_owned())
        } else if self.timed_out {
            Some("[timed out: the process group was killed]".to_owned())
        } else if self.output_exceeded {
            Some("[output limit exceeded: the process group was killed]".to_owned())
        } else {
            match (self.exit_code, self.signal) {
                (Some(0), _) => None,
                (Some(SETUP_FAILED), _) => Some(format!(
                    "[exit status {SETUP_FAILED}: the sandbox could not be set up]"
                )),
                (Some(code), _) => Some(format!("[exit status {code}]")),
                (None, Some(signal)) => Some(describe_signal(signal)),
                (None, None) => Some("[killed by a signal]".to_owned()),
            }
        };
        if let Some(note) = note {
            if !output.is_empty() && !output.ends_with('\n') {
                output.push('\n');
            }
            output.push_str(&note);
        }
        ToolOutcome { ok, output }
    }
}

fn describe_signal(signal: i32) -> String {
    let name = Signal::try_from(signal)
        .map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_owned());
    let why = match signal {
        libc::SIGXCPU => ": CPU time limit",
        libc::SIGXFSZ => ": file size limit",
        libc::SIGKILL => " (a limit, or killed from outside)",
        libc::SIGSEGV | libc::SIGBUS => " (out of memory under the address-space limit?)",
        _ => "",
    };
    format!("[killed by {name}{why}]")
}

/// Keeps the head and the tail of a stream when it is longer than the cap.
struct Capped {
    cap: usize,
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: usize,
}

impl Capped {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            head: Vec::new(),
            tail: Default::default(),
            total: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        self.total += bytes.len();
        let head_cap = self.cap / 2;
        let mut rest = bytes;
        if self.head.len() < head_cap {
            let take = rest.len().min(head_cap - self.head.len());
            self.head.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
        }
        let tail_cap = self.cap - head_cap;
        self.tail.extend(rest);
        while self.tail.len() > tail_cap {
            self.tail.pop_front();
        }
    }

    fn finish(self) -> String {
        let kept = self.head.len() + self.tail.len();
        let head = String::from_utf8_lossy(&self.head).into_owned();
        let tail: Vec<u8> = self.tail.into_iter().collect();
        let tail = String::from_utf8_lossy(&tail);
        if self.total > kept {
            format!(
                "{head}\n[output cut: {} bytes in all, the first and last {} shown]\n{tail}",
                self.total, kept
            )
        } else {
            head + &tail
        }
    }
}

/// The environment a tool process gets: nothing of the server's but what a shell needs
/// (and what `sandbox.env_passthrough` names).
fn tool_env(cwd: &Path, sandboxed: bool) -> Vec<(&'static str, String)> {
    let mut env = vec![
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_owned(),
        ),
        ("HOME", cwd.display().to_string()),
        ("LANG", "C.UTF-8".to_owned()),
        ("TERM", "dumb".to_owned()),
    ];
    if sandboxed {
        env.push(("TMPDIR", "/tmp".to_owned()));
    }
    env
}

fn kill_group(pgid: Option<u32>) {
    if let Some(pgid) = pgid.and_then(|id| i32::try_from(id).ok()) {
        // ESRCH (the group is already gone) is fine.
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
}

/// What a run waits for.
enum Process {
    Plain(tokio::process::Child),
    Sandboxed(crate::sandbox::RunProcess),
    /// The sandbox could not be set up; its setup process ended so.
    Done(std::process::ExitStatus),
}

impl Process {
    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match self {
            Process::Plain(child) => child.wait().await,
            Process::Sandboxed(run) => run.wait().await,
            Process::Done(status) => Ok(*status),
        }
    }
}

impl BashOutcome {
    /// A run that could not start, saying why.
    pub fn failed(output: String) -> BashOutcome {
        BashOutcome {
            output,
            exit_code: None,
            signal: None,
            timed_out: false,
            cancelled: false,
            output_exceeded: false,
        }
    }
}

/// Called with each line of output as it comes (background tasks stream it to clients).
pub type OnLine = Arc<dyn Fn(&str) + Send + Sync>;

/// How one bash run is bounded and confined.
#[derive(Clone, Debug)]
pub struct BashLimits {
    pub timeout: Duration,
    /// Output kept (head and tail).
    pub output_cap: usize,
    /// Output past this kills the run.
    pub max_output: u64,
    /// `None`: unconfined (sandbox.mode = "off").
    pub sandbox: Option<Arc<Sandbox>>,
    pub network: Network,
}

impl BashLimits {
    /// Unconfined, with the given timeout and output cap (tests and tools of the server).
    pub fn unconfined(timeout: Duration, output_cap: usize) -> Self {
        BashLimits {
            timeout,
            output_cap,
            max_output: u64::MAX,
            sandbox: None,
            network: Network::Off,
        }
    }
}

/// Runs `command` with `bash -c` in `cwd`, calling `on_line` with every complete line of
/// output.
pub async fn run_bash(
    command: &str,
    cwd: &Pinned,
    limits: &BashLimits,
    cancel: CancellationToken,
    on_line: Option<OnLine>,
) -> BashOutcome {
    let failed = BashOutcome::failed;
    let (reader, writer) = match std::io::pipe() {
        Ok(pipe) => pipe,
        Err(e) => return failed(format!("cannot create a pipe: {e}")),
    };
    let stderr = match writer.try_clone() {
        Ok(w) => w,
        Err(e) => return failed(format!("cannot create a pipe: {e}")),
    };
    let env = tool_env(cwd.path(), limits.sandbox.is_some());
    let (mut process, pgid) = match &limits.sandbox {
        Some(sandbox) => {
            let command = crate::sandbox::Command {
                program: "/bin/bash".into(),
                args: vec!["-c".into(), command.into()],
                env: env
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .chain(sandbox.passthrough().iter().cloned())
                    .collect(),
                stdout: writer.into(),
                stderr: stderr.into(),
            };
            let prepared = match sandbox.prepare(cwd, limits.network) {
                Ok(prepared) => prepared,
                Err(e) => return failed(format!("cannot prepare the sandbox: {e}")),
            };
            match prepared.launch(command).await {
                Ok(Launched::Running(run)) => {
                    // Every process of the run is in the setup process's group, which PID 1
                    // of the run inherits.
                    let group = u32::try_from(run.group()).ok();
                    (Process::Sandboxed(run), group)
                }
                Ok(Launched::SetupFailed(status)) => (Process::Done(status), None),
                Err(e) => return failed(format!("cannot start the sandboxed run: {e}")),
            }
        }
        None => {
            let mut cmd = tokio::process::Command::new("/bin/bash");
            cmd.arg("-c")
                .arg(command)
                // The directory that was opened, through its descriptor (followed by the
                // child's chdir, not looked up again).
                .current_dir(cwd.proc_path())
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(writer)
                .stderr(stderr)
                .env_clear()
                .envs(env)
                .kill_on_drop(true);
            let spawned = cmd.spawn();
            // Close our copies of the pipe's write end, or the reader never sees EOF.
            drop(cmd);
            match spawned {
                Ok(child) => {
                    let pgid = child.id();
                    (Process::Plain(child), pgid)
                }
                Err(e) => {
                    return failed(format!(
                        "cannot start bash in {}: {e}",
                        cwd.path().display()
                    ));
                }
            }
        }
    };
    let mut receiver = match tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(reader))
    {
        Ok(receiver) => receiver,
        Err(e) => {
            kill_group(pgid);
            return failed(format!("cannot read the output: {e}"));
        }
    };
    let output_cap = limits.output_cap;
    let max_output = limits.max_output;
    let exceeded = CancellationToken::new();
    let reading = tokio::spawn({
        let exceeded = exceeded.clone();
        async move {
            let mut capped = Capped::new(output_cap);
            let mut buf = vec![0u8; 16 * 1024];
            let mut partial = Vec::new();
            loop {
                match receiver.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        capped.push(&buf[..n]);
                        if capped.total as u64 > max_output {
                            exceeded.cancel();
                            break;
                        }
                        if let Some(on_line) = &on_line {
                            partial.extend_from_slice(&buf[..n]);
                            while let Some(end) = partial.iter().position(|b| *b == b'\n') {
                                let line: Vec<u8> = partial.drain(..=end).collect();
                                on_line(String::from_utf8_lossy(&line[..line.len() - 1]).as_ref());
                            }
                            // A line longer than the cap goes out in pieces.
                            if partial.len() > output_cap {
                                on_line(String::from_utf8_lossy(&partial).as_ref());
                                partial.clear();
                            }
                        }
                    }
                }
            }
            if let Some(on_line) = &on_line
                && !partial.is_empty()
            {
                on_line(String::from_utf8_lossy(&partial).as_ref());
            }
            capped.finish()
        }
    });

    let (status, timed_out, cancelled) = tokio::select! {
        status = process.wait() => (status.ok(), false, false),
        () = tokio::time::sleep(limits.timeout) => (None, true, false),
        () = cancel.cancelled() => (None, false, true),
        () = exceeded.cancelled() => (None, false, false),
    };
    // Whatever ended the run, nothing of the group may outlive it (in the sandbox, PID 1
    // of the run dying takes its whole PID namespace with it).
    kill_group(pgid);
    let _ = process.wait().await;
    let output = match tokio::time::timeout(Duration::from_secs(2), reading).await {
        Ok(Ok(output)) => output,
        Ok(Err(_)) | Err(_) => String::from("[output unavailable]"),
    };
    BashOutcome {
        output,
        exit_code: status.and_then(|s| s.code()),
        signal: status.and_then(|s| s.signal()),
        timed_out,
        cancelled,
        output_exceeded: exceeded.is_cancelled(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_output_keeps_head_and_tail() {
        let mut capped = Capped::new(10);
        capped.push(b"0123456789abcdefghij");
        let text = capped.finish();
        assert!(
            text.starts_with("01234\n[output cut: 20 bytes in all"),
            "{text}"
        );
        assert!(text.ends_with("fghij"), "{text}");
        let mut small = Capped::new(10);
        small.push(b"abc");
        small.push(b"def");
        assert_eq!(small.finish(), "abcdef");
    }

    #[tokio::test]
    async fn merges_streams_and_reports_exit_status() {
        let cwd = Pinned::trusted(&std::env::temp_dir()).expect("the temp dir");
        let outcome = run_bash(
            "echo out; echo err >&2; exit 3",
            &cwd,
            &BashLimits::unconfined(Duration::from_secs(10), 1000),
            CancellationToken::new(),
            None,
        )
        .await;
        assert_eq!(outcome.exit_code, Some(3));
        assert!(
            outcome.output.contains("out") && outcome.output.contains("err"),
            "{outcome:?}"
        );
        let result = outcome.into_outcome();
        assert!(!result.ok);
        assert!(
            result.output.ends_with("[exit status 3]"),
            "{}",
            result.output
        );
    }

    #[tokio::test]
    async fn timeout_kills_the_group() {
        let cwd = Pinned::trusted(&std::env::temp_dir()).expect("the temp dir");
        let outcome = run_bash(
            "sleep 30 & sleep 30",
            &cwd,
            &BashLimits::unconfined(Duration::from_millis(200), 1000),
            CancellationToken::new(),
            None,
        )
        .await;
        assert!(outcome.timed_out);
        assert!(!outcome.ok());
    }

    #[tokio::test]
    async fn the_environment_is_clean() {
        let cwd = Pinned::trusted(&std::env::temp_dir()).expect("the temp dir");
        let outcome = run_bash(
            "env | sort",
            &cwd,
            &BashLimits::unconfined(Duration::from_secs(10), 10_000),
            CancellationToken::new(),
            None,
        )
        .await;
        let names: Vec<&str> = outcome
            .output
            .lines()
            .filter_map(|l| l.split('=').next())
            .collect();
        for name in &names {
            assert!(
                [
                    "HOME", "LANG", "PATH", "PWD", "SHLVL", "TERM", "_", "OLDPWD"
                ]
                .contains(name),
                "unexpected variable {name} in {names:?}"
            );
        }
    }
}
