//! Slurm batch scripts: the `#SBATCH` options a Slurm user already has, read
//! into a job spec (`muster sbatch`).
//!
//! Slurm's rules: options are read from `#SBATCH` lines up to the first line
//! that is neither blank nor a comment; options given on the command line
//! win over the script's. The script runs on every node of the job with its
//! interpreter (the `#!` line, required as Slurm requires it) and with the
//! `SLURM_*` variables scripts read (`slurm_env`).
//!
//! Pure: the caller reads the file, the environment and the directory.

use serde_json::{Value, json};

/// The largest script: it travels as one argument of its interpreter (`-c`),
/// and Linux caps one argument at 128 KiB.
pub const MAX_SCRIPT_BYTES: usize = 100 * 1024;

/// A batch script read into a job spec.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchJob {
    /// The job spec in its wire form (`muster_api::JobSpec` fields), not yet
    /// validated; `env` holds only what the options set.
    pub spec: Value,
    /// `--export`: `ALL` (Slurm's default), `NONE`, or names.
    pub export: String,
    /// Options understood but not applied, each with why.
    pub notes: Vec<String>,
    /// Options muster does not know, as written, with where.
    pub unknown: Vec<String>,
}

/// Where an option came from, for messages.
#[derive(Debug, Clone, Copy)]
enum Origin {
    CommandLine,
    Line(usize),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::CommandLine => f.write_str("the command line"),
            Origin::Line(line) => write!(f, "line {line}"),
        }
    }
}

/// The options muster reads: (long name, short letter, takes a value).
const OPTIONS: &[(&str, Option<char>, bool)] = &[
    ("job-name", Some('J'), true),
    ("nodes", Some('N'), true),
    ("ntasks", Some('n'), true),
    ("ntasks-per-node", None, true),
    ("gres", None, true),
    ("gpus-per-node", None, true),
    ("gpus", Some('G'), true),
    ("cpus-per-task", Some('c'), true),
    ("mem", None, true),
    ("mem-per-cpu", None, true),
    ("mem-per-gpu", None, true),
    ("time", Some('t'), true),
    ("array", Some('a'), true),
    ("dependency", Some('d'), true),
    ("output", Some('o'), true),
    ("error", Some('e'), true),
    ("partition", Some('p'), true),
    ("account", Some('A'), true),
    ("qos", Some('q'), true),
    ("chdir", Some('D'), true),
    ("export", None, true),
    ("signal", None, true),
    ("requeue", None, false),
    ("no-requeue", None, false),
    ("mail-type", None, true),
    ("mail-user", None, true),
    ("comment", None, true),
    ("open-mode", None, true),
];

/// Splits an option line into words: whitespace separates, quotes group,
/// `#` outside quotes starts a comment.
fn words(text: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut current: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in text.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => current.get_or_insert_with(String::new).push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                current.get_or_insert_with(String::new);
            }
            (None, '#') => break,
            (None, c) if c.is_whitespace() => {
                if let Some(word) = current.take() {
                    words.push(word);
                }
            }
            (None, c) => current.get_or_insert_with(String::new).push(c),
        }
    }
    if quote.is_some() {
        return Err("a quote is not closed".to_string());
    }
    words.extend(current);
    Ok(words)
}

