//! Reading a generic value (parsed YAML or JSON) into the wire [`JobSpec`]:
//! field names are checked against the known ones (unknown names get the
//! closest known one suggested) and values against the kinds each field
//! takes. Every problem is collected; nothing stops at the first.

use crate::error::{SpecError, describe_value};
use crate::quantity::DURATION_ACCEPTED;
use crate::wire::{CheckpointSpec, CommandSpec, JobSpec, Quantity, RetrySpec, TopologySpec};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};

/// Top-level fields, in the order errors are reported.
pub(crate) const JOB_FIELDS: &[&str] = &[
    "name",
    "queue",
    "pool",
    "priority_class",
    "nodes",
    "gpus",
    "gpu_models",
    "min_gpu_memory",
    "cpus",
    "memory",
    "command",
    "env",
    "secrets",
    "working_dir",
    "image",
    "image_pull_secret",
    "mounts",
    "max_runtime",
    "estimated_runtime",
    "preemptible",
    "checkpoint",
    "retry",
    "topology",
    "after",
    "array",
    "slurm_env",
    "idle_timeout",
    "service",
];
pub(crate) const CHECKPOINT_FIELDS: &[&str] = &["signal", "grace_period", "interval"];
pub(crate) const RETRY_FIELDS: &[&str] = &["max_attempts", "on_node_failure", "on_exit_failure"];
pub(crate) const TOPOLOGY_FIELDS: &[&str] = &["same_rack"];
pub(crate) const SERVICE_REF_FIELDS: &[&str] = &["name", "revision", "port", "spread"];

const SECTIONS: &[(&str, &[&str])] = &[
    ("checkpoint", CHECKPOINT_FIELDS),
    ("retry", RETRY_FIELDS),
    ("topology", TOPOLOGY_FIELDS),
    ("service", SERVICE_REF_FIELDS),
];

/// Names people use for a field in other tools (Slurm, Kubernetes, ...).
const ALIASES: &[(&str, &str)] = &[
    ("args", "command"),
    ("cmd", "command"),
    ("dependency", "after"),
    ("depends_on", "after"),
    ("environment", "env"),
    ("gpu_type", "gpu_models"),
    ("num_nodes", "nodes"),
    ("partition", "pool"),
    ("time", "max_runtime"),
    ("time_limit", "max_runtime"),
    ("timeout", "max_runtime"),
    ("walltime", "max_runtime"),
    ("workdir", "working_dir"),
];

/// How close (Jaro-Winkler, 0..=1) an unknown name must be to a known one
/// for it to be suggested.
const SUGGESTION_THRESHOLD: f64 = 0.8;

const NODES_ACCEPTED: &str = "a whole number like 2";
const GPUS_ACCEPTED: &str = "a number of GPUs like 8, or a share of one GPU like 0.25";
const CPUS_ACCEPTED: &str = "a number of CPUs like 4 or 0.5";
const MEMORY_ACCEPTED: &str = "a size like \"16GiB\" or \"512MiB\", or a whole number of MiB";
const ATTEMPTS_ACCEPTED: &str = "a whole number like 3";

/// What a spec reader found: the spec (fields with problems left unset) and
/// the problems, by kind. Shared by the job spec and the cluster spec.
pub(crate) struct Read<T> {
    pub(crate) spec: T,
    /// The document is not a mapping at all.
    pub(crate) document_errors: Vec<SpecError>,
    pub(crate) unknown_fields: Vec<SpecError>,
    /// Values of the wrong kind, or required fields missing.
    pub(crate) field_errors: Vec<SpecError>,
    /// Paths of fields that could not be read; later checks skip them so a
    /// problem is reported once.
    pub(crate) bad_paths: BTreeSet<String>,
}

impl<T> Read<T> {
    /// The spec, or every problem found (document, unknown fields, values).
    pub(crate) fn into_result(self) -> Result<T, crate::SpecErrors> {
        let errors: Vec<SpecError> = self
            .document_errors
            .into_iter()
            .chain(self.unknown_fields)
            .chain(self.field_errors)
            .collect();
        if errors.is_empty() {
            Ok(self.spec)
        } else {
            Err(crate::SpecErrors(errors))
        }
    }

