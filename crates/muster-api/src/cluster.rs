//! The cluster spec: a fleet described as groups of identical nodes, for the
//! simulator (`muster sim replay --cluster`) and for tests.
//!
//! ```yaml
//! node_groups:
//!   - name: dgx
//!     count: 4
//!     gpu_model: H100-80GB
//!     gpus: 8
//!     gpu_memory: 80GiB
//!     cpus: 112
//!     memory: 2TiB
//!     nvlink_domains: 1
//!     nodes_per_rack: 2
//!     pool: training
//! ```
//!
//! Reading goes in two steps, as for the job spec: YAML (through
//! serde-saphyr, with limits) into the wire [`ClusterSpec`], checking field
//! names and the kinds of values; then [`ClusterSpec::to_nodes`] checks the
//! values and builds one [`muster_model::NodeSpec`] per node. Every problem
//! is reported at once, each naming its field path (`node_groups[0].gpus`).
//!
//! Node `i` (from 0) of group `name` is `name-NNN`, in rack `name-rack-NN`
//! (`i / nodes_per_rack`; the whole group is rack `name-rack-00` when
//! `nodes_per_rack` is left out). Numbers are zero-padded so names sort in
//! node order. GPU `j` of node `n` has the UUID `GPU-n-j`: the same spec
//! always gives the same nodes.

use crate::error::{SpecError, SpecErrors, describe_value, quote};
use crate::quantity::{DecimalError, number_text, parse_memory_mib, parse_milli};
use crate::read::{
    Read, as_document, closest_name, given, quantity_value, string_value, unknown_field_errors,
};
use crate::validate::{MAX_CPUS_PER_NODE, MAX_GPUS_PER_NODE};
use crate::wire::Quantity;
use muster_model as model;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Top-level fields of a cluster spec.
pub const CLUSTER_FIELDS: &[&str] = &["node_groups"];
/// Fields of a node group, in the order errors are reported.
pub const NODE_GROUP_FIELDS: &[&str] = &[
    "name",
    "count",
    "gpu_model",
    "gpus",
    "gpu_memory",
    "cpus",
    "memory",
    "nvlink_domains",
    "nodes_per_rack",
    "pool",
];
/// The most nodes one group may have.
pub const MAX_GROUP_NODES: u32 = 10_000;
/// The most nodes a whole cluster spec may describe.
pub const MAX_CLUSTER_NODES: u64 = 100_000;
/// The longest node group name (node names add `-NNNNN`).
pub const MAX_GROUP_NAME_LENGTH: usize = 48;

/// The largest cluster spec accepted, in bytes of text.
const MAX_CLUSTER_SPEC_BYTES: usize = crate::MAX_SPEC_BYTES;

/// Names people use for a field in other tools.
const ALIASES: &[(&str, &str)] = &[
    ("gpu_count", "gpus"),
    ("gpu_type", "gpu_model"),
    ("nodes", "count"),
    ("num_nodes", "count"),
    ("partition", "pool"),
    ("prefix", "name"),
    ("rack_size", "nodes_per_rack"),
    ("replicas", "count"),
];

/// A cluster spec as written: one or more groups of identical nodes.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct ClusterSpec {
    pub node_groups: Vec<NodeGroupSpec>,
}

/// A group of identical nodes as written. `None` means "not given".
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct NodeGroupSpec {
    /// Prefix of the node names (`name-000`, `name-001`, ...).
    pub name: String,
    pub count: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_model: Option<String>,
    /// Whole GPUs per node.
    pub gpus: Option<Quantity>,
    /// Memory of each GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<Quantity>,
    /// CPUs per node.
    pub cpus: Option<Quantity>,
    /// Memory per node.
    pub memory: Option<Quantity>,
    /// NVLink domains per node; the GPUs are split evenly between them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvlink_domains: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nodes_per_rack: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

/// Parses a cluster spec written in YAML and builds its nodes.
pub fn parse_cluster_spec_yaml(text: &str) -> Result<Vec<model::NodeSpec>, SpecErrors> {
    if text.len() > MAX_CLUSTER_SPEC_BYTES {
        return Err(SpecErrors::single(SpecError::document(
            format!(
                "the cluster spec is too large: {} bytes; at most {MAX_CLUSTER_SPEC_BYTES} bytes (1 MiB) are accepted",
                text.len()
            ),
            None,
        )));
    }
    let value = crate::parse::yaml_value(text)?;
    let mut read = read_cluster_spec(&value);
    if !read.document_errors.is_empty() {
        return Err(SpecErrors(read.document_errors));
    }
    let mut errors = std::mem::take(&mut read.unknown_fields);
    let mut field_errors = std::mem::take(&mut read.field_errors);
    match read.spec.to_nodes() {
        Ok(nodes) if errors.is_empty() && field_errors.is_empty() => return Ok(nodes),
        Ok(_) => {}
        Err(validation) => field_errors.extend(
            validation
                .into_iter()
                .filter(|error| !read.already_reported(&error.path)),
        ),
    }
    // Stable: within a field, errors keep the order they were found in.
    field_errors.sort_by_key(|error| field_rank(&error.path));
    errors.extend(field_errors);
    Err(SpecErrors(errors))
}

impl ClusterSpec {
    /// Reads a cluster spec from a generic value (parsed YAML or JSON),
    /// checking field names and the kinds of values; every problem is
    /// reported.
    pub fn from_value(value: &Value) -> Result<ClusterSpec, SpecErrors> {
        read_cluster_spec(value).into_result()
    }

    /// Checks every value and builds the nodes, group by group in order.
    pub fn to_nodes(&self) -> Result<Vec<model::NodeSpec>, SpecErrors> {
        let mut check = Checker::default();
        let nodes = check.cluster(self);
        if check.errors.is_empty() {
            Ok(nodes)
        } else {
            Err(SpecErrors(check.errors))
        }
    }
}

impl<'de> Deserialize<'de> for ClusterSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        ClusterSpec::from_value(&value).map_err(serde::de::Error::custom)
    }
}

