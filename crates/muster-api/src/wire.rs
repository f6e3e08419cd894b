//! The job spec as it travels: what a user writes in YAML or JSON, before its
//! values are checked. Representations are lenient (a quantity may be a
//! number or a string); values are checked by [`crate::validate`].

use crate::quantity::{format_duration, format_memory, milli_quantity};
use muster_model as model;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// A quantity as written: a number (`8`, `0.25`, `3600`) or a text
/// (`"16GiB"`, `"1h30m"`, `"0.25"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Quantity {
    Number(serde_json::Number),
    Text(String),
}

#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for Quantity {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Number)
                    .minimum(Some(0)),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .description(Some("with a unit: 16GiB, 1h30m, 0.25"))
                    .min_length(Some(1)),
            )
            .description(Some("a number, or a text with a unit"))
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for Quantity {}

#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for CommandSpec {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
        OneOfBuilder::new()
            .item(
                ArrayBuilder::new()
                    .items(ObjectBuilder::new().schema_type(Type::String))
                    .min_items(Some(1))
                    .description(Some("the program and its arguments, run as they are")),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .min_length(Some(1))
                    .description(Some("one string, run by sh -c")),
            )
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for CommandSpec {}

impl From<u64> for Quantity {
    fn from(value: u64) -> Self {
        Quantity::Number(serde_json::Number::from(value))
    }
}

impl From<&str> for Quantity {
    fn from(value: &str) -> Self {
        Quantity::Text(value.to_string())
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Quantity::Number(number) => write!(f, "{number}"),
            Quantity::Text(text) => f.write_str(&crate::error::quote(text)),
        }
    }
}

/// A command: a list of arguments run as they are, or one string run by
/// `sh -c`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CommandSpec {
    Argv(Vec<String>),
    Shell(String),
}

impl CommandSpec {
    /// The arguments to execute: a shell string becomes `["sh", "-c", text]`.
    pub fn argv(&self) -> Vec<String> {
        match self {
            CommandSpec::Argv(argv) => argv.clone(),
            CommandSpec::Shell(text) => vec!["sh".to_string(), "-c".to_string(), text.clone()],
        }
    }
}

/// How a job is told to stop (`checkpoint:` in the spec).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grace_period: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval: Option<Quantity>,
}

/// What happens when a task ends badly (`retry:` in the spec).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RetrySpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_node_failure: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub on_exit_failure: Option<bool>,
}

/// Where a gang's tasks may go (`topology:` in the spec).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TopologySpec {
    /// `required` or `preferred`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_rack: Option<String>,
}

/// Schemas of the spec's fields written out where the reader takes more
/// shapes than the Rust type says (a scalar for a list, whole numbers and
/// booleans as text): the document must let through all the reader
/// accepts; what the validator then refuses answers 422.
#[cfg(feature = "openapi")]
mod shapes {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::Schema;

    fn schema(value: serde_json::Value) -> RefOr<Schema> {
        serde_json::from_value(value).unwrap_or_else(|_| RefOr::T(Schema::default()))
    }

    /// Text, a whole number or a boolean, written out as text.
    fn scalar() -> serde_json::Value {
        serde_json::json!({"type": ["string", "integer", "boolean"]})
    }

    pub fn gpu_models() -> RefOr<Schema> {
        schema(serde_json::json!({
            "description": "GPU models the job may run on (any of them): one, or a list",
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": scalar()},
                {"type": "null"}
            ]
        }))
    }

    pub fn after() -> RefOr<Schema> {
        let dependency = serde_json::json!({"type": ["string", "integer"]});
        schema(serde_json::json!({
            "description": "jobs to wait for: 12 (to succeed), \"any:12\" (to end), \"notok:12\" (to fail); one, a comma list, or a list",
            "anyOf": [
                dependency,
                {"type": "array", "items": dependency},
                {"type": "null"}
            ]
        }))
    }

    pub fn env() -> RefOr<Schema> {
        schema(serde_json::json!({
            "description": "variables: a value, or {secret: NAME} for a secret's",
            "type": ["object", "null"],
            "additionalProperties": {
                "anyOf": [
                    scalar(),
                    {
                        "type": "object",
                        "properties": {"secret": {"type": "string"}},
                        "required": ["secret"],
                        "additionalProperties": false
                    }
                ]
            }
        }))
    }

    pub fn array() -> RefOr<Schema> {
        schema(serde_json::json!({
            "description": "a job array in Slurm's notation: \"0-99%8\", \"1,3,5-7\", \"0-15:4\" (at most 10,000 elements, indices up to 4,000,000)",
            "type": ["string", "integer", "null"]
        }))
    }

    pub fn command() -> RefOr<Schema> {
        schema(serde_json::json!({
            "description": "the program and its arguments, run as they are; or one string, run by sh -c",
            "anyOf": [
                {"type": "array", "items": scalar(), "minItems": 1},
                {"type": "string", "minLength": 1}
            ]
        }))
    }
}