    /// Whether a field (or the field or list it is part of) could not be
    /// read, so its problem has been reported already.
    pub(crate) fn already_reported(&self, path: &str) -> bool {
        self.bad_paths.iter().any(|bad| {
            path == bad
                || path
                    .strip_prefix(bad.as_str())
                    .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
        })
    }
}

/// The document as a mapping, or the error saying it is empty (`what` names
/// it) or not a mapping; `expected` says what it should be.
pub(crate) fn as_document<'v>(
    value: &'v Value,
    what: &str,
    expected: &str,
) -> Result<&'v Map<String, Value>, SpecError> {
    match value {
        Value::Object(map) => Ok(map),
        Value::Null => Err(SpecError::new(
            "",
            format!("the {what} is empty; expected {expected}"),
        )),
        other => Err(SpecError::new(
            "",
            format!("expected {expected}, got {}", describe_value(other)),
        )),
    }
}

/// An "unknown field" error for each key of `map` not in `accepted`, with
/// `suggest`'s closest known name when it has one.
pub(crate) fn unknown_field_errors(
    map: &Map<String, Value>,
    prefix: &str,
    accepted: &[&str],
    suggest: impl Fn(&str) -> Option<String>,
) -> Vec<SpecError> {
    map.keys()
        .filter(|key| !accepted.contains(&key.as_str()))
        .map(|key| {
            let message = match suggest(key) {
                Some(suggestion) => format!("unknown field; did you mean {suggestion:?}?"),
                None => format!("unknown field; accepted: {}", accepted.join(", ")),
            };
            SpecError::new(field_path(prefix, key), message)
        })
        .collect()
}

pub(crate) fn read_job_spec(value: &Value) -> Read<JobSpec> {
    let mut reader = Reader::default();
    let spec = match as_document(
        value,
        "spec",
        "a mapping of fields with at least name and command",
    ) {
        Ok(map) => reader.job_spec(map),
        Err(error) => {
            reader.document_errors.push(error);
            JobSpec::default()
        }
    };
    Read {
        spec,
        document_errors: reader.document_errors,
        unknown_fields: reader.unknown_fields,
        field_errors: reader.field_errors,
        bad_paths: reader.bad_paths,
    }
}

/// `prefix.key`, or `prefix["key"]` when the key is not a plain name.
pub(crate) fn field_path(prefix: &str, key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match (prefix.is_empty(), plain) {
        (true, true) => key.to_string(),
        (false, true) => format!("{prefix}.{key}"),
        (_, false) => format!("{prefix}[{}]", crate::error::quote(key)),
    }
}

/// The known name closest to `unknown`, if one is close enough: first among
/// the fields of the same section, then (at top level) the fields of the
/// sections, as `section.field`.
fn suggest(unknown: &str, prefix: &str, accepted: &[&str]) -> Option<String> {
    let normalized = unknown.trim().to_ascii_lowercase().replace(['-', ' '], "_");
    if prefix.is_empty()
        && let Some((_, field)) = ALIASES.iter().find(|(alias, _)| *alias == normalized)
    {
        return Some((*field).to_string());
    }
    let same_level = closest_name(&normalized, accepted.iter().map(|field| field.to_string()));
    if same_level.is_some() || !prefix.is_empty() {
        return same_level;
    }
    closest_name(
        &normalized,
        SECTIONS.iter().flat_map(|(section, fields)| {
            fields.iter().map(move |field| format!("{section}.{field}"))
        }),
    )
}

/// Of `candidates` (dotted paths compare by their last part), the one most
/// like `normalized` (lower case, `_` for `-` and spaces), if close enough.
pub(crate) fn closest_name(
    normalized: &str,
    candidates: impl IntoIterator<Item = String>,
) -> Option<String> {
    let mut best: Option<(f64, String)> = None;
    for candidate in candidates {
        let leaf = candidate.rsplit('.').next().unwrap_or(&candidate);
        let score = strsim::jaro_winkler(normalized, leaf);
        if score >= SUGGESTION_THRESHOLD
            && best
                .as_ref()
                .is_none_or(|(best_score, _)| score > *best_score)
        {
            best = Some((score, candidate));
        }
    }
    best.map(|(_, candidate)| candidate)
}

