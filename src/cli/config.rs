//! `--config FILE` of `train` and `compile`: a TOML recipe whose keys are the command's flags
//! (`lora_r = 16` or `lora-r = 16`; a switch is `true` or `false`; a list is joined with commas),
//! turned into flags placed before the command line's own, so that a flag given on the command
//! line overrides the file. Top-level keys serve both commands: a key that is a flag of the other
//! command only is left out (and said so); `[train]` and `[compile]` tables hold keys for one
//! command, overriding the top level. A key that is a flag of neither is an error naming the
//! nearest flag; one in the other command's table is said to belong there; a value its flag
//! cannot take is refused naming the file and the key.

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Command};
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The commands that take `--config`.
pub const COMMANDS: &[&str] = &["train", "compile"];

/// A `--config` recipe and the flags whose value it gave.
pub type Recipe = (std::path::PathBuf, std::collections::BTreeSet<String>);

/// A command line with its recipe's flags in place.
pub struct Expanded {
    pub argv: Vec<OsString>,
    /// The `--config` recipe, and the flags whose value it gives (those not typed on the command
    /// line too).
    pub recipe: Option<(PathBuf, BTreeSet<String>)>,
    /// Each flag the recipe gave (without `--`), its value, and the key that gave it, as a
    /// message names it (`` `lr` ``, `` `lr` in [train] ``).
    pub keys: Vec<(String, Option<String>, String)>,
}

/// `argv` with the flags of its `--config FILE` inserted right after the subcommand (so that the
/// command line's own flags, later, override them; each such override is said); unchanged when
/// there is no `--config`. A flag typed twice on the command line is refused, naming it (the
/// parser would silently take the last value).
pub fn expand(argv: Vec<OsString>, cli: &Command) -> Result<Expanded> {
    let unchanged = |argv| {
        Ok(Expanded {
            argv,
            recipe: None,
            keys: Vec::new(),
        })
    };
    let Some(at) = argv
        .iter()
        .skip(1)
        .position(|a| a != "-v" && a != "--verbose")
        .map(|i| i + 1)
    else {
        return unchanged(argv);
    };
    let name = argv[at].to_string_lossy().to_string();
    if !COMMANDS.contains(&name.as_str()) {
        return unchanged(argv);
    }
    let Some(this) = cli.find_subcommand(&name) else {
        return unchanged(argv);
    };
    let typed = typed_flags(&argv[at + 1..], this)?;
    let Some((_, file)) = typed.iter().find(|(f, _)| f == "config") else {
        return unchanged(argv);
    };
    let file = PathBuf::from(file.clone().unwrap_or_default());
    let flags = recipe_flags(&file, &name, cli)?;
    let mut from_recipe = BTreeSet::new();
    let mut out: Vec<OsString> = argv[..=at].to_vec();
    let mut keys = Vec::new();
    for (flag, value, key) in flags {
        let long = flag.trim_start_matches("--").to_string();
        match typed.iter().find(|(f, _)| *f == long) {
            Some((_, mine)) => {
                xtrain::esay!(
                    "xtrain: {flag}{} on the command line overrides the recipe {}'s {flag}{}",
                    mine.as_ref().map(|v| format!(" {v}")).unwrap_or_default(),
                    file.display(),
                    value.as_ref().map(|v| format!(" {v}")).unwrap_or_default(),
                );
                // Left out, not only outvoted: a flag that may be repeated (`--target`) would
                // otherwise keep the recipe's value beside the command line's.
                continue;
            }
            None => {
                keys.push((long.clone(), value.clone(), key));
                from_recipe.insert(long);
            }
        }
        out.push(flag.into());
        out.extend(value.map(OsString::from));
    }
    out.extend(argv[at + 1..].iter().cloned());
    Ok(Expanded {
        argv: out,
        recipe: Some((file, from_recipe)),
        keys,
    })
}