/// Sort key of an error path: (group index, field position).
fn field_rank(path: &str) -> (usize, usize) {
    let Some(rest) = path.strip_prefix("node_groups[") else {
        return (0, 0);
    };
    let Some((index, field)) = rest.split_once(']') else {
        return (0, 0);
    };
    let index = index.parse::<usize>().unwrap_or(usize::MAX);
    let Some(field) = field.strip_prefix('.') else {
        return (index.saturating_add(1), 0);
    };
    let rank = NODE_GROUP_FIELDS
        .iter()
        .position(|known| *known == field)
        .map_or(NODE_GROUP_FIELDS.len() + 1, |rank| rank + 1);
    (index.saturating_add(1), rank)
}

/// The known name closest to `unknown`, if one is close enough.
fn suggest(unknown: &str, accepted: &[&str]) -> Option<String> {
    let normalized = unknown.trim().to_ascii_lowercase().replace(['-', ' '], "_");
    if let Some((_, field)) = ALIASES.iter().find(|(alias, _)| *alias == normalized)
        && accepted.contains(field)
    {
        return Some((*field).to_string());
    }
    closest_name(&normalized, accepted.iter().map(|field| field.to_string()))
}

const DOCUMENT_ACCEPTED: &str = "a mapping with node_groups, a list of groups of identical nodes";

fn read_cluster_spec(value: &Value) -> Read<ClusterSpec> {
    let mut reader = Reader::default();
    let spec = match as_document(value, "cluster spec", DOCUMENT_ACCEPTED) {
        Ok(map) => reader.cluster(map),
        Err(error) => {
            reader.document_errors.push(error);
            ClusterSpec::default()
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

#[derive(Default)]
struct Reader {
    document_errors: Vec<SpecError>,
    unknown_fields: Vec<SpecError>,
    field_errors: Vec<SpecError>,
    bad_paths: std::collections::BTreeSet<String>,
}

impl Reader {
    fn fail(&mut self, path: String, message: String) {
        self.bad_paths.insert(path.clone());
        self.field_errors.push(SpecError::new(path, message));
    }

    fn check_field_names(&mut self, map: &Map<String, Value>, prefix: &str, accepted: &[&str]) {
        self.unknown_fields
            .extend(unknown_field_errors(map, prefix, accepted, |key| {
                suggest(key, accepted)
            }));
    }

    fn cluster(&mut self, map: &Map<String, Value>) -> ClusterSpec {
        self.check_field_names(map, "", CLUSTER_FIELDS);
        let groups = match given(map, "node_groups") {
            None => {
                self.fail(
                    "node_groups".to_string(),
                    "required: a list of node groups, each with name, count, gpus, cpus and memory"
                        .to_string(),
                );
                Vec::new()
            }
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(index, item)| self.node_group(index, item))
                .collect(),
            Some(other) => {
                self.fail(
                    "node_groups".to_string(),
                    format!(
                        "expected a list of node groups, got {}",
                        describe_value(other)
                    ),
                );
                Vec::new()
            }
        };
        ClusterSpec {
            node_groups: groups,
        }
    }

    /// A group; one that is not a mapping is reported and left empty (so
    /// the others keep their positions).
    fn node_group(&mut self, index: usize, value: &Value) -> NodeGroupSpec {
        let prefix = format!("node_groups[{index}]");
        let Value::Object(map) = value else {
            self.fail(
                prefix,
                format!(
                    "expected a mapping with fields {}, got {}",
                    NODE_GROUP_FIELDS.join(", "),
                    describe_value(value)
                ),
            );
            return NodeGroupSpec::default();
        };
        self.check_field_names(map, &prefix, NODE_GROUP_FIELDS);
        let path = |field: &str| format!("{prefix}.{field}");
        NodeGroupSpec {
            name: self.string(map, "name", path("name")).unwrap_or_default(),
            count: self.quantity(map, "count", path("count"), WHOLE_ACCEPTED),
            gpu_model: self.string(map, "gpu_model", path("gpu_model")),
            gpus: self.quantity(map, "gpus", path("gpus"), WHOLE_ACCEPTED),
            gpu_memory: self.quantity(map, "gpu_memory", path("gpu_memory"), SIZE_ACCEPTED),
            cpus: self.quantity(map, "cpus", path("cpus"), CPUS_ACCEPTED),
            memory: self.quantity(map, "memory", path("memory"), SIZE_ACCEPTED),
            nvlink_domains: self.quantity(
                map,
                "nvlink_domains",
                path("nvlink_domains"),
                WHOLE_ACCEPTED,
            ),
            nodes_per_rack: self.quantity(
                map,
                "nodes_per_rack",
                path("nodes_per_rack"),
                WHOLE_ACCEPTED,
            ),
            pool: self.string(map, "pool", path("pool")),
        }
    }

    fn string(&mut self, map: &Map<String, Value>, key: &str, path: String) -> Option<String> {
        string_value(given(map, key)?)
            .map_err(|message| self.fail(path, message))
            .ok()
    }

    fn quantity(
        &mut self,
        map: &Map<String, Value>,
        key: &str,
        path: String,
        accepted: &str,
    ) -> Option<Quantity> {
        quantity_value(given(map, key)?, accepted)
            .map_err(|message| self.fail(path, message))
            .ok()
    }
}

const WHOLE_ACCEPTED: &str = "a whole number like 8";
const SIZE_ACCEPTED: &str = "a size like \"80GiB\" or \"512MiB\", or a whole number of MiB";
const CPUS_ACCEPTED: &str = "a number of CPUs like 64 or 0.5";
const NAME_RULE: &str =
    "lowercase letters, digits and '-', starting with a letter and ending with a letter or digit";

fn is_group_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.first().is_some_and(u8::is_ascii_lowercase)
        && bytes
            .last()
            .is_some_and(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit())
        && bytes
            .iter()
            .all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || *byte == b'-')
}