/// A string field's value; numbers and booleans must be quoted.
pub(crate) fn string_value(value: &Value) -> Result<String, String> {
    match value {
        Value::String(text) => Ok(text.clone()),
        scalar @ (Value::Number(_) | Value::Bool(_)) => Err(format!(
            "expected a string, got {}; put it in quotes",
            describe_value(scalar)
        )),
        other => Err(format!("expected a string, got {}", describe_value(other))),
    }
}

/// A quantity field's value, as written (checked later).
pub(crate) fn quantity_value(value: &Value, accepted: &str) -> Result<Quantity, String> {
    match value {
        Value::Number(number) => Ok(Quantity::Number(number.clone())),
        Value::String(text) => Ok(Quantity::Text(text.clone())),
        other => Err(format!(
            "expected {accepted}, got {}",
            describe_value(other)
        )),
    }
}

/// A scalar as text, for command arguments, env values and model names:
/// strings as they are, whole numbers and booleans written out. Fractions
/// are refused: YAML and JSON may not keep them as written.
fn scalar_text(value: &Value) -> Result<String, String> {
    match value {
        Value::String(text) => Ok(text.clone()),
        Value::Bool(flag) => Ok(flag.to_string()),
        Value::Number(number) if number.is_i64() || number.is_u64() => Ok(number.to_string()),
        Value::Number(number) => Err(format!(
            "expected a string, got {number}; put it in quotes so it is kept exactly as written"
        )),
        other => Err(format!("expected a string, got {}", describe_value(other))),
    }
}

/// A present value: absent and null both mean "not given".
pub(crate) fn given<'v>(map: &'v Map<String, Value>, key: &str) -> Option<&'v Value> {
    map.get(key).filter(|value| !value.is_null())
}

#[derive(Default)]
struct Reader {
    document_errors: Vec<SpecError>,
    unknown_fields: Vec<SpecError>,
    field_errors: Vec<SpecError>,
    bad_paths: BTreeSet<String>,
}

impl Reader {
    fn fail(&mut self, field: &str, error_path: String, message: String) {
        self.bad_paths.insert(field.to_string());
        self.field_errors.push(SpecError::new(error_path, message));
    }

    fn check_field_names(&mut self, map: &Map<String, Value>, prefix: &str, accepted: &[&str]) {
        self.unknown_fields
            .extend(unknown_field_errors(map, prefix, accepted, |key| {
                suggest(key, prefix, accepted)
            }));
    }