/// A job spec as written (version 1 of the wire format). `None` means "not
/// given": the default applies. Deserializing checks the field names and
/// the kinds of values (with suggestions for misspelt fields); converting
/// into [`muster_model::JobSpec`] checks the values.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    )]
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub queue: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub pool: Option<String>,
    /// `low`, `normal` (the default), `high` or `critical`, in any case.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority_class: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes: Option<Quantity>,
    /// Per node: whole GPUs (`8`) or a share of one GPU (`0.25`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Quantity>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(schema_with = shapes::gpu_models))]
    pub gpu_models: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_gpu_memory: Option<Quantity>,
    /// Per node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<Quantity>,
    /// Per node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(schema_with = shapes::command, required = true)
    )]
    pub command: Option<CommandSpec>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(schema_with = shapes::env))]
    pub env: BTreeMap<String, String>,
    /// Variables whose values are secrets (`env: {HF_TOKEN: {secret: hf}}`
    /// in a spec): variable → secret name.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(nullable))]
    pub secrets: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^/[^\\u0000]*$"))]
    pub working_dir: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^[!-~]+$"))]
    pub image: Option<String>,
    /// The secret with the credentials to pull `image` from a private
    /// registry (`USER:PASSWORD` or `{"username": ..., "password": ...}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub image_pull_secret: Option<String>,
    /// Host paths a container job's tasks see; the pool the job names must
    /// allow them (`muster pools set POOL --allow-mount PATH`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(max_items = 16))]
    pub mounts: Vec<MountSpec>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_runtime: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_runtime: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preemptible: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointSpec>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetrySpec>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology: Option<TopologySpec>,
    /// Jobs to wait for: `12` (to succeed), `"any:12"`, `"notok:12"`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(schema_with = shapes::after))]
    pub after: Vec<String>,
    /// A job array: `"0-99%8"` (Slurm's notation).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(schema_with = shapes::array))]
    pub array: Option<String>,
    /// Give tasks the `SLURM_*` variables too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slurm_env: Option<bool>,
    /// Stop the job once its GPUs have been idle this long.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<Quantity>,
    /// Set by muster on a service's replicas; a submission may not set it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceRefSpec>,
}

/// The service a replica belongs to (set by muster, never submitted).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceRefSpec {
    pub name: String,
    pub revision: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<Quantity>,
    /// `nodes` (the default) or `racks`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spread: Option<String>,
}

/// A host path mounted into a container job's tasks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MountSpec {
    /// The absolute path on the node.
    #[cfg_attr(feature = "openapi", schema(pattern = "^/[^\\u0000:,]{0,4095}$"))]
    pub source: String,
    /// Where the task sees it (absolute, inside the container).
    #[cfg_attr(feature = "openapi", schema(pattern = "^/[^\\u0000:,]{0,4095}$"))]
    pub target: String,
    /// Default: false (read and write).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
}

impl JobSpec {
    /// Reads a spec from a generic value (parsed YAML or JSON), checking
    /// field names and the kinds of values; every problem is reported.
    pub fn from_value(value: &serde_json::Value) -> Result<JobSpec, crate::SpecErrors> {
        crate::read::read_job_spec(value).into_result()
    }
}

impl<'de> Deserialize<'de> for JobSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        JobSpec::from_value(&value).map_err(serde::de::Error::custom)
    }
}

fn gpu_quantity(request: model::GpuRequest) -> Quantity {
    match request {
        model::GpuRequest::Whole(count) => Quantity::from(u64::from(count)),
        model::GpuRequest::Shared(share) => milli_quantity(u64::from(share.0)),
    }
}

fn duration_quantity(duration: std::time::Duration) -> Quantity {
    Quantity::Text(format_duration(duration))
}

fn memory_quantity(memory: model::MemoryMib) -> Quantity {
    Quantity::Text(format_memory(memory.0))
}