/// `[A-Za-z0-9][A-Za-z0-9._-]*`, as queue and pool names in a job spec.
fn is_plain_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() <= crate::MAX_NAME_LENGTH
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes
            .iter()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'))
}

/// Digits of `value` in decimal, at least `minimum`.
fn width(value: u64, minimum: usize) -> usize {
    value.to_string().len().max(minimum)
}

#[derive(Default)]
struct Checker {
    errors: Vec<SpecError>,
}

impl Checker {
    fn error(&mut self, path: String, message: String) {
        self.errors.push(SpecError::new(path, message));
    }

    fn cluster(&mut self, spec: &ClusterSpec) -> Vec<model::NodeSpec> {
        if spec.node_groups.is_empty() {
            self.error(
                "node_groups".to_string(),
                "must list at least one node group".to_string(),
            );
        }
        let mut first_index: BTreeMap<&str, usize> = BTreeMap::new();
        let mut total: u64 = 0;
        let mut nodes = Vec::new();
        for (index, group) in spec.node_groups.iter().enumerate() {
            let prefix = format!("node_groups[{index}]");
            if let Some(&first) = first_index.get(group.name.as_str()) {
                self.error(
                    format!("{prefix}.name"),
                    format!(
                        "{} is already the name of node_groups[{first}]; names must differ",
                        quote(&group.name)
                    ),
                );
            } else {
                first_index.insert(&group.name, index);
            }
            if let Some(group_nodes) = self.node_group(&prefix, group) {
                total += group_nodes.len() as u64;
                if total <= MAX_CLUSTER_NODES {
                    nodes.extend(group_nodes);
                }
            }
        }
        if total > MAX_CLUSTER_NODES {
            self.error(
                "node_groups".to_string(),
                format!("at most {MAX_CLUSTER_NODES} nodes in all, got {total}"),
            );
        }
        nodes
    }