    fn job_spec(&mut self, map: &Map<String, Value>) -> JobSpec {
        self.check_field_names(map, "", JOB_FIELDS);
        let name = match given(map, "name") {
            None => {
                self.fail(
                    "name",
                    "name".to_string(),
                    "required: a name like \"train-llama\" (lowercase letters, digits and '-')"
                        .to_string(),
                );
                String::new()
            }
            Some(_) => self.string(map, "name", "name").unwrap_or_default(),
        };
        JobSpec {
            name,
            queue: self.string(map, "queue", "queue"),
            pool: self.string(map, "pool", "pool"),
            priority_class: self.string(map, "priority_class", "priority_class"),
            nodes: self.quantity(map, "nodes", "nodes", NODES_ACCEPTED),
            gpus: self.quantity(map, "gpus", "gpus", GPUS_ACCEPTED),
            gpu_models: self.gpu_models(map),
            min_gpu_memory: self.quantity(map, "min_gpu_memory", "min_gpu_memory", MEMORY_ACCEPTED),
            cpus: self.quantity(map, "cpus", "cpus", CPUS_ACCEPTED),
            memory: self.quantity(map, "memory", "memory", MEMORY_ACCEPTED),
            command: self.command(map),
            secrets: self.secrets(map),
            env: self.env(map),
            working_dir: self.string(map, "working_dir", "working_dir"),
            image: self.string(map, "image", "image"),
            image_pull_secret: self.string(map, "image_pull_secret", "image_pull_secret"),
            mounts: self.mounts(map),
            max_runtime: self.quantity(map, "max_runtime", "max_runtime", DURATION_ACCEPTED),
            estimated_runtime: self.quantity(
                map,
                "estimated_runtime",
                "estimated_runtime",
                DURATION_ACCEPTED,
            ),
            preemptible: self.boolean(map, "preemptible", "preemptible"),
            checkpoint: self
                .section(map, "checkpoint", CHECKPOINT_FIELDS)
                .map(|section| CheckpointSpec {
                    signal: self.string(section, "signal", "checkpoint.signal"),
                    grace_period: self.quantity(
                        section,
                        "grace_period",
                        "checkpoint.grace_period",
                        DURATION_ACCEPTED,
                    ),
                    interval: self.quantity(
                        section,
                        "interval",
                        "checkpoint.interval",
                        DURATION_ACCEPTED,
                    ),
                }),
            retry: self
                .section(map, "retry", RETRY_FIELDS)
                .map(|section| RetrySpec {
                    max_attempts: self.quantity(
                        section,
                        "max_attempts",
                        "retry.max_attempts",
                        ATTEMPTS_ACCEPTED,
                    ),
                    on_node_failure: self.boolean(
                        section,
                        "on_node_failure",
                        "retry.on_node_failure",
                    ),
                    on_exit_failure: self.boolean(
                        section,
                        "on_exit_failure",
                        "retry.on_exit_failure",
                    ),
                }),
            topology: self
                .section(map, "topology", TOPOLOGY_FIELDS)
                .map(|section| TopologySpec {
                    same_rack: self.string(section, "same_rack", "topology.same_rack"),
                }),
            after: self.after(map),
            array: given(map, "array").and_then(|value| {
                scalar_text(value)
                    .map_err(|message| self.fail("array", "array".to_string(), message))
                    .ok()
            }),
            slurm_env: self.boolean(map, "slurm_env", "slurm_env"),
            idle_timeout: self.quantity(map, "idle_timeout", "idle_timeout", DURATION_ACCEPTED),
            service: self
                .section(map, "service", SERVICE_REF_FIELDS)
                .map(|section| crate::wire::ServiceRefSpec {
                    name: self
                        .string(section, "name", "service.name")
                        .unwrap_or_default(),
                    revision: self.quantity(
                        section,
                        "revision",
                        "service.revision",
                        "a whole number like 2",
                    ),
                    port: self.quantity(section, "port", "service.port", "a port like 8080"),
                    spread: self.string(section, "spread", "service.spread"),
                }),
        }
    }

    /// `after:` as a list of ids and `kind:id` texts, one of them, or a
    /// comma-separated text.
    fn after(&mut self, map: &Map<String, Value>) -> Vec<String> {
        const ACCEPTED: &str = "a job id like 12, a text like \"any:12\", or a list of them";
        let (items, listed): (Vec<&Value>, bool) = match given(map, "after") {
            None => return Vec::new(),
            Some(Value::Array(items)) => (items.iter().collect(), true),
            Some(other) => (vec![other], false),
        };
        let mut texts = Vec::new();
        for (index, item) in items.into_iter().enumerate() {
            let path = if listed {
                format!("after[{index}]")
            } else {
                "after".to_string()
            };
            match item {
                Value::Number(_) | Value::String(_) => match scalar_text(item) {
                    Ok(text) => texts.extend(
                        text.split(',')
                            .map(str::trim)
                            .filter(|part| !part.is_empty())
                            .map(str::to_string),
                    ),
                    Err(message) => self.fail("after", path, message),
                },
                other => self.fail(
                    "after",
                    path,
                    format!("expected {ACCEPTED}, got {}", describe_value(other)),
                ),
            }
        }
        texts
    }

    fn string(&mut self, map: &Map<String, Value>, key: &str, path: &str) -> Option<String> {
        string_value(given(map, key)?)
            .map_err(|message| self.fail(path, path.to_string(), message))
            .ok()
    }