fn strength_name(strength: model::TopologyStrength) -> &'static str {
    match strength {
        model::TopologyStrength::Required => "required",
        model::TopologyStrength::Preferred => "preferred",
    }
}

/// Writes a validated spec back in wire form, every field explicit, so it
/// reads back into the same spec. (Durations keep whole seconds.)
impl From<&model::JobSpec> for JobSpec {
    fn from(spec: &model::JobSpec) -> Self {
        JobSpec {
            name: spec.name.clone(),
            queue: Some(spec.queue.0.clone()),
            pool: spec.pool.as_ref().map(|pool| pool.0.clone()),
            priority_class: Some(spec.priority_class.name.clone()),
            nodes: Some(Quantity::from(u64::from(spec.nodes))),
            gpus: Some(gpu_quantity(spec.gpus_per_node)),
            gpu_models: spec
                .gpu_models
                .iter()
                .map(|gpu_model| gpu_model.as_str().to_string())
                .collect(),
            min_gpu_memory: spec.min_gpu_memory.map(memory_quantity),
            cpus: Some(milli_quantity(spec.cpu_per_node.0)),
            memory: Some(memory_quantity(spec.memory_per_node)),
            command: Some(CommandSpec::Argv(spec.command.clone())),
            env: spec.env.clone(),
            secrets: spec.secrets.clone(),
            working_dir: spec.working_dir.clone(),
            image: spec.image.clone(),
            image_pull_secret: spec.image_pull_secret.clone(),
            mounts: spec
                .mounts
                .iter()
                .map(|mount| MountSpec {
                    source: mount.source.clone(),
                    target: mount.target.clone(),
                    read_only: Some(mount.read_only),
                })
                .collect(),
            max_runtime: spec.max_runtime.map(duration_quantity),
            estimated_runtime: spec.estimated_runtime.map(duration_quantity),
            preemptible: Some(spec.preemptible),
            checkpoint: Some(CheckpointSpec {
                signal: Some(spec.checkpoint.signal.name().to_string()),
                grace_period: Some(duration_quantity(spec.checkpoint.grace_period)),
                interval: spec.checkpoint.interval.map(duration_quantity),
            }),
            retry: Some(RetrySpec {
                max_attempts: Some(Quantity::from(u64::from(spec.retry.max_attempts))),
                on_node_failure: Some(spec.retry.on_node_failure),
                on_exit_failure: Some(spec.retry.on_exit_failure),
            }),
            topology: spec.topology.map(|topology| TopologySpec {
                same_rack: Some(strength_name(topology.same_rack).to_string()),
            }),
            after: spec.after.iter().map(ToString::to_string).collect(),
            array: spec.array.as_ref().map(ToString::to_string),
            slurm_env: spec.slurm_env.then_some(true),
            idle_timeout: spec.idle_timeout.map(duration_quantity),
            service: spec.service.as_ref().map(|service| ServiceRefSpec {
                name: service.name.clone(),
                revision: Some(Quantity::from(u64::from(service.revision))),
                port: service.port.map(|port| Quantity::from(u64::from(port))),
                spread: (service.spread == model::Spread::Racks).then(|| "racks".to_string()),
            }),
        }
    }
}

/// Reads one dependency: `12`, `ok:12`, `any:12`, `notok:12` (the Slurm
/// names `afterok:12`, `afterany:12`, `afternotok:12` too).
pub fn parse_dependency(text: &str) -> Result<model::Dependency, String> {
    const ACCEPTED: &str =
        "a job id like 12 (wait for it to succeed), \"any:12\" (to end) or \"notok:12\" (to fail)";
    let text = text.trim();
    let (kind, id) = match text.split_once(':') {
        None => (model::DependencyKind::Ok, text),
        Some((kind, id)) => match model::DependencyKind::parse(&kind.to_ascii_lowercase()) {
            Some(kind) => (kind, id),
            None => {
                return Err(format!(
                    "unknown dependency kind {}; expected {ACCEPTED}",
                    crate::error::quote(kind)
                ));
            }
        },
    };
    match id.trim().parse::<u64>() {
        Ok(id) if id > 0 => Ok(model::Dependency {
            job: model::JobId(id),
            kind,
        }),
        _ => Err(format!(
            "expected {ACCEPTED}, got {}",
            crate::error::quote(text)
        )),
    }
}

impl From<model::JobSpec> for JobSpec {
    fn from(spec: model::JobSpec) -> Self {
        JobSpec::from(&spec)
    }
}
