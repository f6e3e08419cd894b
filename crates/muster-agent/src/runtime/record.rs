//! The pid file of a task, `STATE_DIR/tasks/<allocation>.json`: what a
//! restarted agent needs to find the task's processes again.

use super::RuntimeError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Bumped when a field changes meaning; older agents refuse newer files.
pub(super) const FORMAT: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct TaskRecord {
    pub format: u32,
    pub allocation: String,
    pub pid: i32,
    /// Equal to `pid`: the task leads its own group.
    pub pgid: i32,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// The kernel's boot id when the task started: after a reboot the pid
    /// file's numbers name other processes, if any.
    pub boot_id: Option<String>,
    pub command: Vec<String>,
    pub gpu_indices: Vec<u32>,
    pub gpu_uuids: Vec<String>,
    /// `TERM`, `INT`, ...
    pub stop_signal: String,
    pub grace_period_ms: u64,
    /// Set when the agent saw the task's leader exit.
    pub exit: Option<ExitRecord>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ExitRecord {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
}

/// Writes the record through a temporary file and a rename, so a reader (or
/// an agent restarted after a crash) never sees half a file.
pub(super) async fn write(path: &Path, record: &TaskRecord) -> Result<(), RuntimeError> {
    let state_error = |source| RuntimeError::State {
        path: path.to_path_buf(),
        source,
    };
    let text = serde_json::to_vec_pretty(record).map_err(|error| state_error(error.into()))?;
    let temporary = path.with_extension("json.tmp");
    tokio::fs::write(&temporary, text)
        .await
        .map_err(state_error)?;
    tokio::fs::rename(&temporary, path)
        .await
        .map_err(state_error)
}

/// Reads a record; the error is a sentence for the report of a recovery.
pub(super) async fn read(path: &Path) -> Result<TaskRecord, String> {
    let text = tokio::fs::read(path)
        .await
        .map_err(|error| format!("cannot read it: {error}"))?;
    let record: TaskRecord =
        serde_json::from_slice(&text).map_err(|error| format!("it is not a pid file: {error}"))?;
    if record.format != FORMAT {
        return Err(format!(
            "it has format {}, and this agent reads format {FORMAT}; upgrade the agent",
            record.format
        ));
    }
    Ok(record)
}

/// The kernel's boot id, where the host has one.
pub(super) fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty())
}