/// Clap's error for a value it cannot take (`invalid value 'fast' for '--lr <LR>'`), said as
/// the recipe's where the recipe gave that value: `r.toml: key `lr`: invalid value ...`. None
/// for other errors, which are clap's to say.
pub fn recipe_value_error(
    e: &clap::Error,
    expanded_recipe: Option<&Path>,
    keys: &[(String, Option<String>, String)],
) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let file = expanded_recipe?;
    if !matches!(
        e.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return None;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    // `--lr <LR>`: the long flag.
    let long = arg.strip_prefix("--")?.split([' ', '=']).next()?;
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => Some(v.as_str()),
        _ => None,
    };
    let of_flag = || keys.iter().filter(|(l, _, _)| l == long);
    let (_, _, key) = of_flag()
        .find(|(_, v, _)| value.is_some_and(|x| v.as_deref() == Some(x)))
        .or_else(|| of_flag().next_back())?;
    let said = e.render().to_string();
    let said = said.trim_end();
    let said = said
        .strip_suffix("For more information, try '--help'.")
        .unwrap_or(said)
        .trim_end();
    let said = said.strip_prefix("error: ").unwrap_or(said);
    Some(format!("{}: key {key}: {said}", file.display()))
}

/// The long flags typed in `args` (a subcommand's arguments), in order, each with its value
/// (None for a switch). A flag typed twice is refused: the parser would take the last value
/// and drop the other without a word.
fn typed_flags(args: &[OsString], cmd: &Command) -> Result<Vec<(String, Option<String>)>> {
    let mut typed: Vec<(String, Option<String>)> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = args[i].to_string_lossy().to_string();
        i += 1;
        if a == "--" {
            break;
        }
        let Some(body) = a.strip_prefix("--") else {
            continue;
        };
        let (given, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let Some(arg) = cmd.get_arguments().find(|x| {
            x.get_long() == Some(given) || x.get_all_aliases().is_some_and(|al| al.contains(&given))
        }) else {
            continue;
        };
        let takes_value = !matches!(
            arg.get_action(),
            ArgAction::SetTrue
                | ArgAction::SetFalse
                | ArgAction::Count
                | ArgAction::Help
                | ArgAction::HelpLong
                | ArgAction::HelpShort
                | ArgAction::Version
        );
        let value = match inline {
            Some(v) => Some(v),
            None if takes_value => {
                let v = args.get(i).map(|v| v.to_string_lossy().to_string());
                i += 1;
                v
            }
            None => None,
        };
        let long = arg.get_long().unwrap_or(given).to_string();
        // A flag that collects its values (`--target a --target b`) is meant to be repeated.
        let repeatable = matches!(arg.get_action(), ArgAction::Append | ArgAction::Count);
        if let Some((_, first)) = typed.iter().find(|(f, _)| *f == long && !repeatable) {
            let values = match (first, &value) {
                (Some(a), Some(b)) => format!(" ({a}, then {b})"),
                _ => String::new(),
            };
            bail!("--{long} is given twice on the command line{values}; give it once");
        }
        typed.push((long, value));
    }
    Ok(typed)
}

