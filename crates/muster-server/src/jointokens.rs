//! Join tokens: what a new node registers with. Each has an id (`jt-...`,
//! shown in lists; the token itself is shown once, at creation, and kept
//! only as its SHA-256), an optional expiry, an optional number of uses
//! (each node that joins with it takes one), an optional pool (the nodes it
//! admits join that pool), and can be revoked. The first start's token
//! (`join.token` in the data directory) is one of them, expiring after
//! `--join-token-ttl` (24 h by default) unless told otherwise.
//!
//! A registration with a token that expired, is used up or was revoked is
//! refused with which and what to do. The use is taken in the same commit
//! as the node's credential (under the core's lock), so a burst of
//! registrations cannot pass the count.

use crate::core::{Shared, now};
use crate::error::{ApiError, Body, PathParams};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use muster_api::protocol::{
    ErrorBody, ErrorCode, JoinTokenCreate, JoinTokenCreated, JoinTokenList, JoinTokenView,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// The most join tokens a server keeps (revoked and used-up ones count
/// until removed).
pub const MAX_JOIN_TOKENS: usize = 1_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinTokenRecord {
    pub id: String,
    /// SHA-256 of the token, hex.
    pub hash: String,
    pub created_ms: u64,
    /// `None`: never expires.
    pub expires_ms: Option<u64>,
    /// `None`: any number of nodes.
    pub max_uses: Option<u64>,
    pub uses: u64,
    /// The pool the nodes it admits join (`None`: as each agent says).
    pub pool: Option<String>,
    pub revoked: bool,
    /// The data directory's `join.token` (made at the first start).
    #[serde(default)]
    pub initial: bool,
}

impl JoinTokenRecord {
    /// `valid`, `expired`, `used up` or `revoked`, now.
    pub fn state(&self, now_ms: u64) -> &'static str {
        if self.revoked {
            "revoked"
        } else if self.expires_ms.is_some_and(|at| now_ms >= at) {
            "expired"
        } else if self.max_uses.is_some_and(|max| self.uses >= max) {
            "used up"
        } else {
            "valid"
        }
    }

    /// Why a new node may not join with it now, if it may not.
    pub fn refusal(&self, now_ms: u64) -> Option<String> {
        if self.revoked {
            return Some(format!(
                "the join token {} was revoked; ask an admin for another (`muster nodes token \
                 create`)",
                self.id
            ));
        }
        if let Some(expires) = self.expires_ms
            && now_ms >= expires
        {
            return Some(format!(
                "the join token {} expired {} ago; ask an admin for another (`muster nodes token \
                 create --ttl 1h`)",
                self.id,
                roughly((now_ms - expires) / 1000)
            ));
        }
        if let Some(max) = self.max_uses
            && self.uses >= max
        {
            return Some(format!(
                "the join token {} is used up ({max} of {max} nodes joined with it); ask an \
                 admin for another (`muster nodes token create --uses N`)",
                self.id
            ));
        }
        None
    }
}

/// `seconds` as a person reads it: `42s`, `5m`, `3h`, `2d`.
fn roughly(seconds: u64) -> String {
    match seconds {
        s if s < 120 => format!("{s}s"),
        s if s < 7_200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3_600),
        s => format!("{}d", s / 86_400),
    }
}

/// Every join token, by id and by hash.
#[derive(Debug, Default)]
pub struct JoinTokens {
    by_id: BTreeMap<String, JoinTokenRecord>,
    by_hash: HashMap<String, String>,
}

impl JoinTokens {
    pub fn load(records: Vec<JoinTokenRecord>) -> JoinTokens {
        let mut tokens = JoinTokens::default();
        for record in records {
            tokens.put(record);
        }
        tokens
    }

    fn put(&mut self, record: JoinTokenRecord) {
        self.by_hash.insert(record.hash.clone(), record.id.clone());
        self.by_id.insert(record.id.clone(), record);
    }

    /// The token's record, whatever its state.
    pub fn of_token(&self, token: &str) -> Option<&JoinTokenRecord> {
        let id = self.by_hash.get(&crate::users::token_hash(token))?;
        self.by_id.get(id)
    }

    pub fn get(&self, id: &str) -> Option<&JoinTokenRecord> {
        self.by_id.get(id)
    }

    pub fn list(&self) -> impl Iterator<Item = &JoinTokenRecord> {
        self.by_id.values()
    }

    /// Takes one use of token `id` for a node joining now: the record to
    /// store, or why not.
    pub fn take_use(&mut self, id: &str, now_ms: u64) -> Result<JoinTokenRecord, String> {
        let record = self
            .by_id
            .get_mut(id)
            .ok_or_else(|| format!("the join token {id} no longer exists"))?;
        if let Some(why) = record.refusal(now_ms) {
            return Err(why);
        }
        record.uses += 1;
        Ok(record.clone())
    }

