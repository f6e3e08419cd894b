//! Errors of a job spec: one per problem, each naming the field, the value
//! and what is accepted, all reported together.

use std::fmt;

/// A line and column (both from 1) in the text of a spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TextLocation {
    pub line: u64,
    pub column: u64,
}

/// One problem in a job spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", display_spec_error(self))]
pub struct SpecError {
    /// Where the problem is, as a field path: `gpus`, `checkpoint.signal`,
    /// `command[2]`, `env.HOME`. Empty when it concerns the whole document
    /// (a YAML syntax error, a spec that is too large).
    pub path: String,
    /// What is wrong, in words a person can act on (lowercase, no trailing
    /// period): the value found and what is accepted.
    pub message: String,
    /// Where in the text, when the parser could tell.
    pub location: Option<TextLocation>,
}

impl SpecError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        SpecError {
            path: path.into(),
            message: message.into(),
            location: None,
        }
    }

    /// A problem with the document as a whole.
    pub fn document(message: impl Into<String>, location: Option<TextLocation>) -> Self {
        SpecError {
            path: String::new(),
            message: message.into(),
            location,
        }
    }
}

fn display_spec_error(error: &SpecError) -> String {
    if error.path.is_empty() {
        error.message.clone()
    } else {
        format!("{}: {}", error.path, error.message)
    }
}

/// Every problem found in a job spec, in the order of the spec's fields.
/// Displays one problem per line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", display_spec_errors(self))]
pub struct SpecErrors(pub Vec<SpecError>);

impl SpecErrors {
    pub fn single(error: SpecError) -> Self {
        SpecErrors(vec![error])
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, SpecError> {
        self.0.iter()
    }

    /// The field paths, in order, for tests and machine consumers.
    pub fn paths(&self) -> Vec<&str> {
        self.0.iter().map(|error| error.path.as_str()).collect()
    }
}

impl IntoIterator for SpecErrors {
    type Item = SpecError;
    type IntoIter = std::vec::IntoIter<SpecError>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a SpecErrors {
    type Item = &'a SpecError;
    type IntoIter = std::slice::Iter<'a, SpecError>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

fn display_spec_errors(errors: &SpecErrors) -> String {
    let mut text = String::new();
    for (index, error) in errors.0.iter().enumerate() {
        if index > 0 {
            text.push('\n');
        }
        // Writing to a String cannot fail.
        let _ = fmt::write(&mut text, format_args!("{error}"));
    }
    text
}

/// A value as an error message shows it: strings quoted and escaped (and cut
/// when long), numbers and booleans as they are, collections by kind.
pub(crate) fn describe_value(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "nothing".to_string(),
        Value::Bool(flag) => flag.to_string(),
        Value::Number(number) => number.to_string(),
        Value::String(text) => quote(text),
        Value::Array(_) => "a list".to_string(),
        Value::Object(_) => "a mapping".to_string(),
    }
}

/// A string as an error message shows it: in double quotes, escaped, cut at
/// 64 characters.
pub(crate) fn quote(text: &str) -> String {
    const LIMIT: usize = 64;
    if text.chars().count() > LIMIT {
        let cut: String = text.chars().take(LIMIT).collect();
        format!("{cut:?}...")
    } else {
        format!("{text:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_one_error_per_line() {
        let errors = SpecErrors(vec![
            SpecError::new("nodes", "must be at least 1, got 0"),
            SpecError::document("invalid yaml: oops", None),
        ]);
        assert_eq!(
            errors.to_string(),
            "nodes: must be at least 1, got 0\ninvalid yaml: oops"
        );
    }

    #[test]
    fn long_strings_are_cut() {
        let long = "x".repeat(100);
        assert_eq!(quote(&long), format!("{:?}...", "x".repeat(64)));
        assert_eq!(quote("a\"b"), "\"a\\\"b\"");
    }
}
