//! muster's wire types: the job spec as users write it (YAML or JSON), and its
//! validation into `muster-model` types.
//!
//! This crate owns the job spec's wire format (field names, defaults, the
//! accepted forms of quantities and durations), the parsing of YAML and JSON
//! (with limits against oversized inputs and alias bombs), and the errors a
//! person sees for a bad spec: every problem at once, each naming the field,
//! the value and what is accepted, with the closest valid name suggested for
//! a misspelt field.
//!
//! It also owns the cluster spec (groups of identical nodes, see
//! [`cluster`]), which the simulator reads to build its fleet.
//!
//! It decides nothing and does no I/O: no tokio, HTTP, database, clock or
//! environment here. It depends only on `muster-model` and on serde-based
//! parsing; the server and the CLI call it.
//!
//! ```
//! let spec = muster_api::parse_job_spec_yaml(
//!     "name: notebook\ngpus: 0.25\ncommand: jupyter lab\n",
//! )
//! .expect("a valid spec");
//! assert_eq!(spec.command, ["sh", "-c", "jupyter lab"]);
//!
//! let errors = muster_api::parse_job_spec_yaml("name: x\ngpu: 8\nnodes: 0\ncommand: [a]\n")
//!     .expect_err("two problems");
//! assert_eq!(
//!     errors.to_string(),
//!     "gpu: unknown field; did you mean \"gpus\"?\nnodes: must be at least 1, got 0"
//! );
//! ```

#[cfg(feature = "client")]
pub mod client;
pub mod cluster;
mod error;
mod parse;
pub mod prices;
pub mod protocol;
mod quantity;
mod read;
pub mod sbatch;
pub mod service;
#[cfg(feature = "client")]
pub mod tls;
mod validate;
mod wire;

#[cfg(test)]
mod tests;

pub use cluster::{ClusterSpec, NodeGroupSpec, parse_cluster_spec_yaml, parse_queue_file_yaml};
pub use error::{SpecError, SpecErrors, TextLocation};
pub use parse::{MAX_SPEC_BYTES, parse_job_spec_json, parse_job_spec_value, parse_job_spec_yaml};
pub use quantity::{DURATION_PATTERN, parse_api_duration, parse_duration_text};
pub use validate::{
    MAX_ARRAY_BYTES, MAX_ATTEMPTS, MAX_CPUS_PER_NODE, MAX_GPUS_PER_NODE, MAX_GRACE_PERIOD,
    MAX_NAME_LENGTH, MAX_NODES, RESERVED_ENV_NAMES, RESERVED_ENV_PREFIXES, is_env_name,
    is_reserved_env_name, validate,
};
pub use wire::{
    CheckpointSpec, CommandSpec, JobSpec, MountSpec, Quantity, RetrySpec, TopologySpec,
    parse_dependency,
};