    /// Gives back a use taken for a registration that was not committed.
    pub fn give_back(&mut self, id: &str) {
        if let Some(record) = self.by_id.get_mut(id) {
            record.uses = record.uses.saturating_sub(1);
        }
    }

    /// A new token's record (kept; the token itself is shown once), and
    /// the id of a dead token it displaced at [`MAX_JOIN_TOKENS`] (to
    /// delete from the store).
    pub fn create(
        &mut self,
        token: String,
        now_ms: u64,
        ttl_ms: Option<u64>,
        max_uses: Option<u64>,
        pool: Option<String>,
        initial: bool,
    ) -> Result<(JoinTokenRecord, Option<String>), String> {
        // At the limit, the oldest token that admits no node any more goes.
        let mut evicted = None;
        if self.by_id.len() >= MAX_JOIN_TOKENS {
            let oldest_dead = self
                .by_id
                .values()
                .filter(|record| record.state(now_ms) != "valid")
                .min_by_key(|record| (record.created_ms, record.id.clone()))
                .map(|record| record.id.clone());
            let Some(id) = oldest_dead else {
                return Err(format!(
                    "the server keeps at most {MAX_JOIN_TOKENS} join tokens and every one still \
                     admits nodes; revoke some (`muster nodes token revoke ID`) and try again"
                ));
            };
            self.remove(&id);
            evicted = Some(id);
        }
        let hash = crate::users::token_hash(&token);
        let id = format!("jt-{}", &hash[..12]);
        let record = JoinTokenRecord {
            id,
            hash,
            created_ms: now_ms,
            expires_ms: ttl_ms.map(|ttl| now_ms.saturating_add(ttl)),
            max_uses,
            uses: 0,
            pool,
            revoked: false,
            initial,
        };
        self.put(record.clone());
        Ok((record, evicted))
    }

    /// Revokes token `id`: the record to store.
    pub fn revoke(&mut self, id: &str) -> Option<JoinTokenRecord> {
        let record = self.by_id.get_mut(id)?;
        record.revoked = true;
        Some(record.clone())
    }

    /// Forgets token `id`.
    pub fn remove(&mut self, id: &str) -> Option<JoinTokenRecord> {
        let record = self.by_id.remove(id)?;
        self.by_hash.remove(&record.hash);
        Some(record)
    }
}

/// The most a join token may live: a year.
const MAX_TTL_MS: u64 = 366 * 86_400_000;

/// The most nodes one join token may admit when it names a count (as
/// `muster nodes token create --uses` and the API's schema say).
const MAX_USES: u64 = 1_000_000;