    /// The group's nodes, or `None` when a value is invalid.
    fn node_group(&mut self, prefix: &str, group: &NodeGroupSpec) -> Option<Vec<model::NodeSpec>> {
        let before = self.errors.len();
        let path = |field: &str| format!("{prefix}.{field}");
        let name = group.name.as_str();
        if name.is_empty() {
            self.error(
                path("name"),
                format!("required: a prefix for the node names like \"dgx\" ({NAME_RULE})"),
            );
        } else if name.len() > MAX_GROUP_NAME_LENGTH {
            self.error(
                path("name"),
                format!(
                    "must be at most {MAX_GROUP_NAME_LENGTH} characters, got {}",
                    name.len()
                ),
            );
        } else if !is_group_name(name) {
            self.error(
                path("name"),
                format!("must be {NAME_RULE}, got {}", quote(name)),
            );
        }
        let count = self.required_whole(&path("count"), group.count.as_ref(), 1, MAX_GROUP_NODES);
        let gpus = self.required_whole(&path("gpus"), group.gpus.as_ref(), 0, MAX_GPUS_PER_NODE);
        let gpu_model = match (&group.gpu_model, gpus) {
            (Some(model_name), _) if model_name.trim().is_empty() => {
                self.error(
                    path("gpu_model"),
                    "must not be empty; give a GPU model like \"H100-80GB\"".to_string(),
                );
                None
            }
            (Some(model_name), _) => Some(model::GpuModel::new(model_name)),
            (None, Some(gpus)) if gpus > 0 => {
                self.error(
                    path("gpu_model"),
                    "required when gpus is above 0: a GPU model like \"H100-80GB\"".to_string(),
                );
                None
            }
            (None, _) => None,
        };
        let gpu_memory = group
            .gpu_memory
            .as_ref()
            .and_then(|written| self.memory(&path("gpu_memory"), written));
        let cpus = match &group.cpus {
            None => {
                self.error(path("cpus"), format!("required: {CPUS_ACCEPTED} per node"));
                None
            }
            Some(written) => self.cpus(&path("cpus"), written),
        };
        let memory = match &group.memory {
            None => {
                self.error(
                    path("memory"),
                    format!("required: {SIZE_ACCEPTED}, per node"),
                );
                None
            }
            Some(written) => self.memory(&path("memory"), written),
        };
        let nvlink_domains = match &group.nvlink_domains {
            None => Some(1),
            Some(written) => self.whole(&path("nvlink_domains"), written, 1, MAX_GPUS_PER_NODE),
        };
        if let (Some(domains), Some(gpus), Some(written)) =
            (nvlink_domains, gpus, &group.nvlink_domains)
            && gpus % domains != 0
        {
            self.error(
                path("nvlink_domains"),
                format!(
                    "must divide gpus ({gpus}) evenly, so that each domain has as many GPUs, got {written}"
                ),
            );
        }
        let nodes_per_rack = group
            .nodes_per_rack
            .as_ref()
            .map(|written| self.whole(&path("nodes_per_rack"), written, 1, MAX_GROUP_NODES));
        let pool = group.pool.as_deref().unwrap_or("default");
        if !is_plain_name(pool) {
            self.error(
                path("pool"),
                format!(
                    "must be 1 to {} letters, digits, '-', '_' or '.', starting with a letter or digit, got {}",
                    crate::MAX_NAME_LENGTH,
                    quote(pool)
                ),
            );
        }
        if self.errors.len() > before {
            return None;
        }
        let (count, gpus, cpus, memory, domains) = (count?, gpus?, cpus?, memory?, nvlink_domains?);
        let nodes_per_rack = nodes_per_rack.flatten();
        let per_domain = gpus.checked_div(domains).unwrap_or(gpus).max(1);
        let node_width = width(u64::from(count.saturating_sub(1)), 3);
        let racks = nodes_per_rack.map_or(1, |per_rack| count.div_ceil(per_rack));
        let rack_width = width(u64::from(racks.saturating_sub(1)), 2);
        let gpu_model = gpu_model.unwrap_or_else(|| model::GpuModel::new(""));
        let nodes = (0..count)
            .map(|node| {
                let node_name = format!("{name}-{node:0node_width$}");
                let rack = nodes_per_rack.map_or(0, |per_rack| node / per_rack);
                model::NodeSpec {
                    name: model::NodeName(node_name.clone()),
                    pool: model::PoolName::from(pool),
                    rack: model::RackName(format!("{name}-rack-{rack:0rack_width$}")),
                    gpus: (0..gpus)
                        .map(|index| model::GpuSpec {
                            index,
                            uuid: format!("GPU-{node_name}-{index}"),
                            model: gpu_model.clone(),
                            memory: model::MemoryMib(gpu_memory.unwrap_or(0)),
                            nvlink_domain: index / per_domain,
                        })
                        .collect(),
                    cpu: model::CpuMilli(cpus),
                    memory: model::MemoryMib(memory),
                }
            })
            .collect();
        Some(nodes)
    }

    fn required_whole(
        &mut self,
        path: &str,
        written: Option<&Quantity>,
        minimum: u32,
        maximum: u32,
    ) -> Option<u32> {
        match written {
            None => {
                self.error(
                    path.to_string(),
                    format!("required: a whole number from {minimum} to {maximum}"),
                );
                None
            }
            Some(written) => self.whole(path, written, minimum, maximum),
        }
    }