/// `(name, value)` pairs from option words (`--nodes=2`, `--nodes 2`, `-N 2`,
/// `-N2`); unknown ones go to `unknown`.
fn options(
    words: &[String],
    origin: Origin,
    unknown: &mut Vec<String>,
    errors: &mut Vec<String>,
) -> Vec<(&'static str, Option<String>, Origin)> {
    let mut found = Vec::new();
    let mut position = 0;
    while position < words.len() {
        let word = &words[position];
        position += 1;
        let (option, inline) = if let Some(long) = word.strip_prefix("--") {
            let (name, value) = match long.split_once('=') {
                Some((name, value)) => (name, Some(value.to_string())),
                None => (long, None),
            };
            (OPTIONS.iter().find(|(n, _, _)| *n == name), value)
        } else if let Some(short) = word.strip_prefix('-').filter(|s| !s.is_empty()) {
            let letter = short.chars().next();
            let rest = &short[letter.map_or(0, char::len_utf8)..];
            let value = (!rest.is_empty()).then(|| rest.trim_start_matches('=').to_string());
            (OPTIONS.iter().find(|(_, short, _)| *short == letter), value)
        } else {
            errors.push(format!(
                "{origin}: {word:?} is not an option (options start with - or --)"
            ));
            continue;
        };
        let Some(&(name, _, takes_value)) = option else {
            unknown.push(format!("{word} ({origin})"));
            continue;
        };
        let value = if takes_value {
            match inline {
                Some(value) => Some(value),
                None if position < words.len() => {
                    position += 1;
                    Some(words[position - 1].clone())
                }
                None => {
                    errors.push(format!("{origin}: --{name} needs a value"));
                    continue;
                }
            }
        } else {
            if inline.is_some() {
                errors.push(format!("{origin}: --{name} takes no value"));
                continue;
            }
            None
        };
        found.push((name, value, origin));
    }
    found
}

/// Splits `muster sbatch`'s words into the sbatch options, the script, and
/// the script's arguments: options come first, the first other word is the
/// script (an option's separate value is not).
pub fn split_command_line(words: &[String]) -> (Vec<String>, Option<String>, Vec<String>) {
    let mut position = 0;
    while position < words.len() {
        let word = &words[position];
        if !word.starts_with('-') || word == "-" {
            break;
        }
        let takes_separate_value = if let Some(long) = word.strip_prefix("--") {
            !long.contains('=')
                && OPTIONS
                    .iter()
                    .any(|(name, _, value)| *name == long && *value)
        } else {
            let letters: Vec<char> = word.chars().skip(1).collect();
            letters.len() == 1
                && OPTIONS
                    .iter()
                    .any(|(_, short, value)| *short == Some(letters[0]) && *value)
        };
        position += if takes_separate_value { 2 } else { 1 };
    }
    let position = position.min(words.len());
    let options = words[..position].to_vec();
    let script = words.get(position).cloned();
    let rest = words.get(position + 1..).unwrap_or_default().to_vec();
    (options, script, rest)
}

fn whole(name: &str, text: &str, origin: Origin) -> Result<u64, String> {
    text.trim()
        .parse::<u64>()
        .map_err(|_| format!("{origin}: --{name}: expected a whole number, got {text:?}"))
}

/// Slurm's `--time`: minutes, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`,
/// `D-HH:MM:SS`; in seconds.
pub fn slurm_time_seconds(text: &str) -> Result<u64, String> {
    let bad = || {
        format!(
            "expected minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (Slurm's forms), \
             got {text:?}"
        )
    };
    let text = text.trim();
    if text.eq_ignore_ascii_case("infinite") || text.eq_ignore_ascii_case("unlimited") {
        return Err("muster has no unlimited time; leave --time out for no limit".to_string());
    }
    let number = |part: &str| part.parse::<u64>().map_err(|_| bad());
    let (days, rest) = match text.split_once('-') {
        Some((days, rest)) => (Some(number(days)?), rest),
        None => (None, text),
    };
    let parts: Vec<u64> = rest.split(':').map(number).collect::<Result<_, _>>()?;
    let seconds = match (days, parts.as_slice()) {
        (None, [minutes]) => minutes * 60,
        (None, [minutes, seconds]) => minutes * 60 + seconds,
        (None, [hours, minutes, seconds]) => hours * 3600 + minutes * 60 + seconds,
        (Some(days), [hours]) => days * 86_400 + hours * 3600,
        (Some(days), [hours, minutes]) => days * 86_400 + hours * 3600 + minutes * 60,
        (Some(days), [hours, minutes, seconds]) => {
            days * 86_400 + hours * 3600 + minutes * 60 + seconds
        }
        _ => return Err(bad()),
    };
    Ok(seconds)
}