    fn quantity(
        &mut self,
        map: &Map<String, Value>,
        key: &str,
        path: &str,
        accepted: &str,
    ) -> Option<Quantity> {
        quantity_value(given(map, key)?, accepted)
            .map_err(|message| self.fail(path, path.to_string(), message))
            .ok()
    }

    fn boolean(&mut self, map: &Map<String, Value>, key: &str, path: &str) -> Option<bool> {
        match given(map, key)? {
            Value::Bool(flag) => Some(*flag),
            other => {
                self.fail(
                    path,
                    path.to_string(),
                    format!("expected true or false, got {}", describe_value(other)),
                );
                None
            }
        }
    }

    fn mounts(&mut self, map: &Map<String, Value>) -> Vec<crate::wire::MountSpec> {
        const ACCEPTED: &str =
            "a list of {source: /path/on/the/node, target: /path/in/the/task, read_only: true}";
        let Some(value) = given(map, "mounts") else {
            return Vec::new();
        };
        let Value::Array(items) = value else {
            self.fail(
                "mounts",
                "mounts".to_string(),
                format!("expected {ACCEPTED}, got {}", describe_value(value)),
            );
            return Vec::new();
        };
        let mut mounts = Vec::new();
        for (index, item) in items.iter().enumerate() {
            let path = format!("mounts[{index}]");
            let Value::Object(fields) = item else {
                self.fail(
                    "mounts",
                    path,
                    format!("expected {ACCEPTED}, got {}", describe_value(item)),
                );
                continue;
            };
            self.check_field_names(fields, &path, &["source", "target", "read_only"]);
            let source = self.string(fields, "source", &format!("{path}.source"));
            let target = self.string(fields, "target", &format!("{path}.target"));
            let read_only = self.boolean(fields, "read_only", &format!("{path}.read_only"));
            match (source, target) {
                (Some(source), Some(target)) => mounts.push(crate::wire::MountSpec {
                    source,
                    target,
                    read_only,
                }),
                _ => self.fail(
                    "mounts",
                    path,
                    "needs a source (the path on the node) and a target (the path in the task)"
                        .to_string(),
                ),
            }
        }
        mounts
    }

    fn gpu_models(&mut self, map: &Map<String, Value>) -> Vec<String> {
        const ACCEPTED: &str = "a GPU model like \"H100-80GB\", or a list of them";
        match given(map, "gpu_models") {
            None => Vec::new(),
            Some(Value::String(model)) => vec![model.clone()],
            Some(Value::Array(items)) => {
                let mut models = Vec::new();
                for (index, item) in items.iter().enumerate() {
                    match item {
                        Value::Array(_) | Value::Object(_) | Value::Null => self.fail(
                            "gpu_models",
                            format!("gpu_models[{index}]"),
                            format!("expected {ACCEPTED}, got {}", describe_value(item)),
                        ),
                        scalar => match scalar_text(scalar) {
                            Ok(model) => models.push(model),
                            Err(message) => {
                                self.fail("gpu_models", format!("gpu_models[{index}]"), message)
                            }
                        },
                    }
                }
                models
            }
            Some(other) => {
                self.fail(
                    "gpu_models",
                    "gpu_models".to_string(),
                    format!("expected {ACCEPTED}, got {}", describe_value(other)),
                );
                Vec::new()
            }
        }
    }

    fn command(&mut self, map: &Map<String, Value>) -> Option<CommandSpec> {
        const ACCEPTED: &str =
            "a list of arguments like [python, train.py], or one string run by sh -c";
        match given(map, "command")? {
            Value::String(text) => Some(CommandSpec::Shell(text.clone())),
            Value::Array(items) => {
                let mut argv = Vec::new();
                let mut ok = true;
                for (index, item) in items.iter().enumerate() {
                    match scalar_text(item) {
                        Ok(argument) => argv.push(argument),
                        Err(message) => {
                            ok = false;
                            self.fail("command", format!("command[{index}]"), message);
                        }
                    }
                }
                ok.then_some(CommandSpec::Argv(argv))
            }
            other => {
                self.fail(
                    "command",
                    "command".to_string(),
                    format!("expected {ACCEPTED}, got {}", describe_value(other)),
                );
                None
            }
        }
    }

