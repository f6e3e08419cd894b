//! From text (YAML or JSON) to a validated [`muster_model::JobSpec`], with
//! limits against oversized and amplifying inputs, and every problem of a
//! spec reported at once.

use crate::error::{SpecError, SpecErrors, TextLocation};
use crate::read::{JOB_FIELDS, read_job_spec};
use crate::validate::validate;
use muster_model as model;
use serde_json::Value;

/// The largest spec accepted, in bytes of text.
pub const MAX_SPEC_BYTES: usize = 1024 * 1024;

/// Parses and validates a job spec written in YAML.
pub fn parse_job_spec_yaml(text: &str) -> Result<model::JobSpec, SpecErrors> {
    check_size(text)?;
    let value = yaml_value(text)?;
    parse_job_spec_value(&value)
}

/// Parses and validates a job spec written in JSON.
pub fn parse_job_spec_json(text: &str) -> Result<model::JobSpec, SpecErrors> {
    check_size(text)?;
    let value: Value = serde_json::from_str(text).map_err(|error| {
        let location = (error.line() > 0).then(|| TextLocation {
            line: error.line() as u64,
            column: error.column() as u64,
        });
        SpecErrors::single(SpecError::document(
            format!("invalid json: {error}"),
            location,
        ))
    })?;
    parse_job_spec_value(&value)
}

/// Reads and validates a job spec from a generic value (already parsed YAML
/// or JSON). Unknown fields, values of the wrong kind and invalid values are
/// all reported together, in the order of the spec's fields.
pub fn parse_job_spec_value(value: &Value) -> Result<model::JobSpec, SpecErrors> {
    let mut read = read_job_spec(value);
    if !read.document_errors.is_empty() {
        return Err(SpecErrors(read.document_errors));
    }
    let mut field_errors = std::mem::take(&mut read.field_errors);
    match validate(&read.spec) {
        Ok(spec) if read.unknown_fields.is_empty() && field_errors.is_empty() => {
            return Ok(spec);
        }
        Ok(_) => {}
        Err(errors) => field_errors.extend(
            errors
                .into_iter()
                .filter(|error| !read.already_reported(&error.path)),
        ),
    }
    // Stable: within a field, errors keep the order they were found in.
    field_errors.sort_by_key(|error| field_rank(&error.path));
    let mut errors = read.unknown_fields;
    errors.extend(field_errors);
    Err(SpecErrors(errors))
}

/// Position of a path's top-level field in the spec.
fn field_rank(path: &str) -> usize {
    let top = path.split(['.', '[']).next().unwrap_or(path);
    JOB_FIELDS
        .iter()
        .position(|field| *field == top)
        .unwrap_or(JOB_FIELDS.len())
}

pub(crate) fn check_size(text: &str) -> Result<(), SpecErrors> {
    if text.len() > MAX_SPEC_BYTES {
        return Err(SpecErrors::single(SpecError::document(
            format!(
                "the spec is too large: {} bytes; at most {MAX_SPEC_BYTES} bytes (1 MiB) are accepted",
                text.len()
            ),
            None,
        )));
    }
    Ok(())
}

/// Limits for YAML: job and cluster specs are small and shallow, so anything
/// deep, wide or built from many aliases (a "billion laughs" bomb) is
/// refused early.
fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: 32,
            max_documents: 1,
            max_nodes: 50_000,
            max_events: 200_000,
            max_aliases: 1_000,
            max_anchors: 1_000,
            max_total_scalar_bytes: MAX_SPEC_BYTES,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: 10_000,
            max_replay_stack_depth: 16,
        },
    }
}

/// Parses YAML into a JSON value within [`yaml_options`]' limits; a syntax
/// error names its line and column.
pub(crate) fn yaml_value(text: &str) -> Result<Value, SpecErrors> {
    serde_saphyr::from_str_with_options::<Value>(text, yaml_options()).map_err(|error| {
        let location = error.location().and_then(|location| {
            (location.line() > 0).then(|| TextLocation {
                line: location.line(),
                column: location.column(),
            })
        });
        let mut options = serde_saphyr::RenderOptions::new(&serde_saphyr::UserMessageFormatter);
        options.snippets = serde_saphyr::SnippetMode::Off;
        SpecErrors::single(SpecError::document(
            format!("invalid yaml: {}", error.render_with_options(options)),
            location,
        ))
    })
}