/// Slurm's memory sizes (`16G`, `512M`, `1T`, `4096`: MiB by default), in
/// MiB.
fn slurm_memory_mib(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let value: u64 = number
        .parse()
        .map_err(|_| format!("expected a size like 16G, 512M or 4096 (MiB), got {text:?}"))?;
    let factor = match unit.to_ascii_uppercase().trim_end_matches('B') {
        "" | "M" => 1,
        "G" => 1024,
        "T" => 1024 * 1024,
        "K" => return Ok(value.div_ceil(1024)),
        _ => {
            return Err(format!(
                "unknown size unit in {text:?}; use K, M, G or T (Slurm's)"
            ));
        }
    };
    Ok(value * factor)
}

/// GPUs from `--gres` (`gpu:4`, `gpu:a100:4`, `gpu`): the count and the
/// type, if named.
fn gres_gpus(text: &str) -> Result<(u64, Option<String>), String> {
    let mut count = None;
    let mut kind = None;
    for resource in text.split(',') {
        let parts: Vec<&str> = resource.trim().split(':').collect();
        match parts.as_slice() {
            ["gpu"] => count = Some(1),
            ["gpu", n] if n.parse::<u64>().is_ok() => count = n.parse().ok(),
            ["gpu", t] => {
                count = Some(1);
                kind = Some(t.to_string());
            }
            ["gpu", t, n] => {
                count = Some(
                    n.parse()
                        .map_err(|_| format!("--gres: {n:?} is not a GPU count"))?,
                );
                kind = Some(t.to_string());
            }
            _ => {
                return Err(format!(
                    "--gres: only GPUs are understood (gpu:N or gpu:TYPE:N), got {resource:?}"
                ));
            }
        }
    }
    count
        .map(|count| (count, kind))
        .ok_or_else(|| format!("--gres: no GPUs in {text:?}"))
}

/// A GPU count that may name a type (`4`, `a100:4`).
fn typed_count(name: &str, text: &str, origin: Origin) -> Result<(u64, Option<String>), String> {
    match text.rsplit_once(':') {
        Some((kind, count)) => Ok((whole(name, count, origin)?, Some(kind.to_string()))),
        None => Ok((whole(name, text, origin)?, None)),
    }
}

/// A DNS label from a Slurm job name (`My_Train.v2` -> `my-train-v2`).
fn job_name(text: &str) -> String {
    let cleaned: String = text
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let mut name = String::new();
    for c in cleaned.chars() {
        if c == '-' && (name.is_empty() || name.ends_with('-')) {
            continue;
        }
        name.push(c);
    }
    let name: String = name.chars().take(63).collect();
    let name = name.trim_end_matches('-').to_string();
    if name.is_empty() {
        "batch".to_string()
    } else {
        name
    }
}

/// Slurm's `--dependency` (`afterok:12:13,afterany:14`) as `after` entries.
fn dependencies(text: &str) -> Result<Vec<String>, String> {
    if text.contains('?') {
        return Err(
            "--dependency: \"?\" (any one of) is not supported; muster waits for all".to_string(),
        );
    }
    let mut after = Vec::new();
    for part in text.split(',').filter(|p| !p.trim().is_empty()) {
        let mut pieces = part.trim().split(':');
        let kind = pieces.next().unwrap_or_default();
        let kind = match kind {
            "afterok" => "ok",
            "afterany" => "any",
            "afternotok" => "notok",
            other => {
                return Err(format!(
                    "--dependency: {other:?} is not supported; use afterok, afterany or \
                     afternotok"
                ));
            }
        };
        let mut any = false;
        for id in pieces {
            // `afterok:12+30` (a delay) is not supported either.
            let id = id.trim();
            if id.parse::<u64>().is_err() {
                return Err(format!("--dependency: {id:?} is not a job id"));
            }
            after.push(format!("{kind}:{id}"));
            any = true;
        }
        if !any {
            return Err(format!("--dependency: {part:?} names no job"));
        }
    }
    Ok(after)
}

