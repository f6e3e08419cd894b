//! Secrets: values a job names (`env: {HF_TOKEN: {secret: hf}}`) and never
//! holds. Encrypted at rest with ChaCha20-Poly1305 under a key kept in
//! `secrets.key` beside the store (mode 0600; a copy of the store alone
//! reveals nothing), kept encrypted in memory, and decrypted only into the
//! desired set of the node that runs a task of a job that names them. A
//! secret is for one queue's jobs, or (`queue` empty) for every queue's.

use crate::core::{Shared, now};
use crate::error::{ApiError, Body, Params, PathParams};
use axum::Json;
use axum::extract::State;
use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use muster_api::protocol::{ErrorBody, ErrorCode, SecretList, SecretSet, SecretView};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The largest secret value.
pub const MAX_SECRET_BYTES: usize = 64 * 1024;
/// The most secrets a server keeps.
pub const MAX_SECRETS: usize = 10_000;

/// A secret as stored: its value sealed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretRecord {
    pub name: String,
    /// Empty: every queue.
    pub queue: String,
    /// Base64 of the 12-byte nonce and the ciphertext (with its tag).
    pub sealed: String,
    pub updated_ms: u64,
}

/// Every secret, sealed, and the key that opens them.
pub struct Secrets {
    cipher: ChaCha20Poly1305,
    /// For values derived from the key (dev environments' tokens).
    derive_key: [u8; 32],
    records: BTreeMap<(String, String), SecretRecord>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets")
            .field("count", &self.records.len())
            .finish_non_exhaustive()
    }
}

/// Reads (or makes, mode 0600) the key file: 32 random bytes as hex.
pub fn load_key(path: &std::path::Path) -> anyhow::Result<[u8; 32]> {
    let (text, _) = crate::auth::load_or_create(path)?;
    let bytes: Vec<u8> = (0..text.len())
        .step_by(2)
        .filter_map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect();
    bytes.try_into().map_err(|_| {
        anyhow::anyhow!(
            "{} is not a secrets key (64 hex digits); restore it from a backup (the secrets in \
             the store cannot be read without it)",
            path.display()
        )
    })
}

impl Secrets {
    pub fn new(key: [u8; 32], records: Vec<SecretRecord>) -> Secrets {
        use sha2::Digest;
        let mut derive = sha2::Sha256::new();
        derive.update(b"muster: values derived from secrets.key\0");
        derive.update(key);
        Secrets {
            derive_key: derive.finalize().into(),
            cipher: ChaCha20Poly1305::new(Key::from_slice(&key)),
            records: records
                .into_iter()
                .map(|r| ((r.name.clone(), r.queue.clone()), r))
                .collect(),
        }
    }

    /// A value derived from the key for `label` and `id` (hex, 64
    /// characters): the same for the same inputs, unguessable without the
    /// key.
    pub fn derive(&self, label: &str, id: u64) -> String {
        use sha2::Digest;
        let mut hash = sha2::Sha256::new();
        hash.update(self.derive_key);
        hash.update(label.as_bytes());
        hash.update([0]);
        hash.update(id.to_be_bytes());
        hash.finalize()
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect()
    }