/// The flags recipe `path` gives command `name`, each with the key that gives it.
fn recipe_flags(
    path: &Path,
    name: &str,
    cli: &Command,
) -> Result<Vec<(String, Option<String>, String)>> {
    if path.as_os_str().is_empty() {
        bail!("--config needs a file");
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--config: cannot read {}", path.display()))?;
    let table: toml::Table = toml::from_str(&text)
        .map_err(|e| anyhow::anyhow!("{} is not valid TOML: {e}", path.display()))?;
    let command = |n: &str| {
        cli.find_subcommand(n)
            .unwrap_or_else(|| panic!("`{n}` is a subcommand of xtrain"))
    };
    let this = command(name);
    let others: Vec<&Command> = COMMANDS
        .iter()
        .filter(|c| **c != name)
        .map(|c| command(c))
        .collect();
    let mut flags = Vec::new();
    let mut left_out = Vec::new();
    one_key_per_flag(path, "the top level", table.keys())?;
    // Sections first: checked whichever command runs, so that a typo is found by either.
    for (key, value) in &table {
        if let toml::Value::Table(section) = value {
            let Some(cmd) = COMMANDS.iter().find(|c| **c == key.as_str()) else {
                if find_flag(this, key).is_some() {
                    bail!(
                        "{}: `{key}` is a table, but --{} takes a value",
                        path.display(),
                        flag_name(key)
                    );
                }
                bail!(
                    "{}: [{key}] is not a section of a recipe (the sections are [train] and [compile])",
                    path.display()
                );
            };
            check_section(path, key, cmd, section, &command)?;
        }
    }
    for (key, value) in &table {
        if matches!(value, toml::Value::Table(_)) {
            continue;
        }
        not_a_setting(path, key)?;
        match find_flag(this, key) {
            Some(arg) => flags
                .extend(render(path, key, arg, value)?.map(|(f, v)| (f, v, format!("`{key}`")))),
            None if others.iter().any(|c| find_flag(c, key).is_some()) => {
                left_out.push(key.clone())
            }
            None => {
                let mut all = vec![this];
                all.extend(&others);
                bail!(
                    "{}: key `{key}` is not a flag of `xtrain {}`{}",
                    path.display(),
                    COMMANDS.join("` or `xtrain "),
                    nearest(key, &all)
                );
            }
        }
    }
    if let Some(toml::Value::Table(section)) = table.get(name) {
        for (key, value) in section {
            let arg = find_flag(this, key).expect("checked above");
            flags.extend(
                render(path, key, arg, value)?.map(|(f, v)| (f, v, format!("`{key}` in [{name}]"))),
            );
        }
    }
    if !left_out.is_empty() {
        xtrain::esay!(
            "xtrain: {}: not used by `xtrain {name}`: {}",
            path.display(),
            left_out.join(", ")
        );
    }
    // The other command's section, said as the top level's keys are (a plan's [compile] target
    // is the hardware it planned for, and its [train] plugin what trains there).
    for other in COMMANDS.iter().filter(|c| **c != name) {
        if let Some(toml::Value::Table(section)) = table.get(*other) {
            let keys: Vec<String> = section
                .iter()
                .map(|(k, v)| match v.as_str() {
                    Some(text) => format!("{k} = {text:?}"),
                    None => k.clone(),
                })
                .collect();
            xtrain::esay!(
                "xtrain: {}: [{other}] is for `xtrain {other}`, not used by `xtrain {name}`: {}",
                path.display(),
                keys.join(", ")
            );
        }
    }
    Ok(flags)
}

/// The keys of section `[key]` (the flags of `xtrain {cmd}`): each a flag of that command, with
/// a flag of the other command said to be in the wrong section and anything else misspelt.
fn check_section<'c>(
    path: &Path,
    key: &str,
    cmd: &str,
    section: &toml::Table,
    command: &dyn Fn(&str) -> &'c Command,
) -> Result<()> {
    let c = command(cmd);
    one_key_per_flag(path, &format!("[{key}]"), section.keys())?;
    for k in section.keys() {
        not_a_setting(path, k)?;
        if find_flag(c, k).is_some() {
            continue;
        }
        // A flag of another command: put in the wrong table, not misspelt.
        if let Some(other) = COMMANDS
            .iter()
            .find(|o| **o != cmd && find_flag(command(o), k).is_some())
        {
            bail!(
                "{}: key `{k}` in [{key}] is a `{other}` key (a flag of `xtrain {other}`, \
                 not of `xtrain {cmd}`): put it under [{other}], or at the top level, \
                 which serves both commands",
                path.display()
            );
        }
        bail!(
            "{}: key `{k}` in [{key}] is not a flag of `xtrain {cmd}`{}",
            path.display(),
            nearest(k, &[c])
        );
    }
    Ok(())
}

/// `config`, `help` and `version` are flags of every command, but none is a setting a recipe can
/// hold: refused by name rather than taken for a misspelt flag.
fn not_a_setting(path: &Path, key: &str) -> Result<()> {
    let why = match flag_name(key).as_str() {
        "config" => "--config names the recipe file itself (a recipe cannot include another)",
        "help" => "--help prints the command's flags and runs nothing",
        "version" => "--version prints xtrain's version and runs nothing",
        _ => return Ok(()),
    };
    bail!(
        "{}: `{key}` cannot be a recipe key: {why}; a recipe's keys are the settings of a run \
         (`xtrain train --help` lists them)",
        path.display()
    )
}

/// Refuse two keys of one table that name one flag (`lora_r` and `lora-r`): which would win is
/// the order TOML happens to keep.
fn one_key_per_flag<'a>(
    path: &Path,
    table: &str,
    keys: impl Iterator<Item = &'a String>,
) -> Result<()> {
    let mut seen: std::collections::BTreeMap<String, &str> = Default::default();
    for k in keys {
        if let Some(first) = seen.insert(flag_name(k), k) {
            bail!(
                "{}: keys `{first}` and `{k}` in {table} both set --{}; keep one",
                path.display(),
                flag_name(k)
            );
        }
    }
    Ok(())
}

