//! Checking the values of a wire [`JobSpec`] and building the validated
//! [`muster_model::JobSpec`]. Every problem is collected and reported at
//! once, each naming the field, the value, and what is accepted.

use crate::error::{SpecError, SpecErrors, quote};
use crate::quantity::{
    DecimalError, format_duration, number_text, parse_duration, parse_memory_mib, parse_milli,
};
use crate::read::field_path;
use crate::wire::{CommandSpec, JobSpec, Quantity};
use muster_model as model;
use std::collections::BTreeMap;
use std::time::Duration;

/// The most tasks (nodes) one job may have.
pub const MAX_NODES: u32 = 4096;
/// The most whole GPUs one task may ask for.
pub const MAX_GPUS_PER_NODE: u32 = 64;
/// The most CPUs one task may ask for.
pub const MAX_CPUS_PER_NODE: u64 = 4096;
/// The most attempts a retry policy may allow.
pub const MAX_ATTEMPTS: u32 = 100;
/// The longest grace period between the stop signal and the kill.
pub const MAX_GRACE_PERIOD: Duration = Duration::from_secs(3600);
/// The longest job name (a DNS label).
pub const MAX_NAME_LENGTH: usize = 63;
/// The most an array's copies of its spec (command, environment, working
/// directory, each element's) may weigh together.
pub const MAX_ARRAY_BYTES: usize = 64 * 1024 * 1024;

/// What a spec's variable parts weigh, in bytes (with room for the fixed
/// ones).
fn spec_weight(
    command: &[String],
    env: &std::collections::BTreeMap<String, String>,
    working_dir: Option<&str>,
) -> usize {
    512 + command.iter().map(|arg| arg.len() + 24).sum::<usize>()
        + env
            .iter()
            .map(|(key, value)| key.len() + value.len() + 48)
            .sum::<usize>()
        + working_dir.map_or(0, str::len)
}

/// Environment variables muster sets for every task: a spec may not set them.
pub const RESERVED_ENV_PREFIXES: &[&str] = &["MUSTER_", "PET_"];
pub const RESERVED_ENV_NAMES: &[&str] = &["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"];

/// Checks every value of `spec` and builds the validated spec, or returns
/// every problem found.
pub fn validate(spec: &JobSpec) -> Result<model::JobSpec, SpecErrors> {
    let mut check = Checker::default();
    let validated = check.job_spec(spec);
    if check.errors.is_empty() {
        Ok(validated)
    } else {
        Err(SpecErrors(check.errors))
    }
}

impl TryFrom<&JobSpec> for model::JobSpec {
    type Error = SpecErrors;

    fn try_from(spec: &JobSpec) -> Result<Self, Self::Error> {
        validate(spec)
    }
}

impl TryFrom<JobSpec> for model::JobSpec {
    type Error = SpecErrors;