    /// Variables whose value is a secret: `env: {X: {secret: NAME}}`, and
    /// the wire form `secrets: {X: NAME}`.
    fn secrets(&mut self, map: &Map<String, Value>) -> BTreeMap<String, String> {
        let mut secrets = BTreeMap::new();
        if let Some(Value::Object(variables)) = given(map, "env") {
            for (key, value) in variables {
                if let Value::Object(reference) = value {
                    match (reference.len(), reference.get("secret")) {
                        (1, Some(Value::String(name))) => {
                            secrets.insert(key.clone(), name.clone());
                        }
                        _ => {
                            let path = field_path("env", key);
                            self.fail(
                                &path,
                                path.clone(),
                                "expected a value, or {secret: NAME} for a secret".to_string(),
                            );
                        }
                    }
                }
            }
        }
        match given(map, "secrets") {
            None => {}
            Some(Value::Object(variables)) => {
                for (key, value) in variables {
                    match value {
                        Value::String(name) => {
                            secrets.insert(key.clone(), name.clone());
                        }
                        other => {
                            let path = field_path("secrets", key);
                            self.fail(
                                &path,
                                path.clone(),
                                format!("expected a secret's name, got {}", describe_value(other)),
                            );
                        }
                    }
                }
            }
            Some(other) => self.fail(
                "secrets",
                "secrets".to_string(),
                format!(
                    "expected a mapping of variable names to secret names, got {}",
                    describe_value(other)
                ),
            ),
        }
        secrets
    }

    fn env(&mut self, map: &Map<String, Value>) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        match given(map, "env") {
            None => {}
            Some(Value::Object(variables)) => {
                for (key, value) in variables {
                    if value.is_object() {
                        // A secret: read by `secrets`.
                        continue;
                    }
                    match scalar_text(value) {
                        Ok(text) => {
                            env.insert(key.clone(), text);
                        }
                        Err(message) => {
                            let path = field_path("env", key);
                            self.fail(&path, path.clone(), message);
                        }
                    }
                }
            }
            Some(other) => self.fail(
                "env",
                "env".to_string(),
                format!(
                    "expected a mapping of variable names to values, got {}",
                    describe_value(other)
                ),
            ),
        }
        env
    }

    fn section<'v>(
        &mut self,
        map: &'v Map<String, Value>,
        key: &str,
        accepted: &[&str],
    ) -> Option<&'v Map<String, Value>> {
        match given(map, key)? {
            Value::Object(section) => {
                self.check_field_names(section, key, accepted);
                Some(section)
            }
            other => {
                self.fail(
                    key,
                    key.to_string(),
                    format!(
                        "expected a mapping with fields {}, got {}",
                        accepted.join(", "),
                        describe_value(other)
                    ),
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(suggest("gpu", "", JOB_FIELDS).as_deref(), Some("gpus"));
        assert_eq!(suggest("GPUs", "", JOB_FIELDS).as_deref(), Some("gpus"));
        assert_eq!(
            suggest("comand", "", JOB_FIELDS).as_deref(),
            Some("command")
        );
        assert_eq!(
            suggest("gpu-models", "", JOB_FIELDS).as_deref(),
            Some("gpu_models")
        );
        assert_eq!(
            suggest("timeout", "", JOB_FIELDS).as_deref(),
            Some("max_runtime")
        );
        assert_eq!(
            suggest("signal", "", JOB_FIELDS).as_deref(),
            Some("checkpoint.signal")
        );
        assert_eq!(
            suggest("singal", "checkpoint", CHECKPOINT_FIELDS).as_deref(),
            Some("signal")
        );
        assert_eq!(suggest("zzz", "", JOB_FIELDS), None);
    }

    #[test]
    fn paths_quote_odd_keys() {
        assert_eq!(field_path("", "gpus"), "gpus");
        assert_eq!(field_path("env", "HOME"), "env.HOME");
        assert_eq!(field_path("env", "MY VAR"), "env[\"MY VAR\"]");
        assert_eq!(field_path("", ""), "[\"\"]");
    }
}
