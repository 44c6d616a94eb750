//! `tensoralloc`: command-line tools around the allocator.
//!
//! `tensoralloc replay SNAPSHOT` replays a PyTorch memory snapshot on the simulated device
//! under one or more allocator configurations and reports peaks, device allocations and
//! where it runs out of memory.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use tensoralloc::config::parse_size;
use tensoralloc::replay::output::{self, Failure, Run};
use tensoralloc::replay::{self, snapshot, Options, UNLIMITED_MEMORY};

#[derive(Parser)]
#[command(
    name = "tensoralloc",
    version,
    about = "Tools for the tensoralloc GPU memory allocator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot()`, or
    /// tensoralloc's own) on the simulated device: will it fit?
    Replay {
        /// The snapshot: a pickle, gzip-compressed or not.
        snapshot: PathBuf,
        /// Which device's trace to replay.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Allocator settings in TENSORALLOC_CONF syntax (`default` for none). Repeat to
        /// compare several side by side, e.g. `--config default --config max_split_size_mb:256`.
        #[arg(long = "config", value_name = "STR")]
        configs: Vec<String>,
        /// Device memory to replay in (e.g. 24GiB); unlimited when not given.
        #[arg(long, value_name = "SIZE")]
        memory: Option<String>,
        /// Print one JSON object per configuration instead of a table.
        #[arg(long)]
        json: bool,
        /// Draw allocated and reserved bytes over the events into this SVG file.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let Command::Replay {
        snapshot: path,
        device,
        mut configs,
        memory,
        json,
        svg,
    } = Cli::parse().command;
    let memory = match memory.as_deref().map(parse_size).transpose() {
        Ok(Some(0)) => return fail("--memory must be more than 0 bytes"),
        Ok(m) => m,
        Err(e) => return fail(&format!("--memory: {}", e.message())),
    };
    if configs.is_empty() {
        configs.push("default".into());
    }
    if configs.iter().any(|c| c.trim().is_empty()) {
        return fail("--config needs settings (`default` for none)");
    }
    let trace = match snapshot::load(&path, device) {
        Ok(t) => t,
        Err(e) => return fail(e.message()),
    };
    let options = Options {
        memory: memory.unwrap_or(UNLIMITED_MEMORY),
        series: svg.is_some(),
    };
    let mut runs = Vec::new();
    for config in configs {
        let outcome = replay::parse_config(&config)
            .map_err(|e| Failure::Unsupported(e.message().to_string()))
            .and_then(|c| {
                let bar = progress_bar(trace.events.len() as u64, &config);
                let r = replay::run_with(&trace, &c, &options, &mut |done| {
                    bar.set_position(done as u64)
                });
                bar.finish_and_clear();
                r.map_err(|e| Failure::of(&e))
            });
        runs.push(Run { config, outcome });
    }
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    if json {
        print!("{}", output::json_lines(&runs));
    } else {
        print!("{}", output::table(&name, &trace, memory, &runs));
    }
    if let Some(file) = svg {
        if let Err(e) = output::svg(&file, &name, &runs) {
            return fail(e.message());
        }
    }
    // Not fitting is an answer; settings or a trace that cannot be replayed are not.
    if runs
        .iter()
        .any(|r| matches!(r.outcome, Err(Failure::Unsupported(_))))
    {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

/// A progress bar on stderr, or a hidden one when stderr is not a terminal.
fn progress_bar(len: u64, config: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() || len < 100_000 {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} events") {
        bar.set_style(style);
    }
    bar.set_message(format!("replaying ({config})"));
    bar
}

fn fail(message: &str) -> ExitCode {
    eprintln!("tensoralloc: {message}");
    ExitCode::FAILURE
}