    /// A whole number in `minimum..=maximum`; `None` (with an error) if not.
    fn whole(&mut self, path: &str, written: &Quantity, minimum: u32, maximum: u32) -> Option<u32> {
        let value = match parse_milli(&number_text(written)) {
            Ok(milli) if milli.is_multiple_of(1000) => milli / 1000,
            Ok(_) | Err(DecimalError::TooPrecise | DecimalError::NotANumber) => {
                self.error(
                    path.to_string(),
                    format!("expected a whole number from {minimum} to {maximum}, got {written}"),
                );
                return None;
            }
            Err(DecimalError::Negative) => 0,
            Err(DecimalError::TooLarge) => u64::MAX,
        };
        if value < u64::from(minimum) {
            self.error(
                path.to_string(),
                format!("must be at least {minimum}, got {written}"),
            );
            return None;
        }
        match u32::try_from(value) {
            Ok(value) if value <= maximum => Some(value),
            _ => {
                self.error(
                    path.to_string(),
                    format!("must be at most {maximum}, got {written}"),
                );
                None
            }
        }
    }

    fn cpus(&mut self, path: &str, written: &Quantity) -> Option<u64> {
        let limit = MAX_CPUS_PER_NODE * 1000;
        let message = match parse_milli(&number_text(written)) {
            Ok(0) => format!("must be more than 0, got {written}"),
            Ok(milli) if milli <= limit => return Some(milli),
            Ok(_) | Err(DecimalError::TooLarge) => {
                format!("must be at most {MAX_CPUS_PER_NODE} per node, got {written}")
            }
            Err(DecimalError::Negative) => format!("must not be negative, got {written}"),
            Err(DecimalError::TooPrecise) => {
                format!("counted in thousandths of a CPU (at most 3 decimal places), got {written}")
            }
            Err(DecimalError::NotANumber) => format!("expected {CPUS_ACCEPTED}, got {written}"),
        };
        self.error(path.to_string(), message);
        None
    }

    fn memory(&mut self, path: &str, written: &Quantity) -> Option<u64> {
        match parse_memory_mib(written) {
            Ok(0) => {
                self.error(
                    path.to_string(),
                    format!("must be more than 0, got {written}"),
                );
                None
            }
            Ok(mib) => Some(mib),
            Err(reason) => {
                self.error(path.to_string(), format!("{reason}, got {written}"));
                None
            }
        }
    }
}

