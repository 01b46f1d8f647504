//! The `xtrain` command line: the argument structs (clap) and one function per command that
//! turns its arguments into the library's options and calls the stage that does the work. No
//! work is done here beyond printing what a command reports. May use the whole library; nothing
//! in the library uses it.

mod args;
mod bench;
mod compile;
mod config;
mod convert;
mod export;
mod generate;
mod model;
mod plan;
mod plugins;
mod signals;
mod targets;
mod train;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "xtrain",
    version,
    about = "Fine-tune Llama 3.1 with LoRA as one compiled StableHLO program on any PJRT backend"
)]
struct Cli {
    /// Say more (also XLA's own logs).
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the PJRT plugins found on this machine, or install one.
    Plugins {
        #[command(subcommand)]
        action: Option<plugins::PluginAction>,
    },
    /// Train LoRA adapters.
    Train(Box<train::TrainArgs>),
    /// Print a fresh secret for a run of several processes (32 random bytes as hex): give every
    /// process the same one, as XTRAIN_RUN_TOKEN or in a --run-token-file.
    RunToken,
    /// Build the training step program (StableHLO + manifest) without weights; --check also
    /// compiles it and prints XLA's memory figures.
    Compile(Box<compile::CompileArgs>),
    /// Find the settings that fit a target (mesh, microbatches, remat, offload, key blocks,
    /// loss chunks, MLP tiles) by compiling for it, rank them, and write plan.json and a
    /// recipe; --seq max finds the longest sequence that fits.
    Plan(Box<plan::PlanArgs>),
    /// Convert a llama.cpp GGUF file into a Hugging Face model directory.
    ImportGguf {
        /// The .gguf file.
        file: PathBuf,
        /// Output model directory: new or empty (see --overwrite).
        #[arg(long)]
        out: PathBuf,
        /// Replace what --out holds, once the new model is complete.
        #[arg(long)]
        overwrite: bool,
    },
    /// Write a model, with a LoRA adapter merged in or (--lora-only) on its own, as a GGUF file
    /// for llama.cpp, Ollama and LM Studio.
    ExportGguf(Box<export::ExportGgufArgs>),
    /// Generate text from a prompt, with or without a LoRA adapter.
    Generate(generate::GenerateArgs),
    /// Time the training step on random weights (`--init random`: no checkpoint needed) and
    /// print the figures as JSON; --export writes the weights and batch for peer checks.
    Bench(Box<bench::BenchArgs>),
    /// List the hardware `compile --target` knows; with a name (cuda:h100, rocm:mi300x), print
    /// its GPU description (GpuTargetConfigProto text: a start for `--target-config`).
    Targets { name: Option<String> },
    /// Fold a LoRA adapter into the base weights and write a complete HF checkpoint.
    Merge {
        /// The base model: a Hugging Face model directory or repo id (org/name).
        #[arg(long)]
        model: PathBuf,
        /// With a repo id: the branch, tag or commit (default main).
        #[arg(long)]
        revision: Option<String>,
        /// The PEFT adapter directory to fold into the weights.
        #[arg(long)]
        adapter: PathBuf,
        /// Output model directory: new or empty (see --overwrite).
        #[arg(long)]
        out: PathBuf,
        /// Replace what --out holds, once the merged model is complete.
        #[arg(long)]
        overwrite: bool,
    },
}

/// The flags of a subcommand given on the command line (as `lora-alpha`), not left at their
/// defaults.
fn given_flags(m: Option<&clap::ArgMatches>) -> std::collections::BTreeSet<String> {
    let Some(m) = m else {
        return Default::default();
    };
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
        .map(|id| id.as_str().replace('_', "-"))
        .collect()
}