    fn try_from(spec: JobSpec) -> Result<Self, Self::Error> {
        validate(&spec)
    }
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`
fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    let edge = |byte: &u8| byte.is_ascii_lowercase() || byte.is_ascii_digit();
    !bytes.is_empty()
        && bytes.first().is_some_and(edge)
        && bytes.last().is_some_and(edge)
        && bytes.iter().all(|byte| edge(byte) || *byte == b'-')
}

/// Queue and pool names: 1 to 63 letters, digits, `-`, `_` or `.`,
/// starting with a letter or digit.
fn is_plain_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_NAME_LENGTH
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes
            .iter()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'))
}

/// `[A-Za-z_][A-Za-z0-9_]*`
pub fn is_env_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes
        .first()
        .is_some_and(|byte| byte.is_ascii_alphabetic() || *byte == b'_')
        && bytes
            .iter()
            .all(|byte| byte.is_ascii_alphanumeric() || *byte == b'_')
}

/// A variable muster sets itself (`MUSTER_*`, `PET_*`, the GPU ones).
pub fn is_reserved_env_name(name: &str) -> bool {
    !JOB_SETTABLE_ENV_NAMES.contains(&name)
        && (RESERVED_ENV_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
            || RESERVED_ENV_NAMES.contains(&name))
}

/// Names under a reserved prefix that a job sets itself:
/// `MUSTER_SIM_UTIL` (a share, 0 to 1) is how busy the simulated GPU
/// backend keeps the job's GPUs, `MUSTER_SIM_XID` an XID it reports on
/// them; real GPUs ignore both.
pub const JOB_SETTABLE_ENV_NAMES: &[&str] = &["MUSTER_SIM_UTIL", "MUSTER_SIM_XID"];

fn signal_names() -> String {
    model::Signal::ALL
        .iter()
        .map(|signal| signal.name())
        .collect::<Vec<_>>()
        .join(", ")
}

fn priority_class_names() -> String {
    model::PriorityClass::builtin()
        .iter()
        .map(|class| class.name.clone())
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Default)]
struct Checker {
    errors: Vec<SpecError>,
}

impl Checker {
    fn error(&mut self, path: &str, message: String) {
        self.errors.push(SpecError::new(path, message));
    }

    fn job_spec(&mut self, spec: &JobSpec) -> model::JobSpec {
        let defaults = model::JobSpec::simple("", "default", model::GpuRequest::Whole(0), vec![]);
        self.name(&spec.name);
        let queue = self.plain_name("queue", spec.queue.as_deref().unwrap_or("default"));
        let pool = spec
            .pool
            .as_deref()
            .map(|pool| model::PoolName(self.plain_name("pool", pool)));
        let priority_class = self.priority_class(spec.priority_class.as_deref());
        let nodes = spec.nodes.as_ref().map_or(1, |nodes| self.nodes(nodes));
        let gpus_per_node = spec
            .gpus
            .as_ref()
            .map_or(model::GpuRequest::Whole(0), |gpus| self.gpus(gpus, nodes));
        let gpu_models = self.gpu_models(&spec.gpu_models);
        let min_gpu_memory = spec
            .min_gpu_memory
            .as_ref()
            .map(|memory| model::MemoryMib(self.memory("min_gpu_memory", memory)));
        let cpu_per_node = spec
            .cpus
            .as_ref()
            .map_or(defaults.cpu_per_node, |cpus| self.cpus(cpus));
        let memory_per_node = spec
            .memory
            .as_ref()
            .map_or(defaults.memory_per_node, |memory| {
                model::MemoryMib(self.memory("memory", memory))
            });
        let command = self.command(spec.command.as_ref());
        let env = self.env(&spec.env);
        let working_dir = spec.working_dir.as_ref().map(|dir| self.working_dir(dir));
        let image = spec.image.as_ref().map(|image| self.image(image));
        let image_pull_secret = spec.image_pull_secret.as_ref().map(|name| {
            if image.is_none() {
                self.error(
                    "image_pull_secret",
                    "names the credentials for pulling `image`, and the job has no image: \
                     add `image:` or drop it"
                        .to_string(),
                );
            }
            if !model::is_plain_name(name) || name.len() > 63 {
                self.error(
                    "image_pull_secret",
                    format!(
                        "the secret's name {} is 1 to 63 letters, digits, '-', '_' or '.'",
                        quote(name)
                    ),
                );
            }
            name.clone()
        });
        let mounts = self.mounts(&spec.mounts, image.is_some());
        let max_runtime = spec
            .max_runtime
            .as_ref()
            .map(|runtime| self.positive_duration("max_runtime", runtime));
        let estimated_runtime = spec
            .estimated_runtime
            .as_ref()
            .map(|runtime| self.positive_duration("estimated_runtime", runtime));
        if let (Some(estimate), Some(limit), Some(written)) =
            (estimated_runtime, max_runtime, &spec.estimated_runtime)
            && estimate > limit
        {
            self.error(
                "estimated_runtime",
                format!(
                    "must not exceed max_runtime ({}), got {written}",
                    format_duration(limit)
                ),
            );
        }
        let checkpoint = self.checkpoint(spec);
        let retry = self.retry(spec);
        let topology = self.topology(spec);
        let after = self.after(&spec.after);
        let array = spec
            .array
            .as_ref()
            .and_then(|text| match model::ArraySpec::parse(text) {
                Ok(array) => Some(array),
                Err(message) => {
                    self.error("array", message);
                    None
                }
            });
        // Every element holds (and stores) the spec: an array of a large
        // spec is bounded by what all its copies weigh.
        if let Some(array) = &array {
            let weight = spec_weight(&command, &env, working_dir.as_deref());
            let total = weight.saturating_mul(array.len());
            if total > MAX_ARRAY_BYTES {
                self.error(
                    "array",
                    format!(
                        "{} elements of a spec of {} KiB (its command and environment) would \
                         hold {} MiB; an array may hold at most {} MiB: use fewer elements, or \
                         a smaller command or environment (put a long script in a file)",
                        array.len(),
                        weight.div_ceil(1024),
                        total / (1024 * 1024),
                        MAX_ARRAY_BYTES / (1024 * 1024)
                    ),
                );
            }
        }
        model::JobSpec {
            name: spec.name.clone(),
            queue: model::QueueName(queue),
            pool,
            priority_class,
            nodes,
            gpus_per_node,
            gpu_models,
            min_gpu_memory,
            cpu_per_node,
            memory_per_node,
            command,
            secrets: self.secrets(&spec.secrets, &env),
            env,
            working_dir,
            image,
            image_pull_secret,
            mounts,
            max_runtime,
            estimated_runtime,
            preemptible: spec.preemptible.unwrap_or(defaults.preemptible),
            checkpoint,
            retry,
            topology,
            after,
            array,
            slurm_env: spec.slurm_env.unwrap_or(false),
            idle_timeout: spec
                .idle_timeout
                .as_ref()
                .map(|timeout| self.positive_duration("idle_timeout", timeout)),
            service: spec.service.as_ref().and_then(|service| {
                if nodes != 1 {
                    self.error(
                        "service",
                        format!("a service's replica is one task (nodes: 1), not {nodes}"),
                    );
                }
                if !crate::service::is_service_name(&service.name) {
                    self.error(
                        "service.name",
                        format!(
                            "expected a service name like \"llm\" (lowercase letters, digits \
                             and '-', at most {} characters), got {:?}",
                            model::MAX_SERVICE_NAME_LENGTH,
                            service.name
                        ),
                    );
                }
                let revision = match &service.revision {
                    Some(written) => {
                        self.whole_number("service.revision", written, 1, 1, u32::MAX)?
                    }
                    None => {
                        self.error("service.revision", "required: a whole number like 1".into());
                        return None;
                    }
                };
                let port = match &service.port {
                    Some(written) => {
                        Some(self.whole_number("service.port", written, 8080, 1, 65_535)? as u16)
                    }
                    None => None,
                };
                let spread = match service.spread.as_deref() {
                    None | Some("nodes") => model::Spread::Nodes,
                    Some("racks") => model::Spread::Racks,
                    Some(other) => {
                        self.error(
                            "service.spread",
                            format!("expected \"nodes\" or \"racks\", got {other:?}"),
                        );
                        return None;
                    }
                };
                Some(model::ServiceRef {
                    name: service.name.clone(),
                    revision,
                    port,
                    spread,
                })
            }),
        }
    }

    fn after(&mut self, written: &[String]) -> Vec<model::Dependency> {
        let mut after: Vec<model::Dependency> = Vec::new();
        for (index, text) in written.iter().enumerate() {
            let path = format!("after[{index}]");
            match crate::wire::parse_dependency(text) {
                Ok(dependency) => {
                    if after.iter().any(|d| d.job == dependency.job) {
                        self.error(
                            &path,
                            format!(
                                "job {} is named twice; name each job once",
                                dependency.job.0
                            ),
                        );
                    } else {
                        after.push(dependency);
                    }
                }
                Err(message) => self.error(&path, message),
            }
        }
        if after.len() > model::MAX_DEPENDENCIES {
            self.error(
                "after",
                format!(
                    "at most {} jobs, got {}; chain them through an intermediate job",
                    model::MAX_DEPENDENCIES,
                    after.len()
                ),
            );
        }
        after
    }

    fn name(&mut self, name: &str) {
        const RULE: &str = "lowercase letters, digits and '-', starting and ending with a letter or digit (a DNS label)";
        let length = name.chars().count();
        if name.is_empty() {
            self.error("name", format!("must not be empty; use {RULE}"));
        } else if length > MAX_NAME_LENGTH {
            self.error(
                "name",
                format!("must be at most {MAX_NAME_LENGTH} characters, got {length}"),
            );
        } else if !is_dns_label(name) {
            self.error("name", format!("must be {RULE}, got {}", quote(name)));
        }
    }

    fn plain_name(&mut self, path: &str, name: &str) -> String {
        if !is_plain_name(name) {
            self.error(
                path,
                format!(
                    "must be 1 to {MAX_NAME_LENGTH} letters, digits, '-', '_' or '.', starting with a letter or digit, got {}",
                    quote(name)
                ),
            );
        }
        name.to_string()
    }

    fn priority_class(&mut self, name: Option<&str>) -> model::PriorityClass {
        let Some(name) = name else {
            return model::PriorityClass::normal();
        };
        match model::PriorityClass::by_name(&name.trim().to_ascii_lowercase()) {
            Some(class) => class,
            None => {
                self.error(
                    "priority_class",
                    format!(
                        "unknown priority class {}; accepted: {}",
                        quote(name),
                        priority_class_names()
                    ),
                );
                model::PriorityClass::normal()
            }
        }
    }

    /// A whole number in `minimum..=maximum`; `None` (with an error) if not.
    fn whole_number(
        &mut self,
        path: &str,
        written: &Quantity,
        example: u32,
        minimum: u32,
        maximum: u32,
    ) -> Option<u32> {
        let milli = match parse_milli(&number_text(written)) {
            Ok(milli) if milli.is_multiple_of(1000) => milli / 1000,
            Ok(_) | Err(DecimalError::TooPrecise | DecimalError::NotANumber) => {
                self.error(
                    path,
                    format!("expected a whole number like {example}, got {written}"),
                );
                return None;
            }
            Err(DecimalError::Negative) => 0,
            Err(DecimalError::TooLarge) => u64::MAX,
        };
        if milli < u64::from(minimum) {
            self.error(path, format!("must be at least {minimum}, got {written}"));
            return None;
        }
        match u32::try_from(milli) {
            Ok(value) if value <= maximum => Some(value),
            _ => {
                self.error(path, format!("must be at most {maximum}, got {written}"));
                None
            }
        }
    }

    fn nodes(&mut self, written: &Quantity) -> u32 {
        self.whole_number("nodes", written, 2, 1, MAX_NODES)
            .unwrap_or(1)
    }

    fn gpus(&mut self, written: &Quantity, nodes: u32) -> model::GpuRequest {
        let fallback = model::GpuRequest::Whole(0);
        let milli = match parse_milli(&number_text(written)) {
            Ok(milli) => milli,
            Err(DecimalError::NotANumber) => {
                self.error(
                    "gpus",
                    format!(
                        "expected a number of GPUs like 8, or a share of one GPU like 0.25, got {written}"
                    ),
                );
                return fallback;
            }
            Err(DecimalError::Negative) => {
                self.error("gpus", format!("must not be negative, got {written}"));
                return fallback;
            }
            Err(DecimalError::TooPrecise) => {
                self.error(
                    "gpus",
                    format!(
                        "a share is counted in thousandths of a GPU (at most 3 decimal places), got {written}"
                    ),
                );
                return fallback;
            }
            Err(DecimalError::TooLarge) => u64::MAX,
        };
        if milli.is_multiple_of(1000) {
            let count = milli / 1000;
            return match u32::try_from(count) {
                Ok(count) if count <= MAX_GPUS_PER_NODE => model::GpuRequest::Whole(count),
                _ => {
                    self.error(
                        "gpus",
                        format!("must be at most {MAX_GPUS_PER_NODE} per node, got {written}"),
                    );
                    fallback
                }
            };
        }
        if milli > 1000 {
            self.error(
                "gpus",
                format!("a share must be below 1 or a whole number, got {written}"),
            );
            return fallback;
        }
        if nodes > 1 {
            self.error(
                "gpus",
                format!(
                    "a share of a GPU ({written}) needs nodes: 1, got nodes: {nodes}; a job of several nodes takes whole GPUs"
                ),
            );
        }
        // 1..=999 thousandths: `milli` is below 1000 here.
        model::GpuRequest::Shared(model::GpuMilli(u32::try_from(milli).unwrap_or(999)))
    }

    fn gpu_models(&mut self, names: &[String]) -> Vec<model::GpuModel> {
        let mut models = Vec::new();
        for (index, name) in names.iter().enumerate() {
            if name.trim().is_empty() {
                self.error(
                    &format!("gpu_models[{index}]"),
                    "must not be empty; give a GPU model like \"H100-80GB\"".to_string(),
                );
            } else if name
                .trim()
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
            {
                self.error(
                    &format!("gpu_models[{index}]"),
                    format!(
                        "must be a GPU model like \"H100-80GB\" (no spaces), got {}",
                        quote(name)
                    ),
                );
            } else {
                models.push(model::GpuModel::new(name));
            }
        }
        models
    }

    fn cpus(&mut self, written: &Quantity) -> model::CpuMilli {
        let fallback = model::CpuMilli(1000);
        let limit = MAX_CPUS_PER_NODE * 1000;
        match parse_milli(&number_text(written)) {
            Ok(0) => self.error("cpus", format!("must be more than 0, got {written}")),
            Ok(milli) if milli <= limit => return model::CpuMilli(milli),
            Ok(_) | Err(DecimalError::TooLarge) => self.error(
                "cpus",
                format!("must be at most {MAX_CPUS_PER_NODE} per node, got {written}"),
            ),
            Err(DecimalError::Negative) => {
                self.error("cpus", format!("must not be negative, got {written}"))
            }
            Err(DecimalError::TooPrecise) => self.error(
                "cpus",
                format!(
                    "counted in thousandths of a CPU (at most 3 decimal places), got {written}"
                ),
            ),
            Err(DecimalError::NotANumber) => self.error(
                "cpus",
                format!("expected a number of CPUs like 4 or 0.5, got {written}"),
            ),
        }
        fallback
    }

    fn memory(&mut self, path: &str, written: &Quantity) -> u64 {
        match parse_memory_mib(written) {
            Ok(0) => {
                self.error(path, format!("must be more than 0, got {written}"));
                0
            }
            Ok(mib) => mib,
            Err(reason) => {
                self.error(path, format!("{reason}, got {written}"));
                0
            }
        }
    }

    fn command(&mut self, command: Option<&CommandSpec>) -> Vec<String> {
        let Some(command) = command else {
            self.error(
                "command",
                "required: a list of arguments like [python, train.py], or one string run by sh -c"
                    .to_string(),
            );
            return Vec::new();
        };
        match command {
            CommandSpec::Shell(text) if text.trim().is_empty() => {
                self.error("command", "must not be empty".to_string());
            }
            CommandSpec::Shell(text) if text.contains('\0') => {
                self.error("command", "must not contain a NUL character".to_string());
            }
            CommandSpec::Shell(_) => {}
            CommandSpec::Argv(argv) => {
                if argv.is_empty() {
                    self.error(
                        "command",
                        "must not be empty; give at least the program to run".to_string(),
                    );
                }
                if argv
                    .first()
                    .is_some_and(|program| program.trim().is_empty())
                {
                    self.error(
                        "command[0]",
                        "the program to run must not be empty".to_string(),
                    );
                }
                for (index, argument) in argv.iter().enumerate() {
                    if argument.contains('\0') {
                        self.error(
                            &format!("command[{index}]"),
                            "must not contain a NUL character".to_string(),
                        );
                    }
                }
            }
        }
        command.argv()
    }

    fn secrets(
        &mut self,
        secrets: &BTreeMap<String, String>,
        env: &BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        for (variable, name) in secrets {
            let path = field_path("env", variable);
            if !is_env_name(variable) || is_reserved_env_name(variable) {
                self.error(
                    &path,
                    "not a variable a job may set: letters, digits and '_', not MUSTER_*, PET_* \
                     or the GPU variables"
                        .to_string(),
                );
            }
            if env.contains_key(variable) {
                self.error(&path, "set both as a value and as a secret".to_string());
            }
            if !model::is_plain_name(name) || name.len() > 63 {
                self.error(
                    &path,
                    format!(
                        "the secret's name {} is 1 to 63 letters, digits, '-', '_' or '.'",
                        quote(name)
                    ),
                );
            }
        }
        if secrets.len() > 64 {
            self.error("env", "at most 64 secrets a job".to_string());
        }
        secrets.clone()
    }

    fn mounts(&mut self, mounts: &[crate::wire::MountSpec], container: bool) -> Vec<model::Mount> {
        if mounts.is_empty() {
            return Vec::new();
        }
        if !container {
            self.error(
                "mounts",
                "mounts are for container jobs (`image:`); a job without one sees the node's \
                 files as they are"
                    .to_string(),
            );
        }
        if mounts.len() > 16 {
            self.error("mounts", "at most 16 mounts a job".to_string());
        }
        let clean = |path: &str| {
            path.starts_with('/')
                && path.len() <= 4096
                && !path.contains([':', ',', '\0'])
                && !path.split('/').any(|part| part == "..")
        };
        let mut targets = std::collections::BTreeSet::new();
        let mut out = Vec::new();
        for (index, mount) in mounts.iter().enumerate() {
            for (field, path) in [("source", &mount.source), ("target", &mount.target)] {
                if !clean(path) {
                    self.error(
                        &format!("mounts[{index}].{field}"),
                        format!(
                            "must be an absolute path without `..`, `:` or `,`, got {}",
                            quote(path)
                        ),
                    );
                }
            }
            if !targets.insert(mount.target.trim_end_matches('/').to_string()) {
                self.error(
                    &format!("mounts[{index}].target"),
                    format!("{} is mounted twice", quote(&mount.target)),
                );
            }
            out.push(model::Mount {
                source: mount.source.clone(),
                target: mount.target.clone(),
                read_only: mount.read_only.unwrap_or(false),
            });
        }
        out
    }

    fn env(&mut self, env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        for (name, value) in env {
            let path = field_path("env", name);
            if !is_env_name(name) {
                self.error(
                    &path,
                    format!(
                        "not a valid variable name {}: use letters, digits and '_', not starting with a digit",
                        quote(name)
                    ),
                );
            } else if is_reserved_env_name(name) {
                self.error(
                    &path,
                    "reserved: muster sets MUSTER_*, PET_*, CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES itself"
                        .to_string(),
                );
            }
            if value.contains('\0') {
                self.error(&path, "must not contain a NUL character".to_string());
            }
        }
        env.clone()
    }

    fn working_dir(&mut self, dir: &str) -> String {
        if !dir.starts_with('/') || dir.contains('\0') {
            self.error(
                "working_dir",
                format!(
                    "must be an absolute path (starting with /), got {}",
                    quote(dir)
                ),
            );
        }
        dir.to_string()
    }

    fn image(&mut self, image: &str) -> String {
        if image.is_empty() || !image.bytes().all(|byte| byte.is_ascii_graphic()) {
            self.error(
                "image",
                format!(
                    "must be an image reference like \"nvcr.io/nvidia/pytorch:24.05-py3\" (no spaces), got {}",
                    quote(image)
                ),
            );
        }
        image.to_string()
    }

    fn duration(&mut self, path: &str, written: &Quantity) -> Option<Duration> {
        match parse_duration(written) {
            Ok(duration) => Some(duration),
            Err(reason) => {
                self.error(path, format!("{reason}, got {written}"));
                None
            }
        }
    }

    fn positive_duration(&mut self, path: &str, written: &Quantity) -> Duration {
        match self.duration(path, written) {
            Some(Duration::ZERO) => {
                self.error(path, format!("must be more than 0s, got {written}"));
                Duration::ZERO
            }
            Some(duration) => duration,
            None => Duration::ZERO,
        }
    }

    fn checkpoint(&mut self, spec: &JobSpec) -> model::CheckpointPolicy {
        let mut policy = model::CheckpointPolicy::default();
        let Some(checkpoint) = &spec.checkpoint else {
            return policy;
        };
        if let Some(name) = &checkpoint.signal {
            match model::Signal::parse(name) {
                Some(signal) => policy.signal = signal,
                None => self.error(
                    "checkpoint.signal",
                    format!(
                        "unknown signal {}; accepted: {}",
                        quote(name),
                        signal_names()
                    ),
                ),
            }
        }
        if let Some(written) = &checkpoint.grace_period
            && let Some(grace_period) = self.duration("checkpoint.grace_period", written)
        {
            if grace_period > MAX_GRACE_PERIOD {
                self.error(
                    "checkpoint.grace_period",
                    format!(
                        "must be at most {}, got {written}",
                        format_duration(MAX_GRACE_PERIOD)
                    ),
                );
            } else {
                policy.grace_period = grace_period;
            }
        }
        policy.interval = checkpoint
            .interval
            .as_ref()
            .map(|written| self.positive_duration("checkpoint.interval", written));
        policy
    }

    fn retry(&mut self, spec: &JobSpec) -> model::RetryPolicy {
        let mut policy = model::RetryPolicy::default();
        let Some(retry) = &spec.retry else {
            return policy;
        };
        if let Some(written) = &retry.max_attempts
            && let Some(attempts) =
                self.whole_number("retry.max_attempts", written, 3, 1, MAX_ATTEMPTS)
        {
            policy.max_attempts = attempts;
        }
        policy.on_node_failure = retry.on_node_failure.unwrap_or(policy.on_node_failure);
        policy.on_exit_failure = retry.on_exit_failure.unwrap_or(policy.on_exit_failure);
        policy
    }

    fn topology(&mut self, spec: &JobSpec) -> Option<model::TopologyConstraint> {
        let topology = spec.topology.as_ref()?;
        let same_rack = match topology.same_rack.as_deref() {
            None => {
                self.error(
                    "topology.same_rack",
                    "required when topology is given; accepted: required, preferred".to_string(),
                );
                return None;
            }
            Some(value) => match value.trim().to_ascii_lowercase().as_str() {
                "required" => model::TopologyStrength::Required,
                "preferred" => model::TopologyStrength::Preferred,
                _ => {
                    self.error(
                        "topology.same_rack",
                        format!(
                            "unknown value {}; accepted: required, preferred",
                            quote(value)
                        ),
                    );
                    return None;
                }
            },
        };
        Some(model::TopologyConstraint { same_rack })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels() {
        for good in ["a", "train-1", "0", "a-b-c", &"a".repeat(63)] {
            assert!(is_dns_label(good), "{good}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", "é"] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn env_names() {
        assert!(is_env_name("HOME"));
        assert!(is_env_name("_x1"));
        assert!(!is_env_name("1X"));
        assert!(!is_env_name("A-B"));
        assert!(!is_env_name(""));
        assert!(is_reserved_env_name("MUSTER_JOB_ID"));
        assert!(is_reserved_env_name("PET_NNODES"));
        assert!(is_reserved_env_name("CUDA_VISIBLE_DEVICES"));
        assert!(!is_reserved_env_name("CUDA_HOME"));
    }
}