fn view(record: &JoinTokenRecord, now_ms: u64) -> JoinTokenView {
    JoinTokenView {
        id: record.id.clone(),
        created_ms: record.created_ms,
        expires_ms: record.expires_ms,
        max_uses: record.max_uses,
        uses: record.uses,
        pool: record.pool.clone(),
        revoked: record.revoked,
        initial: record.initial,
        state: record.state(now_ms).to_string(),
    }
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, JoinTokens> {
    shared
        .join_tokens
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn save(shared: &Shared, id: &str, record: Option<&JoinTokenRecord>) -> Result<(), ApiError> {
    shared
        .save_record(record, |batch, text| {
            batch.join_tokens.insert(id.to_string(), text);
        })
        .await
}

/// Make a join token; the token is in the answer, this once.
#[utoipa::path(
    post, path = "/v1/join-tokens", tag = "nodes",
    request_body = JoinTokenCreate,
    responses((status = 201, body = JoinTokenCreated), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn create_join_token(
    State(shared): State<std::sync::Arc<Shared>>,
    Body(request): Body<JoinTokenCreate>,
) -> Result<(StatusCode, Json<JoinTokenCreated>), ApiError> {
    if request
        .ttl_ms
        .is_some_and(|ttl| ttl == 0 || ttl > MAX_TTL_MS)
    {
        return Err(ApiError::invalid(
            "ttl_ms: from 1 ms to a year (leave it out for a token that lasts until revoked)",
        ));
    }
    if request
        .uses
        .is_some_and(|uses| uses == 0 || uses > MAX_USES)
    {
        return Err(ApiError::invalid(
            "uses: from 1 to 1000000 (leave it out for any number of nodes)",
        ));
    }
    if let Some(pool) = &request.pool
        && (!muster_model::is_plain_name(pool) || pool.len() > 63)
    {
        return Err(ApiError::invalid(format!(
            "pool: {pool:?} is not a pool name"
        )));
    }
    let token = crate::auth::new_token()
        .map_err(|error| ApiError::new(ErrorCode::Internal, error.to_string()))?;
    let (record, evicted) = lock(&shared)
        .create(
            token.clone(),
            now().0,
            request.ttl_ms,
            request.uses,
            request.pool.clone(),
            false,
        )
        .map_err(ApiError::invalid)?;
    if let Some(gone) = &evicted {
        save(&shared, gone, None).await?;
    }
    if let Err(error) = save(&shared, &record.id, Some(&record)).await {
        lock(&shared).remove(&record.id);
        return Err(error);
    }
    tracing::info!(join_token = %record.id, "join token made");
    Ok((
        StatusCode::CREATED,
        Json(JoinTokenCreated {
            join_token: view(&record, now().0),
            token,
        }),
    ))
}

/// Every join token (never a token itself).
#[utoipa::path(
    get, path = "/v1/join-tokens", tag = "nodes",
    responses((status = 200, body = JoinTokenList)),
    security(("bearer" = []))
)]
pub async fn list_join_tokens(State(shared): State<std::sync::Arc<Shared>>) -> Json<JoinTokenList> {
    let now_ms = now().0;
    Json(JoinTokenList {
        join_tokens: lock(&shared)
            .list()
            .map(|record| view(record, now_ms))
            .collect(),
    })
}

/// Revoke a join token: no new node joins with it (nodes that joined keep
/// their own credentials).
#[utoipa::path(
    post, path = "/v1/join-tokens/{id}/revoke", tag = "nodes",
    params(("id" = String, Path, description = "the token's id", pattern = "^jt-[0-9a-f]{12}$")),
    responses((status = 200, body = JoinTokenView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn revoke_join_token(
    State(shared): State<std::sync::Arc<Shared>>,
    PathParams(id): PathParams<String>,
) -> Result<Json<JoinTokenView>, ApiError> {
    let Some(record) = lock(&shared).revoke(&id) else {
        return Err(ApiError::not_found(format!(
            "no join token {id}; `muster nodes token list` lists them"
        )));
    };
    save(&shared, &id, Some(&record)).await?;
    tracing::info!(join_token = %id, "join token revoked");
    Ok(Json(view(&record, now().0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_admits_until_it_expires_is_used_up_or_revoked() {
        let mut tokens = JoinTokens::default();
        let record = tokens
            .create("a".repeat(64), 1_000, Some(60_000), Some(2), None, false)
            .unwrap()
            .0;
        assert!(record.id.starts_with("jt-"));
        assert_eq!(tokens.of_token(&"a".repeat(64)).unwrap().id, record.id);
        assert!(tokens.of_token(&"b".repeat(64)).is_none());
        assert_eq!(tokens.take_use(&record.id, 2_000).unwrap().uses, 1);
        assert_eq!(tokens.take_use(&record.id, 3_000).unwrap().uses, 2);
        let used_up = tokens.take_use(&record.id, 4_000).unwrap_err();
        assert!(used_up.contains("used up (2 of 2"), "{used_up}");
        tokens.give_back(&record.id);
        let expired = tokens.take_use(&record.id, 61_000).unwrap_err();
        assert!(expired.contains("expired"), "{expired}");
        let forever = tokens
            .create("c".repeat(64), 0, None, None, Some("train".into()), true)
            .unwrap()
            .0;
        assert!(tokens.take_use(&forever.id, u64::MAX - 1).is_ok());
        tokens.revoke(&forever.id).unwrap();
        let revoked = tokens.take_use(&forever.id, 5).unwrap_err();
        assert!(revoked.contains("revoked"), "{revoked}");
        tokens.remove(&forever.id).unwrap();
        assert!(tokens.of_token(&"c".repeat(64)).is_none());
    }

    #[test]
    fn at_the_limit_the_oldest_dead_token_makes_room_and_a_live_one_never_does() {
        let mut tokens = JoinTokens::default();
        let token = |i: usize| format!("{i:064x}");
        for i in 0..MAX_JOIN_TOKENS {
            // The first two admit no one any more: one expired, one revoked.
            let ttl = (i == 0).then_some(10);
            let (record, evicted) = tokens
                .create(token(i), i as u64, ttl, None, None, false)
                .unwrap();
            assert_eq!(evicted, None);
            if i == 1 {
                tokens.revoke(&record.id).unwrap();
            }
        }
        let first = tokens.of_token(&token(0)).unwrap().id.clone();
        let (_, evicted) = tokens
            .create(token(5_000), 10_000, None, None, None, false)
            .unwrap();
        assert_eq!(evicted, Some(first));
        assert!(tokens.of_token(&token(0)).is_none());
        let (_, evicted) = tokens
            .create(token(5_001), 10_000, None, None, None, false)
            .unwrap();
        assert!(evicted.is_some(), "the revoked one goes next");
        let full = tokens
            .create(token(5_002), 10_000, None, None, None, false)
            .unwrap_err();
        assert!(full.contains("every one still admits nodes"), "{full}");
        assert_eq!(tokens.list().count(), MAX_JOIN_TOKENS);
    }
}