/// The command line and its matches, with the flags of a `--config` recipe put before the command
/// line's own (a flag given twice takes its last value, so the command line overrides the recipe;
/// the recipe's flags count as given).
fn parse() -> (Cli, clap::ArgMatches, Option<Recipe>) {
    let cmd = config::COMMANDS.iter().fold(Cli::command(), |c, name| {
        c.mut_subcommand(*name, |s| s.args_override_self(true))
    });
    // `--lr -1` is a value out of range, said by name, not an "unexpected argument '-1'".
    let cmd = cmd.mut_subcommands(|s| {
        s.mut_args(|a| {
            let takes =
                a.get_action().takes_values() && a.get_num_args().is_none_or(|n| n.takes_values());
            if takes && !a.is_positional() {
                a.allow_negative_numbers(true)
            } else {
                a
            }
        })
    });
    let expanded = match config::expand(std::env::args_os().collect(), &cmd) {
        Ok(e) => e,
        Err(e) => {
            xtrain::esay!("error: {e:#}");
            std::process::exit(2);
        }
    };
    let command = expanded.argv.get(1).cloned();
    let matches = match cmd.try_get_matches_from(expanded.argv) {
        Ok(m) => m,
        Err(e) => {
            if let Some(said) = not_part_of_the_program(&e, command.as_deref()) {
                xtrain::esay!("error: {said}");
                std::process::exit(2);
            }
            let recipe = expanded.recipe.as_ref().map(|(f, _)| f.as_path());
            match config::recipe_value_error(&e, recipe, &expanded.keys) {
                Some(said) => {
                    xtrain::esay!("error: {said}");
                    std::process::exit(2);
                }
                None => e.exit(),
            }
        }
    };
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    (cli, matches, expanded.recipe)
}

/// `compile --lr`: the learning rate is an argument of each step, not part of the program, so
/// compile has no such flag; said so, rather than clap's nearest flag (`--lora-r`).
fn not_part_of_the_program(e: &clap::Error, command: Option<&std::ffi::OsStr>) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() != ErrorKind::UnknownArgument || command? != "compile" {
        return None;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    let flag = arg.split('=').next().unwrap_or(arg);
    (flag == "--lr").then(|| {
        "`xtrain compile` takes no --lr: the learning rate is an argument of each step, not part \
         of the program (give it to `xtrain train`; compile takes train's other optimizer flags)"
            .to_string()
    })
}

use config::Recipe;

/// Parse the command line and run the command; an error is printed as `error: ...` with exit code 1.
pub fn main() {
    // First, while this process has one thread: no program it starts (a plugin's Python, pip)
    // inherits the run's secret.
    xtrain::cluster::auth::take_from_environment();
    let (cli, matches, recipe) = parse();
    pjrt::set_verbose(cli.verbose);
    xtrain::device::platform::set_verbose(cli.verbose);
    // Before any command starts threads (weights are made and read on all cores).
    let runs_on = match &cli.command {
        Command::Train(a) => Some(a.plugin.as_deref()),
        Command::Compile(a) => Some(a.plugin.as_deref()),
        Command::Generate(a) => Some(a.plugin.as_deref()),
        Command::Bench(a) => Some(a.plugin.as_deref()),
        _ => None,
    };
    if let Some(plugin) = runs_on {
        xtrain::device::platform::prepare_host_memory(plugin);
    }
    let result = match cli.command {
        Command::Plugins { action } => plugins::plugins(action, cli.verbose),
        Command::Train(a) => train::train(
            *a,
            cli.verbose,
            given_flags(matches.subcommand_matches("train")),
            recipe,
        ),
        Command::Compile(a) => compile::compile(*a, cli.verbose, recipe),
        Command::Plan(a) => plan::plan(
            *a,
            cli.verbose,
            given_flags(matches.subcommand_matches("plan")),
        ),
        Command::ImportGguf {
            file,
            out,
            overwrite,
        } => convert::import_gguf(&file, &out, overwrite),
        Command::ExportGguf(a) => export::export_gguf(*a),
        Command::Generate(a) => generate::generate(a),
        Command::Bench(a) => bench::bench(*a),
        Command::Targets { name } => targets::targets(name.as_deref()),
        Command::RunToken => xtrain::cluster::auth::random_token().map(|t| xtrain::say!("{t}")),
        Command::Merge {
            model,
            revision,
            adapter,
            out,
            overwrite,
        } => model::model_dir(&model, revision.as_deref(), "merge")
            .and_then(|model| convert::merge(&model, &adapter, &out, overwrite)),
    };
    if let Err(e) = result {
        if signals::ending() {
            // The signal's watcher is removing the temp files and ends the process.
            loop {
                std::thread::park();
            }
        }
        xtrain::esay!("error: {e:#}");
        std::process::exit(1);
    }
}