/// `lora_r` and `lora-r` name `--lora-r`.
fn flag_name(key: &str) -> String {
    key.replace('_', "-")
}

/// The flag of `cmd` a recipe key names (not `--config`, `--help` or `--version`).
fn find_flag<'a>(cmd: &'a Command, key: &str) -> Option<&'a clap::Arg> {
    let long = flag_name(key);
    if long == "config" {
        return None;
    }
    cmd.get_arguments().find(|a| {
        !matches!(
            a.get_action(),
            ArgAction::Help | ArgAction::HelpLong | ArgAction::HelpShort | ArgAction::Version
        ) && (a.get_long() == Some(long.as_str())
            || a.get_all_aliases()
                .is_some_and(|al| al.contains(&long.as_str())))
    })
}

/// A key's value as the flag it stands for and its value (none for a switch; nothing for a
/// switch that is off).
fn render(
    path: &Path,
    key: &str,
    arg: &clap::Arg,
    value: &toml::Value,
) -> Result<Option<(String, Option<String>)>> {
    let flag = format!("--{}", arg.get_long().unwrap_or_default());
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return match value {
            toml::Value::Boolean(true) => Ok(Some((flag, None))),
            toml::Value::Boolean(false) => Ok(None),
            other => bail!(
                "{}: `{key}` is a switch ({flag}): write true or false, not {} {}",
                path.display(),
                article(other),
                other.type_str()
            ),
        };
    }
    let scalar = |v: &toml::Value| -> Result<String> {
        Ok(match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Datetime(d) => d.to_string(),
            other => bail!(
                "{}: `{key}` ({flag}) takes a value, not {} {}",
                path.display(),
                article(other),
                other.type_str()
            ),
        })
    };
    let text = match value {
        toml::Value::Array(items) => items
            .iter()
            .map(scalar)
            .collect::<Result<Vec<_>>>()?
            .join(","),
        v => scalar(v)?,
    };
    Ok(Some((flag, Some(text))))
}

fn article(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::Integer(_) | toml::Value::Array(_) => "an",
        _ => "a",
    }
}

/// The names transformers, torchtune and axolotl configs give some of xtrain's flags.
const SYNONYMS: &[(&str, &str)] = &[
    ("learning-rate", "lr"),
    ("num-epochs", "epochs"),
    ("num-train-epochs", "epochs"),
    ("max-steps", "steps"),
    ("output-dir", "out"),
    ("micro-batch-size", "batch-size"),
    ("per-device-train-batch-size", "batch-size"),
    ("gradient-accumulation-steps", "grad-accum"),
    ("sequence-len", "seq"),
    ("max-seq-length", "seq"),
    ("max-seq-len", "seq"),
    ("warmup-steps", "warmup"),
    ("lr-scheduler", "schedule"),
    ("lr-scheduler-type", "schedule"),
    ("base-model", "model"),
    ("model-name-or-path", "model"),
    ("dataset", "data"),
    ("datasets", "data"),
    ("train-file", "data"),
    ("save-steps", "save-every"),
    ("eval-steps", "eval-every"),
    ("logging-steps", "log-every"),
    ("lora-rank", "lora-r"),
    ("lora-target-modules", "lora-targets"),
    ("target-modules", "lora-targets"),
    ("torch-dtype", "dtype"),
    ("load-in-4bit", "quant"),
];

/// "; the nearest flag is --x": the flag of `cmds` that `key` names in other trainers' configs,
/// else the one closest to it in edit distance.
fn nearest(key: &str, cmds: &[&Command]) -> String {
    let want = flag_name(key);
    let longs = || {
        cmds.iter()
            .flat_map(|c| c.get_arguments())
            .filter_map(|a| a.get_long())
            .filter(|l| !["help", "version", "config"].contains(l))
    };
    let synonym = SYNONYMS
        .iter()
        .find(|(k, _)| *k == want)
        .and_then(|(_, flag)| longs().find(|l| l == flag));
    let best = synonym.or_else(|| {
        longs().min_by_key(|l| (xtrain::program::spelling::edit_distance(&want, l), l.len()))
    });
    match best {
        Some(l) => format!("; the nearest flag is --{l} (`{}`)", l.replace('-', "_")),
        None => String::new(),
    }
}