/// Reads a queue file for what-if replays (`muster sim replay --queues`): a
/// map of queue names to `guaranteed_gpus` (GPUs, to thousandths),
/// `weight` (1 to 10,000; 1 by default) and `borrow_limit_gpus` (absent:
/// no limit), e.g. `team-a: {guaranteed_gpus: 16, weight: 2}`. Every
/// problem is reported, one per line.
pub fn parse_queue_file_yaml(text: &str) -> Result<Vec<model::QueueSpec>, String> {
    if text.len() > MAX_CLUSTER_SPEC_BYTES {
        return Err(format!(
            "the queue file is too large: {} bytes; at most {MAX_CLUSTER_SPEC_BYTES}",
            text.len()
        ));
    }
    let value = crate::parse::yaml_value(text).map_err(|errors| errors.to_string())?;
    let serde_json::Value::Object(map) = value else {
        return Err(
            "expected a map of queue names to {guaranteed_gpus, weight, borrow_limit_gpus}"
                .to_string(),
        );
    };
    let gpus = |queue: &str, field: &str, value: &serde_json::Value| -> Result<u32, String> {
        value
            .as_f64()
            .filter(|gpus| gpus.is_finite() && (0.0..=1_000_000.0).contains(gpus))
            .map(|gpus| (gpus * 1000.0).round() as u32)
            .ok_or_else(|| format!("{queue}.{field}: expected GPUs from 0 to 1000000, got {value}"))
    };
    let mut queues = Vec::new();
    let mut problems = Vec::new();
    for (name, entry) in &map {
        if !model::is_plain_name(name) || name.len() > crate::MAX_NAME_LENGTH {
            problems.push(format!(
                "{name:?}: a queue name is 1 to 63 letters, digits, '-', '_' or '.'"
            ));
            continue;
        }
        let mut queue = model::QueueSpec::best_effort(name.as_str());
        let Some(fields) = entry.as_object() else {
            problems.push(format!(
                "{name}: expected {{guaranteed_gpus, weight, borrow_limit_gpus}}, got {entry}"
            ));
            continue;
        };
        for (field, value) in fields {
            match field.as_str() {
                "guaranteed_gpus" => match gpus(name, field, value) {
                    Ok(milli) => queue.guaranteed = model::GpuMilli(milli),
                    Err(problem) => problems.push(problem),
                },
                "borrow_limit_gpus" => match gpus(name, field, value) {
                    Ok(milli) => queue.borrow_limit = Some(model::GpuMilli(milli)),
                    Err(problem) => problems.push(problem),
                },
                "weight" => match value.as_u64().filter(|w| (1..=10_000).contains(w)) {
                    Some(weight) => queue.weight = weight as u32,
                    None => problems.push(format!(
                        "{name}.weight: expected a whole number from 1 to 10000, got {value}"
                    )),
                },
                other => problems.push(format!(
                    "{name}.{other}: unknown field; accepted: guaranteed_gpus, weight, \
                     borrow_limit_gpus"
                )),
            }
        }
        queues.push(queue);
    }
    if problems.is_empty() {
        Ok(queues)
    } else {
        Err(problems.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_files_read_guarantees_weights_and_limits_and_name_every_problem() {
        let queues = parse_queue_file_yaml(
            "team-a: {guaranteed_gpus: 16, weight: 2, borrow_limit_gpus: 32.5}\nteam-b: {}\n",
        )
        .unwrap();
        assert_eq!(queues.len(), 2);
        assert_eq!(queues[0].name.0, "team-a");
        assert_eq!(queues[0].guaranteed, model::GpuMilli(16_000));
        assert_eq!(queues[0].weight, 2);
        assert_eq!(queues[0].borrow_limit, Some(model::GpuMilli(32_500)));
        assert_eq!(queues[1].guaranteed, model::GpuMilli(0));
        let error = parse_queue_file_yaml("a: {weight: 0, gpus: 1}\n\"b c\": {}\n").unwrap_err();
        let lines: Vec<&str> = error.lines().collect();
        assert_eq!(lines.len(), 3, "{error}");
        assert!(
            error.contains("a.weight: expected a whole number"),
            "{error}"
        );
        assert!(error.contains("a.gpus: unknown field"), "{error}");
        assert!(error.contains("\"b c\": a queue name"), "{error}");
        assert!(parse_queue_file_yaml("- a\n").is_err());
    }
    use model::{CpuMilli, GpuModel, MemoryMib, NodeName, PoolName, RackName};

    const DOCS: &str = include_str!("../../../docs/cluster-spec.md");
    const PHILLY: &str = include_str!("../../../examples/clusters/philly.yaml");
    const SMALL: &str = include_str!("../../../examples/clusters/small.yaml");

    fn parse(yaml: &str) -> Vec<model::NodeSpec> {
        parse_cluster_spec_yaml(yaml).unwrap_or_else(|errors| panic!("{errors}\n--- spec:\n{yaml}"))
    }

    /// One check helper for errors: a spec with one node group made of the
    /// required fields (overridden or extended by `fields`), and the exact
    /// error lines expected.
    fn check(fields: &str, expect: &[&str]) {
        let mut group: Vec<(String, String)> = [
            ("name", "gpu"),
            ("count", "2"),
            ("gpu_model", "A100-80GB"),
            ("gpus", "8"),
            ("cpus", "64"),
            ("memory", "512GiB"),
        ]
        .iter()
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect();
        for line in fields.lines().filter(|line| !line.trim().is_empty()) {
            let (key, value) = line.split_once(':').expect("field: value");
            let value = value.trim().to_string();
            match group.iter_mut().find(|(known, _)| known == key) {
                Some(entry) => entry.1 = value,
                None => group.push((key.to_string(), value)),
            }
        }
        let mut yaml = String::from("node_groups:\n");
        for (index, (key, value)) in group.iter().filter(|(_, v)| v != "<none>").enumerate() {
            let lead = if index == 0 { "  - " } else { "    " };
            yaml.push_str(&format!("{lead}{key}: {value}\n"));
        }
        let errors = match parse_cluster_spec_yaml(&yaml) {
            Ok(nodes) => panic!(
                "expected errors, built {} nodes\n--- spec:\n{yaml}",
                nodes.len()
            ),
            Err(errors) => errors.iter().map(ToString::to_string).collect::<Vec<_>>(),
        };
        assert_eq!(errors, expect, "--- spec:\n{yaml}");
    }

    #[test]
    fn a_group_becomes_named_nodes_in_racks() {
        let nodes = parse(
            "node_groups:\n  - name: dgx\n    count: 5\n    gpu_model: h100-80gb\n    gpus: 8\n    \
             gpu_memory: 80GiB\n    cpus: 112\n    memory: 2TiB\n    nvlink_domains: 2\n    \
             nodes_per_rack: 2\n    pool: training\n",
        );
        assert_eq!(nodes.len(), 5);
        let names: Vec<&str> = nodes.iter().map(|node| node.name.as_str()).collect();
        assert_eq!(
            names,
            ["dgx-000", "dgx-001", "dgx-002", "dgx-003", "dgx-004"]
        );
        let racks: Vec<&str> = nodes.iter().map(|node| node.rack.as_str()).collect();
        assert_eq!(
            racks,
            [
                "dgx-rack-00",
                "dgx-rack-00",
                "dgx-rack-01",
                "dgx-rack-01",
                "dgx-rack-02"
            ]
        );
        let node = &nodes[3];
        assert_eq!(node.pool, PoolName::from("training"));
        assert_eq!(node.cpu, CpuMilli(112_000));
        assert_eq!(node.memory, MemoryMib(2 * 1024 * 1024));
        assert_eq!(node.gpus.len(), 8);
        assert_eq!(node.gpu_model(), Some(&GpuModel::new("H100-80GB")));
        let domains: Vec<u32> = node.gpus.iter().map(|gpu| gpu.nvlink_domain).collect();
        assert_eq!(domains, [0, 0, 0, 0, 1, 1, 1, 1]);
        assert!(
            node.gpus
                .iter()
                .all(|gpu| gpu.memory == MemoryMib(80 * 1024))
        );
        assert_eq!(node.gpus[5].index, 5);
        assert_eq!(node.gpus[5].uuid, "GPU-dgx-003-5");
    }

    #[test]
    fn defaults_and_several_groups() {
        let nodes = parse(
            "node_groups:\n  - name: cpu\n    count: 2\n    gpus: 0\n    cpus: 32\n    memory: 64GiB\n  \
             - name: t4\n    count: 1\n    gpu_model: T4\n    gpus: 4\n    cpus: 0.5\n    memory: 16384\n",
        );
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes[0].name, NodeName::from("cpu-000"));
        assert!(nodes[0].gpus.is_empty());
        assert_eq!(nodes[0].pool, PoolName::from("default"));
        assert_eq!(nodes[0].rack, RackName::from("cpu-rack-00"));
        assert_eq!(nodes[2].name, NodeName::from("t4-000"));
        assert_eq!(nodes[2].cpu, CpuMilli(500));
        assert_eq!(nodes[2].memory, MemoryMib(16384));
        assert!(nodes[2].gpus.iter().all(|gpu| gpu.nvlink_domain == 0));
        assert!(nodes[2].gpus.iter().all(|gpu| gpu.memory == MemoryMib(0)));
    }

    #[test]
    fn names_widen_past_a_thousand_nodes_and_stay_sorted() {
        let nodes = parse(
            "node_groups:\n  - {name: big, count: 1001, gpus: 1, gpu_model: T4, cpus: 1, memory: 1GiB, nodes_per_rack: 10}\n",
        );
        assert_eq!(nodes[0].name.as_str(), "big-0000");
        assert_eq!(nodes[1000].name.as_str(), "big-1000");
        assert_eq!(nodes[1000].rack.as_str(), "big-rack-100");
        assert_eq!(nodes[0].rack.as_str(), "big-rack-000");
        assert!(nodes.windows(2).all(|pair| pair[0].name < pair[1].name));
    }

    #[test]
    fn the_same_spec_gives_the_same_nodes() {
        assert_eq!(parse(SMALL), parse(SMALL));
    }

    #[test]
    fn value_errors_name_the_field_path() {
        check(
            "count: 0",
            &["node_groups[0].count: must be at least 1, got 0"],
        );
        check(
            "gpus: 65",
            &["node_groups[0].gpus: must be at most 64, got 65"],
        );
        check(
            "gpus: 1.5",
            &["node_groups[0].gpus: expected a whole number from 0 to 64, got 1.5"],
        );
        check(
            "nvlink_domains: 3",
            &[
                "node_groups[0].nvlink_domains: must divide gpus (8) evenly, so that each domain has as many GPUs, got 3",
            ],
        );
        check(
            "name: Big_Nodes",
            &[
                "node_groups[0].name: must be lowercase letters, digits and '-', starting with a letter and ending with a letter or digit, got \"Big_Nodes\"",
            ],
        );
        check(
            "memory: 16GB",
            &[
                "node_groups[0].memory: unknown unit \"GB\"; accepted: MiB, GiB, TiB (or Mi, Gi, Ti), or a whole number of MiB, got \"16GB\"",
            ],
        );
        check(
            "cpus: many",
            &["node_groups[0].cpus: expected a number of CPUs like 64 or 0.5, got \"many\""],
        );
        check(
            "gpu_model: <none>",
            &[
                "node_groups[0].gpu_model: required when gpus is above 0: a GPU model like \"H100-80GB\"",
            ],
        );
        check(
            "pool: 'bad pool'",
            &[
                "node_groups[0].pool: must be 1 to 63 letters, digits, '-', '_' or '.', starting with a letter or digit, got \"bad pool\"",
            ],
        );
    }

    #[test]
    fn unknown_fields_are_refused_with_a_suggestion() {
        check(
            "gpu: 8",
            &["node_groups[0].gpu: unknown field; did you mean \"gpus\"?"],
        );
        check(
            "rack_size: 4",
            &["node_groups[0].rack_size: unknown field; did you mean \"nodes_per_rack\"?"],
        );
        check(
            "zzz: 1",
            &[
                "node_groups[0].zzz: unknown field; accepted: name, count, gpu_model, gpus, gpu_memory, cpus, memory, nvlink_domains, nodes_per_rack, pool",
            ],
        );
        let errors = parse_cluster_spec_yaml("nodegroups: []\n").unwrap_err();
        assert_eq!(
            errors.to_string(),
            "nodegroups: unknown field; did you mean \"node_groups\"?\n\
             node_groups: required: a list of node groups, each with name, count, gpus, cpus and memory"
        );
    }

    #[test]
    fn every_problem_is_reported_once_in_field_order() {
        check(
            "count: [1]\nmemory: <none>\ncpus: 0\ngpuz: 1",
            &[
                "node_groups[0].gpuz: unknown field; did you mean \"gpus\"?",
                "node_groups[0].count: expected a whole number like 8, got a list",
                "node_groups[0].cpus: must be more than 0, got 0",
                "node_groups[0].memory: required: a size like \"80GiB\" or \"512MiB\", or a whole number of MiB, per node",
            ],
        );
    }

    #[test]
    fn document_errors() {
        let error = |yaml: &str| parse_cluster_spec_yaml(yaml).unwrap_err().to_string();
        assert_eq!(
            error(""),
            "the cluster spec is empty; expected a mapping with node_groups, a list of groups of identical nodes"
        );
        assert_eq!(
            error("[1, 2]"),
            "expected a mapping with node_groups, a list of groups of identical nodes, got a list"
        );
        assert_eq!(
            error("node_groups: []"),
            "node_groups: must list at least one node group"
        );
        assert_eq!(
            error("node_groups: [3]"),
            "node_groups[0]: expected a mapping with fields name, count, gpu_model, gpus, gpu_memory, cpus, memory, nvlink_domains, nodes_per_rack, pool, got 3"
        );
        assert!(error("node_groups: [").starts_with("invalid yaml: "));
        let duplicate = "node_groups:\n  - {name: a, count: 1, gpus: 0, cpus: 1, memory: 1GiB}\n  \
                         - {name: a, count: 1, gpus: 0, cpus: 1, memory: 1GiB}\n";
        assert_eq!(
            error(duplicate),
            "node_groups[1].name: \"a\" is already the name of node_groups[0]; names must differ"
        );
        let huge = "node_groups:\n".to_string()
            + &(0..11)
                .map(|i| {
                    format!("  - {{name: g{i}, count: 10000, gpus: 0, cpus: 1, memory: 1GiB}}\n")
                })
                .collect::<String>();
        assert_eq!(
            error(&huge),
            "node_groups: at most 100000 nodes in all, got 110000"
        );
    }

    #[test]
    fn wire_specs_deserialize_and_report_errors() {
        let spec: ClusterSpec = serde_json::from_str(
            r#"{"node_groups": [{"name": "a", "count": 2, "gpus": 1, "gpu_model": "T4", "cpus": 4, "memory": "8GiB"}]}"#,
        )
        .expect("a valid spec");
        assert_eq!(spec.to_nodes().map(|nodes| nodes.len()), Ok(2));
        let error = serde_json::from_str::<ClusterSpec>(r#"{"node_groups": [{"nme": "a"}]}"#)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("node_groups[0].nme: unknown field"),
            "{error}"
        );
    }

    #[test]
    fn shipped_examples_parse() {
        let philly = parse(PHILLY);
        assert_eq!(philly.len(), 80);
        assert!(philly.iter().all(|node| node.gpus.len() == 8));
        let racks: std::collections::BTreeSet<&str> =
            philly.iter().map(|node| node.rack.as_str()).collect();
        assert_eq!(racks.len(), 10);
        assert!(!parse(SMALL).is_empty());
    }

    fn fenced_blocks<'a>(markdown: &'a str, language: &str) -> Vec<&'a str> {
        let opening = format!("```{language}\n");
        let mut blocks = Vec::new();
        let mut rest = markdown;
        while let Some(start) = rest.find(&opening) {
            let body = &rest[start + opening.len()..];
            let Some(end) = body.find("```") else { break };
            blocks.push(&body[..end]);
            rest = &body[end..];
        }
        blocks
    }

    #[test]
    fn docs_examples_parse() {
        // As in docs/job-spec.md: each yaml block says whether it is valid;
        // the text block after an invalid one is exactly what is printed.
        let mut outputs = fenced_blocks(DOCS, "text").into_iter();
        let mut valid = 0;
        for block in fenced_blocks(DOCS, "yaml") {
            match block.lines().next() {
                Some("# example: valid") => {
                    parse(block);
                    valid += 1;
                }
                Some("# example: invalid") => {
                    let errors = parse_cluster_spec_yaml(block).expect_err("marked invalid");
                    let expected = outputs
                        .next()
                        .expect("an output after each invalid example");
                    assert_eq!(format!("{errors}\n"), expected, "--- example:\n{block}");
                }
                other => panic!(
                    "a yaml example must start with '# example: valid' or '# example: invalid', got {other:?}"
                ),
            }
        }
        assert!(valid >= 2, "docs lost their examples");
        for field in NODE_GROUP_FIELDS {
            assert!(
                DOCS.contains(&format!("| `{field}` |")),
                "{field} is documented"
            );
        }
    }
}