/// Reads `script` (named `file_name`, submitted from `submit_dir`) with
/// `command_line` options (which win over the script's). Errors: every
/// problem, one per entry.
pub fn read_batch_script(
    script: &str,
    file_name: &str,
    submit_dir: &str,
    command_line: &[String],
) -> Result<BatchJob, Vec<String>> {
    let mut errors = Vec::new();
    if script.len() > MAX_SCRIPT_BYTES {
        return Err(vec![format!(
            "the script is {} KiB; at most {} KiB (it travels as one argument)",
            script.len() / 1024,
            MAX_SCRIPT_BYTES / 1024
        )]);
    }
    if script.contains('\0') {
        return Err(vec![
            "the script contains a NUL byte; is it a text file?".to_string(),
        ]);
    }
    let Some(shebang) = script.lines().next().and_then(|l| l.strip_prefix("#!")) else {
        return Err(vec![
            "the first line must be #! and an interpreter, as Slurm requires (e.g. \
             #!/bin/bash)"
                .to_string(),
        ]);
    };
    let interpreter: Vec<String> = shebang.split_whitespace().map(str::to_string).collect();
    if interpreter.is_empty() {
        return Err(vec!["the #! line names no interpreter".to_string()]);
    }
    let mut unknown = Vec::new();
    let mut found = Vec::new();
    let mut notes = Vec::new();
    // muster runs the script on every node already, and has no srun.
    if let Some((number, _)) = script.lines().enumerate().find(|(_, line)| {
        let line = line.trim_start();
        line.starts_with("srun ") || line.contains("$(srun") || line.contains("| srun ")
    }) {
        notes.push(format!(
            "line {} calls srun: muster has none, and runs this script on every node of the \
             job already; run the command directly (drop `srun` and its options)",
            number + 1
        ));
    }
    for (number, line) in script.lines().enumerate().skip(1) {
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        let Some(rest) = trimmed.strip_prefix('#') else {
            // Slurm stops at the first command.
            break;
        };
        let Some(rest) = rest.strip_prefix("SBATCH") else {
            continue;
        };
        let origin = Origin::Line(number + 1);
        match words(rest) {
            Ok(words) => found.extend(options(&words, origin, &mut unknown, &mut errors)),
            Err(problem) => errors.push(format!("{origin}: {problem}")),
        }
    }
    // The command line's come last, so they win.
    found.extend(options(
        command_line,
        Origin::CommandLine,
        &mut unknown,
        &mut errors,
    ));
    let mut last: std::collections::BTreeMap<&str, (Option<String>, Origin)> =
        std::collections::BTreeMap::new();
    for (name, value, origin) in found {
        last.insert(name, (value, origin));
    }
    let get = |name: &str| last.get(name).and_then(|(v, o)| v.clone().map(|v| (v, *o)));
    let mut spec = json!({});
    let mut env = serde_json::Map::new();
    let mut check = |result: Result<Value, String>| match result {
        Ok(value) => Some(value),
        Err(problem) => {
            errors.push(problem);
            None
        }
    };

    let name = match get("job-name") {
        Some((name, _)) => name,
        None => std::path::Path::new(file_name)
            .file_stem()
            .map_or("batch".to_string(), |s| s.to_string_lossy().into_owned()),
    };
    spec["name"] = job_name(&name).into();

    let nodes = match get("nodes") {
        None => 1,
        Some((text, origin)) => {
            // `2-4`: a range; muster takes the least.
            let least = text.split('-').next().unwrap_or_default();
            if least != text {
                notes.push(format!(
                    "--nodes {text}: muster does not grow a job; it asks for {least} node(s)"
                ));
            }
            check(whole("nodes", least, origin).map(Value::from))
                .and_then(|v| v.as_u64())
                .unwrap_or(1)
        }
    };
    spec["nodes"] = nodes.into();
    let per_node = match (get("ntasks-per-node"), get("ntasks")) {
        (Some((text, origin)), _) => {
            check(whole("ntasks-per-node", &text, origin).map(Value::from))
                .and_then(|v| v.as_u64())
                .unwrap_or(1)
        }
        (None, Some((text, origin))) => check(whole("ntasks", &text, origin).map(Value::from))
            .and_then(|v| v.as_u64())
            .unwrap_or(1)
            .div_ceil(nodes.max(1)),
        (None, None) => 1,
    };
    if per_node > 1 {
        notes.push(format!(
            "--ntasks-per-node {per_node}: the script runs once per node (start {per_node} \
             processes in it, e.g. torchrun --nproc-per-node {per_node}); SLURM_NTASKS counts \
             {per_node} per node"
        ));
    }
    env.insert("SLURM_NTASKS_PER_NODE".into(), per_node.to_string().into());

    let mut gpu_type = None;
    let gpus = if let Some((text, origin)) = get("gpus-per-node") {
        check(
            typed_count("gpus-per-node", &text, origin).map(|(count, kind)| {
                gpu_type = kind;
                Value::from(count)
            }),
        )
    } else if let Some((text, origin)) = get("gpus") {
        check(
            typed_count("gpus", &text, origin).and_then(|(count, kind)| {
                gpu_type = kind;
                if count % nodes.max(1) != 0 {
                    return Err(format!(
                        "{origin}: --gpus {count} does not divide among {nodes} nodes; use \
                         --gpus-per-node"
                    ));
                }
                Ok(Value::from(count / nodes.max(1)))
            }),
        )
    } else if let Some((text, origin)) = get("gres") {
        check(
            gres_gpus(&text)
                .map(|(count, kind)| {
                    gpu_type = kind;
                    Value::from(count)
                })
                .map_err(|e| format!("{origin}: {e}")),
        )
    } else {
        None
    };
    if let Some(gpus) = gpus {
        spec["gpus"] = gpus;
    }
    if let Some(kind) = gpu_type {
        notes.push(format!(
            "GPU type {kind:?}: not used to choose nodes; muster names models as its nodes \
             report them (`muster nodes`), in a spec's gpu_models"
        ));
    }
    let cpus_per_task = match get("cpus-per-task") {
        Some((text, origin)) => {
            check(whole("cpus-per-task", &text, origin).map(Value::from)).and_then(|v| v.as_u64())
        }
        None => None,
    };
    if let Some(cpus) = cpus_per_task {
        spec["cpus"] = (cpus * per_node).into();
        env.insert("SLURM_CPUS_PER_TASK".into(), cpus.to_string().into());
    }
    let cpus_per_node = cpus_per_task.unwrap_or(1) * per_node;
    let memory = if let Some((text, origin)) = get("mem") {
        check(
            slurm_memory_mib(&text)
                .map(Value::from)
                .map_err(|e| format!("{origin}: --mem: {e}")),
        )
    } else if let Some((text, origin)) = get("mem-per-cpu") {
        check(
            slurm_memory_mib(&text)
                .map(|mib| Value::from(mib * cpus_per_node))
                .map_err(|e| format!("{origin}: --mem-per-cpu: {e}")),
        )
    } else if let Some((text, origin)) = get("mem-per-gpu") {
        let gpus = spec["gpus"].as_u64().unwrap_or(0).max(1);
        check(
            slurm_memory_mib(&text)
                .map(|mib| Value::from(mib * gpus))
                .map_err(|e| format!("{origin}: --mem-per-gpu: {e}")),
        )
    } else {
        None
    };
    if let Some(memory) = memory {
        if memory.as_u64() == Some(0) {
            notes.push(
                "--mem 0 (all of a node's memory): not supported; the default, 1GiB, applies"
                    .to_string(),
            );
        } else {
            spec["memory"] = memory;
        }
    }
    if let Some((text, origin)) = get("time")
        && let Some(seconds) = check(
            slurm_time_seconds(&text)
                .map(Value::from)
                .map_err(|e| format!("{origin}: --time: {e}")),
        )
    {
        spec["max_runtime"] = seconds;
    }
    if let Some((text, _)) = get("array") {
        spec["array"] = text.into();
    }
    if let Some((text, origin)) = get("dependency")
        && let Some(after) = check(
            dependencies(&text)
                .map(Value::from)
                .map_err(|e| format!("{origin}: {e}")),
        )
    {
        spec["after"] = after;
    }
    if let Some((pool, _)) = get("partition") {
        spec["pool"] = pool.into();
    }
    if let Some((queue, _)) = get("account") {
        spec["queue"] = queue.into();
    }
    if let Some((qos, _)) = get("qos") {
        spec["priority_class"] = qos.into();
    }
    let working_dir = get("chdir").map_or(submit_dir.to_string(), |(dir, _)| {
        if dir.starts_with('/') {
            dir
        } else {
            format!("{}/{dir}", submit_dir.trim_end_matches('/'))
        }
    });
    spec["working_dir"] = working_dir.into();
    env.insert("SLURM_SUBMIT_DIR".into(), submit_dir.into());
    env.insert("SLURM_SUBMIT_HOST".into(), "muster".into());
    if let Some((text, origin)) = get("signal") {
        // `[B:]SIG[@SECONDS]`: muster sends it when it stops the job, then
        // waits the seconds (its grace period).
        let text = text.strip_prefix("B:").unwrap_or(&text);
        let (signal, grace) = match text.split_once('@') {
            Some((signal, grace)) => (signal, Some(grace)),
            None => (text, None),
        };
        let mut checkpoint = json!({ "signal": signal });
        if let Some(grace) = grace
            && let Some(seconds) = check(whole("signal", grace, origin).map(Value::from))
        {
            checkpoint["grace_period"] = seconds;
        }
        spec["checkpoint"] = checkpoint;
    }
    if last.contains_key("requeue") || last.contains_key("no-requeue") {
        let requeue = match (last.get("requeue"), last.get("no-requeue")) {
            (Some((_, Origin::CommandLine)), _) => true,
            (_, Some((_, Origin::CommandLine))) => false,
            (Some((_, Origin::Line(a))), Some((_, Origin::Line(b)))) => a > b,
            (requeue, _) => requeue.is_some(),
        };
        spec["retry"] = json!({ "on_node_failure": requeue });
    }
    for (option, why) in [
        (
            "output",
            "muster keeps every rank's output: `muster logs ID` (--rank N for one rank)",
        ),
        (
            "error",
            "muster keeps every rank's output: `muster logs ID` (--rank N for one rank)",
        ),
        ("open-mode", "muster keeps every rank's output"),
        ("mail-type", "muster sends no mail"),
        ("mail-user", "muster sends no mail"),
        ("comment", "not kept"),
    ] {
        if let Some((value, _)) = get(option) {
            notes.push(format!("--{option} {value}: not applied; {why}"));
        }
    }
    let export = get("export").map_or("ALL".to_string(), |(export, _)| export);
    spec["env"] = env.into();
    spec["slurm_env"] = true.into();
    let mut command = interpreter;
    command.extend(["-c".to_string(), script.to_string(), file_name.to_string()]);
    spec["command"] = command.into();
    if !errors.is_empty() {
        return Err(errors);
    }
    Ok(BatchJob {
        spec,
        export,
        notes,
        unknown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(script: &str) -> BatchJob {
        read_batch_script(script, "train.sh", "/home/alice/proj", &[]).expect("a valid script")
    }

    /// A multi-node PyTorch job as cluster guides write them.
    const TORCHRUN: &str = r#"#!/bin/bash
#SBATCH --job-name=llama_finetune
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=32
#SBATCH --mem=480G
#SBATCH --time=2-00:00:00
#SBATCH --partition=training
#SBATCH --account=llm-team
#SBATCH --qos=high
#SBATCH --output=logs/%x-%j.out
#SBATCH --error=logs/%x-%j.err

# Set up the rendezvous from Slurm's variables.
export MASTER_ADDR=$(echo $SLURM_JOB_NODELIST | cut -d, -f1)
#SBATCH --nodes=16
torchrun --nnodes $SLURM_NNODES --nproc-per-node 8 train.py
"#;

    #[test]
    fn a_torchrun_script_reads_into_a_gang() {
        let job = read(TORCHRUN);
        let spec = &job.spec;
        assert_eq!(spec["name"], "llama-finetune");
        // The #SBATCH after the first command is not read (Slurm's rule).
        assert_eq!(spec["nodes"], 2);
        assert_eq!(spec["gpus"], 8);
        assert_eq!(spec["cpus"], 32);
        assert_eq!(spec["memory"], 480 * 1024);
        assert_eq!(spec["max_runtime"], 2 * 86_400);
        assert_eq!(spec["pool"], "training");
        assert_eq!(spec["queue"], "llm-team");
        assert_eq!(spec["priority_class"], "high");
        assert_eq!(spec["working_dir"], "/home/alice/proj");
        assert_eq!(spec["slurm_env"], true);
        assert_eq!(spec["env"]["SLURM_SUBMIT_DIR"], "/home/alice/proj");
        assert_eq!(spec["env"]["SLURM_CPUS_PER_TASK"], "32");
        assert_eq!(spec["command"][0], "/bin/bash");
        assert_eq!(spec["command"][1], "-c");
        assert_eq!(spec["command"][2], TORCHRUN);
        assert_eq!(spec["command"][3], "train.sh");
        assert!(job.unknown.is_empty(), "{:?}", job.unknown);
        assert_eq!(job.export, "ALL");
        // --output and --error are read and said to be not applied.
        assert!(
            job.notes
                .iter()
                .any(|n| n.starts_with("--output logs/%x-%j.out"))
        );
        assert!(job.notes.iter().any(|n| n.starts_with("--error")));
        // What it gives is a valid spec.
        crate::parse_job_spec_value(spec).expect("valid");
    }

    #[test]
    fn short_options_arrays_dependencies_and_the_command_line_win() {
        let script = "#!/usr/bin/env bash\n\
                      #SBATCH -J sweep -N 1 -c 4\n\
                      #SBATCH -t 90 -a 0-31%4 # thirty-two shards\n\
                      #SBATCH -d afterok:12:13,afterany:14\n\
                      #SBATCH --gpus-per-node=a100:2 --mem-per-cpu=2G\n\
                      #SBATCH -p dev\n\
                      python shard.py $SLURM_ARRAY_TASK_ID\n";
        let job = read_batch_script(
            script,
            "sweep.sh",
            "/work",
            &[
                "-p".to_string(),
                "debug".to_string(),
                "--time=1:30".to_string(),
            ],
        )
        .expect("valid");
        let spec = &job.spec;
        assert_eq!(spec["name"], "sweep");
        assert_eq!(spec["cpus"], 4);
        assert_eq!(spec["memory"], 8 * 1024);
        assert_eq!(spec["gpus"], 2);
        assert_eq!(spec["array"], "0-31%4");
        assert_eq!(
            spec["after"],
            serde_json::json!(["ok:12", "ok:13", "any:14"])
        );
        // The command line's --partition and --time win.
        assert_eq!(spec["pool"], "debug");
        assert_eq!(spec["max_runtime"], 90);
        assert_eq!(spec["command"][0], "/usr/bin/env");
        assert_eq!(spec["command"][1], "bash");
        assert!(job.notes.iter().any(|n| n.contains("GPU type \"a100\"")));
        let parsed = crate::parse_job_spec_value(spec).expect("valid");
        assert_eq!(parsed.array.map(|a| a.len()), Some(32));
        assert_eq!(parsed.after.len(), 3);
    }

    /// An array job as cluster guides write them, with srun inside.
    const ARRAY: &str = r#"#!/bin/bash
#
#SBATCH --job-name=array-demo      # short name
#SBATCH --output=slurm-%A.%a.out   # STDOUT file
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem-per-cpu=4G
#SBATCH --time=00:01:00
#SBATCH --array=0-4
#SBATCH --mail-type=all
#SBATCH --mail-user=alice@example.org

echo "My SLURM_ARRAY_JOB_ID is $SLURM_ARRAY_JOB_ID."
echo "My SLURM_ARRAY_TASK_ID is $SLURM_ARRAY_TASK_ID"
srun python myscript.py $SLURM_ARRAY_TASK_ID
"#;

    #[test]
    fn an_array_script_reads_with_notes_for_what_is_not_applied() {
        let job = read(ARRAY);
        let spec = &job.spec;
        assert_eq!(spec["name"], "array-demo");
        assert_eq!(spec["array"], "0-4");
        assert_eq!(spec["memory"], 4096);
        assert_eq!(spec["max_runtime"], 60);
        assert!(job.unknown.is_empty(), "{:?}", job.unknown);
        let notes = job.notes.join("\n");
        for expected in [
            "line 16 calls srun",
            "--output slurm-%A.%a.out: not applied",
            "--mail-type all: not applied; muster sends no mail",
        ] {
            assert!(notes.contains(expected), "{expected} missing in:\n{notes}");
        }
        crate::parse_job_spec_value(spec).expect("valid");
    }

    #[test]
    fn unknown_options_are_listed_with_their_lines() {
        let script = "#!/bin/sh\n\
                      #SBATCH --nodes 1\n\
                      #SBATCH --exclusive --constraint=a100\n\
                      #SBATCH --licenses=matlab\n\
                      echo hi\n";
        let job = read(script);
        assert_eq!(
            job.unknown,
            vec![
                "--exclusive (line 3)",
                "--constraint=a100 (line 3)",
                "--licenses=matlab (line 4)"
            ]
        );
    }

    #[test]
    fn bad_scripts_get_every_problem() {
        let errors = read_batch_script("echo no shebang\n", "x.sh", "/", &[]).expect_err("bad");
        assert!(errors[0].contains("#!"), "{errors:?}");
        let script = "#!/bin/bash\n\
                      #SBATCH --nodes=two\n\
                      #SBATCH --time=forever\n\
                      #SBATCH --mem=16X\n\
                      #SBATCH --job-name=\"unclosed\n\
                      #SBATCH --dependency=singleton\n\
                      #SBATCH --gres=tmpfs:10G\n\
                      #SBATCH --array\n";
        let errors = read_batch_script(script, "x.sh", "/", &[]).expect_err("bad");
        let all = errors.join("\n");
        for expected in [
            "line 5: a quote is not closed",
            "line 8: --array needs a value",
            "--time: expected minutes",
            "--mem: unknown size unit",
            "singleton",
            "only GPUs are understood",
        ] {
            assert!(all.contains(expected), "{expected} missing in:\n{all}");
        }
        let errors = read_batch_script("#!/bin/sh\n#SBATCH --gpus=3 --nodes=2\n", "x.sh", "/", &[])
            .expect_err("bad");
        assert!(
            errors[0].contains("--gpus 3 does not divide among 2 nodes"),
            "{errors:?}"
        );
        let huge = format!("#!/bin/sh\n{}", "x".repeat(MAX_SCRIPT_BYTES));
        assert!(read_batch_script(&huge, "x.sh", "/", &[]).is_err());
    }

    #[test]
    fn the_command_line_splits_at_the_script() {
        let words: Vec<String> = [
            "-N",
            "2",
            "--time=10",
            "--gres",
            "gpu:1",
            "job.sh",
            "--lr",
            "3",
        ]
        .map(String::from)
        .to_vec();
        let (options, script, rest) = split_command_line(&words);
        assert_eq!(options, ["-N", "2", "--time=10", "--gres", "gpu:1"]);
        assert_eq!(script.as_deref(), Some("job.sh"));
        assert_eq!(rest, ["--lr", "3"]);
        let (options, script, _) = split_command_line(&["x.sh".to_string()]);
        assert!(options.is_empty());
        assert_eq!(script.as_deref(), Some("x.sh"));
        assert_eq!(split_command_line(&["-N".to_string()]).1, None);
    }

    #[test]
    fn slurm_times_read_every_form() {
        for (text, seconds) in [
            ("30", 1800),
            ("30:15", 1815),
            ("2:00:00", 7200),
            ("1-0", 86_400),
            ("1-2:30", 95_400),
            ("0-0:0:45", 45),
        ] {
            assert_eq!(slurm_time_seconds(text), Ok(seconds), "{text}");
        }
        for bad in ["", "1:2:3:4", "x", "1-", "UNLIMITED"] {
            assert!(slurm_time_seconds(bad).is_err(), "{bad}");
        }
    }
}