    /// Seals `value` as secret `name` of `queue`.
    pub fn seal(&self, name: &str, queue: &str, value: &[u8]) -> Result<SecretRecord, String> {
        let mut nonce = [0u8; 12];
        getrandom::fill(&mut nonce).map_err(|error| error.to_string())?;
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), value)
            .map_err(|_| "cannot encrypt".to_string())?;
        let mut bytes = nonce.to_vec();
        bytes.extend(sealed);
        Ok(SecretRecord {
            name: name.to_string(),
            queue: queue.to_string(),
            sealed: base64::engine::general_purpose::STANDARD.encode(bytes),
            updated_ms: now().0,
        })
    }

    fn open(&self, record: &SecretRecord) -> Option<String> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&record.sealed)
            .ok()?;
        if bytes.len() < 12 {
            return None;
        }
        let (nonce, sealed) = bytes.split_at(12);
        let plain = self.cipher.decrypt(Nonce::from_slice(nonce), sealed).ok()?;
        String::from_utf8(plain).ok()
    }

    pub fn put(&mut self, record: SecretRecord) {
        self.records
            .insert((record.name.clone(), record.queue.clone()), record);
    }

    pub fn remove(&mut self, name: &str, queue: &str) -> Option<SecretRecord> {
        self.records.remove(&(name.to_string(), queue.to_string()))
    }

    /// The record a job of `queue` gets for `name`: its queue's, else the
    /// one for every queue.
    fn for_queue(&self, name: &str, queue: &str) -> Option<&SecretRecord> {
        self.records
            .get(&(name.to_string(), queue.to_string()))
            .or_else(|| self.records.get(&(name.to_string(), String::new())))
    }

    /// Whether a job of `queue` may use `name`.
    pub fn usable(&self, name: &str, queue: &str) -> bool {
        self.for_queue(name, queue).is_some()
    }

    /// The value of `name` for a job of `queue`.
    pub fn value(&self, name: &str, queue: &str) -> Option<String> {
        self.open(self.for_queue(name, queue)?)
    }

    pub fn all(&self) -> impl Iterator<Item = &SecretRecord> {
        self.records.values()
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

fn locked(shared: &Shared) -> std::sync::MutexGuard<'_, Secrets> {
    match shared.secrets.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Puts the secrets each task's job names into its environment, on the
/// way to the node (a secret gone since the job was submitted is left out,
/// and logged by name).
pub fn fill(
    shared: &Shared,
    control: &muster_control::ControlPlane,
    desired: &mut [muster_api::protocol::DesiredAllocation],
) {
    let secrets = locked(shared);
    for task in desired {
        let Some(job) = control.job(muster_model::JobId(task.job)) else {
            continue;
        };
        if let Some(name) = &job.spec.image_pull_secret {
            task.registry_auth = secrets.value(name, &job.spec.queue.0);
            if task.registry_auth.is_none() {
                tracing::warn!(
                    job = task.job,
                    secret = %name,
                    "a job's image pull secret is gone (or cannot be opened); its image is \
                     pulled without credentials"
                );
            }
        }
        if job.spec.is_dev_environment() {
            task.env.insert(
                muster_model::DEV_TOKEN_VARIABLE.to_string(),
                secrets.derive("dev-session", job.id.0),
            );
        }
        for (variable, name) in &job.spec.secrets {
            match secrets.value(name, &job.spec.queue.0) {
                Some(value) => {
                    task.env.insert(variable.clone(), value);
                }
                None => tracing::warn!(
                    job = task.job,
                    secret = %name,
                    "a job names a secret that is gone (or cannot be opened); its task runs \
                     without it"
                ),
            }
        }
    }
}

/// Checks that every secret a spec names exists for its queue.
pub fn check_spec(shared: &Shared, spec: &muster_model::JobSpec) -> Result<(), ApiError> {
    let secrets = locked(shared);
    let missing: Vec<&String> = spec
        .secrets
        .values()
        .chain(&spec.image_pull_secret)
        .filter(|name| !secrets.usable(name, &spec.queue.0))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "no secret {} for queue {}: an admin sets one with `muster secrets set NAME [--queue {}]`",
        missing
            .iter()
            .map(|name| format!("{name:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        spec.queue,
        spec.queue
    )))
}

// ------------------------------------------------------------- endpoints

type Shared_ = State<std::sync::Arc<Shared>>;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SecretQuery {
    /// The queue the secret is for (absent or empty: the one for every
    /// queue).
    #[param(pattern = "^([A-Za-z0-9][A-Za-z0-9._-]{0,62})?$")]
    pub queue: Option<String>,
}

fn view(record: &SecretRecord) -> SecretView {
    SecretView {
        name: record.name.clone(),
        queue: (!record.queue.is_empty()).then(|| record.queue.clone()),
        updated_ms: record.updated_ms,
    }
}

fn check_names(name: &str, queue: &str) -> Result<(), ApiError> {
    let plain = |text: &str| muster_model::is_plain_name(text) && text.len() <= 63;
    if !plain(name) {
        return Err(ApiError::invalid(format!(
            "a secret's name is 1 to 63 letters, digits, '-', '_' or '.'; got {name:?}"
        )));
    }
    if !queue.is_empty() && !plain(queue) {
        return Err(ApiError::invalid(format!("{queue:?} is not a queue name")));
    }
    Ok(())
}

async fn save(
    shared: &Shared,
    name: &str,
    queue: &str,
    record: Option<&SecretRecord>,
) -> Result<(), ApiError> {
    shared
        .save_record(record, |batch, text| {
            batch
                .secrets
                .insert((name.to_string(), queue.to_string()), text);
        })
        .await
}

/// Set a secret's value (admin); the answer never holds it.
#[utoipa::path(
    put, path = "/v1/secrets/{name}", tag = "secrets",
    params(("name" = String, Path, description = "the secret", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = SecretSet,
    responses((status = 200, body = SecretView), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn set_secret(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
    Body(request): Body<SecretSet>,
) -> Result<Json<SecretView>, ApiError> {
    let queue = request.queue.clone().unwrap_or_default();
    check_names(&name, &queue)?;
    if request.value.len() > MAX_SECRET_BYTES || request.value.contains('\0') {
        return Err(ApiError::invalid(format!(
            "a secret's value is at most {MAX_SECRET_BYTES} bytes, without NUL"
        )));
    }
    let record = {
        let secrets = locked(&shared);
        if secrets.len() >= MAX_SECRETS
            && !secrets.records.contains_key(&(name.clone(), queue.clone()))
        {
            return Err(ApiError::invalid(format!("at most {MAX_SECRETS} secrets")));
        }
        secrets
            .seal(&name, &queue, request.value.as_bytes())
            .map_err(|error| ApiError::new(ErrorCode::Internal, error))?
    };
    save(&shared, &name, &queue, Some(&record)).await?;
    locked(&shared).put(record.clone());
    tracing::info!(secret = %name, queue = %queue, "secret set");
    Ok(Json(view(&record)))
}

/// Every secret's name and queue (never a value).
#[utoipa::path(
    get, path = "/v1/secrets", tag = "secrets",
    responses((status = 200, body = SecretList)),
    security(("bearer" = []))
)]
pub async fn list_secrets(State(shared): Shared_) -> Json<SecretList> {
    Json(SecretList {
        secrets: locked(&shared).all().map(view).collect(),
    })
}

/// Remove a secret.
#[utoipa::path(
    delete, path = "/v1/secrets/{name}", tag = "secrets",
    params(("name" = String, Path, description = "the secret", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"), SecretQuery),
    responses((status = 200, body = SecretView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn remove_secret(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
    Params(query): Params<SecretQuery>,
) -> Result<Json<SecretView>, ApiError> {
    let queue = query.queue.unwrap_or_default();
    let Some(record) = locked(&shared)
        .records
        .get(&(name.clone(), queue.clone()))
        .cloned()
    else {
        return Err(ApiError::not_found(format!(
            "no secret {name}{}; `muster secrets list` lists them",
            if queue.is_empty() {
                String::new()
            } else {
                format!(" for queue {queue}")
            }
        )));
    };
    save(&shared, &name, &queue, None).await?;
    locked(&shared).remove(&name, &queue);
    Ok(Json(view(&record)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_is_found_by_queue() {
        let secrets = Secrets::new([7; 32], Vec::new());
        let record = secrets.seal("hf", "", b"hunter2").expect("sealed");
        assert!(!record.sealed.contains("hunter2"));
        let other = secrets.seal("hf", "team-a", b"team-value").expect("sealed");
        let mut secrets = Secrets::new([7; 32], vec![record.clone()]);
        secrets.put(other);
        assert_eq!(secrets.value("hf", "team-b").as_deref(), Some("hunter2"));
        assert_eq!(secrets.value("hf", "team-a").as_deref(), Some("team-value"));
        assert!(secrets.value("nope", "team-a").is_none());
        // Another key opens nothing.
        let wrong = Secrets::new([8; 32], vec![record]);
        assert!(wrong.value("hf", "x").is_none());
    }
}
