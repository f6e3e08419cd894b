//! Users and roles: who a token belongs to, and what each role may do.
//!
//! A user has a name, a role and the queues it may submit to; its token is
//! shown once, when it is made, and only its SHA-256 is kept (in the store
//! and in memory), so a copy of the store gives no one's token. The admin
//! token in the data directory is the built-in `admin` (what `muster up`
//! uses).
//!
//! - `user`: submits to its queues; sees, reads the output of and cancels
//!   its own jobs (and reads the jobs of a queue it belongs to when the
//!   queue lets members see each other's); reads nodes, pools, queues and
//!   prices.
//! - `operator`: also reads every job and its output, manages nodes and
//!   pools (cordon, drain, remove, reset, pool policies), reads cost.
//! - `admin`: everything: queues, prices, users, the audit log, any job.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Operator,
    Admin,
}

impl Role {
    pub fn parse(text: &str) -> Option<Role> {
        Some(match text {
            "user" => Role::User,
            "operator" => Role::Operator,
            "admin" => Role::Admin,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// A user as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserRecord {
    pub name: String,
    pub role: Role,
    /// The queues it may submit to (`default` when none are given).
    pub queues: Vec<String>,
    /// SHA-256 of its token, hex.
    pub token_sha256: String,
    pub created_ms: u64,
    /// The most jobs it may have pending (`None`: the server's
    /// `--max-pending-per-user` for a user, none for staff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending: Option<u64>,
    /// The number of its group on the nodes (see [`Users::group_of`]):
    /// given when the user is made, never given to another user, even
    /// once this one is removed. `None` only in records of servers before
    /// groups, numbered at the next start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_group: Option<u32>,
}

/// Who made a request, for authorization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
    /// `None`: every queue (admins, operators).
    pub queues: Option<Vec<String>>,
}

impl Principal {
    pub fn admin() -> Principal {
        Principal {
            name: crate::api::DEFAULT_USER.to_string(),
            role: Role::Admin,
            queues: None,
        }
    }

    pub fn of(record: &UserRecord) -> Principal {
        Principal {
            name: record.name.clone(),
            role: record.role,
            queues: match record.role {
                Role::User => Some(record.queues.clone()),
                Role::Operator | Role::Admin => None,
            },
        }
    }

    pub fn member_of(&self, queue: &str) -> bool {
        self.queues
            .as_ref()
            .is_none_or(|queues| queues.iter().any(|q| q == queue))
    }

    /// Whether it may read a job of `user` in `queue` (whose members see
    /// each other's jobs when `shared`).
    pub fn may_read(&self, user: &str, queue: &str, shared: bool) -> bool {
        self.role >= Role::Operator || self.name == user || (shared && self.member_of(queue))
    }

    /// Whether it may cancel a job of `user`: its own, or any for an admin.
    pub fn may_cancel(&self, user: &str) -> bool {
        self.role == Role::Admin || self.name == user
    }
}

/// What the server loads of users and idempotency keys at start.
#[derive(Debug)]
pub struct Tenants {
    pub join_tokens: crate::jointokens::JoinTokens,
    pub users: Users,
    pub keys: crate::idempotency::Keys,
    pub secrets: crate::secrets::Secrets,
}

/// SHA-256 of a token, hex.
pub fn token_hash(token: &str) -> String {
    // Hex by table: every request's token is hashed (formatting each byte
    // was a heap string per byte, 6% of a server answering heartbeats).
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut hex = String::with_capacity(64);
    for byte in Sha256::digest(token.as_bytes()) {
        hex.push(char::from(HEX[usize::from(byte >> 4)]));
        hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    hex
}

/// The most users a server keeps.
pub const MAX_USERS: usize = 10_000;

/// The group number of the built-in `admin` (what `muster up` submits
/// as); users are numbered from 1 in the order they are made.
pub const ADMIN_TASK_GROUP: u32 = 0;

/// Every user, by name and by token hash.
#[derive(Debug)]
pub struct Users {
    by_name: BTreeMap<String, UserRecord>,
    by_hash: HashMap<String, String>,
    /// The next user's group number: above every number ever given.
    next_group: u32,
}

impl Default for Users {
    fn default() -> Users {
        Users {
            by_name: BTreeMap::new(),
            by_hash: HashMap::new(),
            next_group: ADMIN_TASK_GROUP + 1,
        }
    }
}

impl Users {
    /// The users as stored, with `next_group` the stored mark of group
    /// numbers given so far. Records without a number (made before groups)
    /// are numbered now, oldest first; they are returned too, to be stored.
    pub fn load(records: Vec<UserRecord>, next_group: u64) -> (Users, Vec<UserRecord>) {
        let mut users = Users::default();
        let mut next = u32::try_from(next_group)
            .unwrap_or(u32::MAX)
            .max(ADMIN_TASK_GROUP + 1);
        for record in &records {
            if let Some(group) = record.task_group {
                next = next.max(group.saturating_add(1));
            }
        }
        users.next_group = next;
        let mut unnumbered: Vec<UserRecord> = Vec::new();
        for record in records {
            if record.task_group.is_some() {
                users.put(record);
            } else {
                unnumbered.push(record);
            }
        }
        unnumbered.sort_by(|a, b| (a.created_ms, &a.name).cmp(&(b.created_ms, &b.name)));
        for record in &mut unnumbered {
            record.task_group = Some(users.take_group());
            users.put(record.clone());
        }
        (users, unnumbered)
    }

    /// A group number for a user being made: never given before.
    pub fn take_group(&mut self) -> u32 {
        let group = self.next_group;
        self.next_group = self.next_group.saturating_add(1);
        group
    }

    /// The mark to store with a user made: above every number given.
    pub fn next_group(&self) -> u32 {
        self.next_group
    }

    /// The group number the tasks of `user` run in on nodes where the user
    /// has no account: the same on every node and for every run, so a
    /// job's later attempt may write the files an earlier one left, and
    /// never another user's (`None`: no such user, e.g. one removed).
    pub fn group_of(&self, user: &str) -> Option<u32> {
        if user == crate::api::DEFAULT_USER {
            return Some(ADMIN_TASK_GROUP);
        }
        self.by_name.get(user)?.task_group
    }

    /// Adds or replaces a user (a replaced token stops working).
    pub fn put(&mut self, record: UserRecord) {
        if let Some(old) = self.by_name.get(&record.name) {
            self.by_hash.remove(&old.token_sha256);
        }
        self.by_hash
            .insert(record.token_sha256.clone(), record.name.clone());
        self.by_name.insert(record.name.clone(), record);
    }

    pub fn remove(&mut self, name: &str) -> Option<UserRecord> {
        let record = self.by_name.remove(name)?;
        self.by_hash.remove(&record.token_sha256);
        Some(record)
    }

    pub fn get(&self, name: &str) -> Option<&UserRecord> {
        self.by_name.get(name)
    }

    /// The user whose token this is.
    pub fn of_token(&self, token: &str) -> Option<&UserRecord> {
        let name = self.by_hash.get(&token_hash(token))?;
        self.by_name.get(name)
    }

    pub fn all(&self) -> impl Iterator<Item = &UserRecord> {
        self.by_name.values()
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, role: Role, token: &str) -> UserRecord {
        UserRecord {
            name: name.to_string(),
            role,
            queues: vec!["team-a".to_string()],
            token_sha256: token_hash(token),
            created_ms: 0,
            max_pending: None,
            task_group: None,
        }
    }

    #[test]
    fn a_token_finds_its_user_and_a_rotated_one_no_longer_does() {
        let (mut users, _) = Users::load(vec![record("alice", Role::User, "t1")], 0);
        assert_eq!(users.of_token("t1").map(|u| u.name.as_str()), Some("alice"));
        assert!(users.of_token("t2").is_none());
        users.put(record("alice", Role::User, "t2"));
        assert!(users.of_token("t1").is_none());
        assert!(users.of_token("t2").is_some());
        users.remove("alice");
        assert!(users.of_token("t2").is_none());
        assert_eq!(token_hash("abc").len(), 64);
    }

    #[test]
    fn group_numbers_are_unique_kept_and_never_given_again() {
        let numbered = |name: &str, group: u32, created_ms: u64| UserRecord {
            task_group: Some(group),
            created_ms,
            ..record(name, Role::User, name)
        };
        let older = |name: &str, created_ms: u64| UserRecord {
            created_ms,
            ..record(name, Role::User, name)
        };
        // Stored: carol 7, and a mark of 9 (a user numbered 8 was removed);
        // alice and bob come from before groups (bob the older).
        let (mut users, numbered_now) = Users::load(
            vec![
                numbered("carol", 7, 5),
                older("alice", 20),
                older("bob", 10),
            ],
            9,
        );
        assert_eq!(users.group_of("carol"), Some(7));
        assert_eq!(users.group_of("bob"), Some(9));
        assert_eq!(users.group_of("alice"), Some(10));
        assert_eq!(
            users.group_of(crate::api::DEFAULT_USER),
            Some(ADMIN_TASK_GROUP)
        );
        assert_eq!(users.group_of("nobody-here"), None);
        let names: Vec<&str> = numbered_now.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["bob", "alice"]);
        // The next user's is above every one given, removed ones too.
        users.remove("alice");
        assert_eq!(users.take_group(), 11);
        assert_eq!(users.next_group(), 12);
        // A mark below a stored number (a lost write) does not reuse it.
        let (users, _) = Users::load(vec![numbered("dave", 30, 0)], 3);
        assert_eq!(users.next_group(), 31);
        // Rotating a token keeps the number.
        let mut users = users;
        users.put(UserRecord {
            token_sha256: token_hash("new"),
            ..users.get("dave").cloned().expect("dave")
        });
        assert_eq!(users.group_of("dave"), Some(30));
    }

    #[test]
    fn roles_decide_what_a_principal_may_read_and_cancel() {
        let alice = Principal::of(&record("alice", Role::User, "t"));
        assert!(alice.member_of("team-a") && !alice.member_of("team-b"));
        assert!(alice.may_read("alice", "team-b", false));
        assert!(!alice.may_read("bob", "team-a", false));
        assert!(alice.may_read("bob", "team-a", true), "a shared queue");
        assert!(!alice.may_read("bob", "team-b", true), "not a member");
        assert!(!alice.may_cancel("bob"));
        let operator = Principal::of(&record("op", Role::Operator, "t"));
        assert!(operator.may_read("bob", "team-b", false));
        assert!(!operator.may_cancel("bob"));
        assert!(Principal::admin().may_cancel("bob"));
    }
}

// ------------------------------------------------------------- endpoints

use crate::core::{Shared, now};
use crate::error::{ApiError, Body, Params, PathParams};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use muster_api::protocol::{
    AuditList, AuditView, ErrorBody, ErrorCode, UserCreate, UserLimits, UserList, UserToken,
    UserView, WhoAmI,
};

type Shared_ = State<std::sync::Arc<Shared>>;

/// Gives each task an agent is sent its user's group number (see
/// [`Users::group_of`]).
pub fn fill_groups(shared: &Shared, desired: &mut [muster_api::protocol::DesiredAllocation]) {
    let users = shared.users();
    for task in desired {
        task.user_group = task.user.as_deref().and_then(|user| users.group_of(user));
    }
}

fn view(record: &UserRecord) -> UserView {
    UserView {
        name: record.name.clone(),
        role: record.role.name().to_string(),
        queues: match record.role {
            Role::User => record.queues.clone(),
            Role::Operator | Role::Admin => Vec::new(),
        },
        created_ms: record.created_ms,
        max_pending: record.max_pending,
        task_group: record.task_group,
    }
}

fn new_token() -> Result<String, ApiError> {
    crate::auth::new_token().map_err(|error| ApiError::new(ErrorCode::Internal, error.to_string()))
}

async fn save(shared: &Shared, name: &str, record: Option<&UserRecord>) -> Result<(), ApiError> {
    shared
        .save_record(record, |batch, text| {
            batch.users.insert(name.to_string(), text);
        })
        .await
}

/// Make a user; its token is in the answer, this once.
#[utoipa::path(
    post, path = "/v1/users", tag = "users",
    request_body = UserCreate,
    responses(
        (status = 201, body = UserToken),
        (status = 400, body = ErrorBody),
        (status = 409, description = "a user of that name exists", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn create_user(
    State(shared): Shared_,
    Body(request): Body<UserCreate>,
) -> Result<(StatusCode, Json<UserToken>), ApiError> {
    let name = request.name.trim().to_string();
    if !muster_model::is_plain_name(&name) || name.len() > 63 {
        return Err(ApiError::invalid(format!(
            "a user name is 1 to 63 letters, digits, '-', '_' or '.', starting with a letter or \
             digit; got {name:?}"
        )));
    }
    if name == crate::api::DEFAULT_USER {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            "admin is the built-in admin (the admin token); pick another name",
        ));
    }
    let role = Role::parse(request.role.trim()).ok_or_else(|| {
        ApiError::invalid(format!(
            "role: expected user, operator or admin, got {:?}",
            request.role
        ))
    })?;
    let mut queues = Vec::new();
    for queue in &request.queues {
        let queue = queue.trim();
        if !muster_model::is_plain_name(queue) || queue.len() > 63 {
            return Err(ApiError::invalid(format!(
                "queues: {queue:?} is not a queue name"
            )));
        }
        if !queues.iter().any(|q| q == queue) {
            queues.push(queue.to_string());
        }
    }
    if queues.len() > 256 {
        return Err(ApiError::invalid("a user belongs to at most 256 queues"));
    }
    if queues.is_empty() {
        queues.push("default".to_string());
    }
    {
        let users = shared.users();
        if users.get(&name).is_some() {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "user {name} exists; `muster users rotate-token {name}` gives it a new token"
                ),
            ));
        }
        if users.len() >= MAX_USERS {
            return Err(ApiError::invalid(format!("at most {MAX_USERS} users")));
        }
    }
    let token = new_token()?;
    let mut record = UserRecord {
        name: name.clone(),
        role,
        queues,
        token_sha256: token_hash(&token),
        created_ms: now().0,
        max_pending: None,
        task_group: None,
    };
    // The number is taken and its mark queued under one lock, so two users
    // made at once never get the same one, nor is the mark stored lower.
    let durable = {
        let mut users = shared.users_mut();
        record.task_group = Some(users.take_group());
        let next = users.next_group();
        shared.queue_record(Some(&record), |batch, text| {
            batch.users.insert(name.clone(), text);
            batch.next_task_group = Some(u64::from(next));
        })?
    };
    durable.wait().await?;
    shared.users_mut().put(record.clone());
    tracing::info!(user = %name, role = role.name(), "user added");
    Ok((
        StatusCode::CREATED,
        Json(UserToken {
            user: view(&record),
            token,
        }),
    ))
}

/// Every user (never a token).
#[utoipa::path(
    get, path = "/v1/users", tag = "users",
    responses((status = 200, body = UserList)),
    security(("bearer" = []))
)]
pub async fn list_users(State(shared): Shared_) -> Json<UserList> {
    Json(UserList {
        users: shared.users().all().map(view).collect(),
    })
}

/// Remove a user: its token stops working at once (its jobs stay).
#[utoipa::path(
    delete, path = "/v1/users/{name}", tag = "users",
    params(("name" = String, Path, description = "the user", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, body = UserView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn remove_user(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<UserView>, ApiError> {
    let Some(record) = shared.users().get(&name).cloned() else {
        return Err(ApiError::not_found(format!(
            "no user {name}; `muster users list` lists them"
        )));
    };
    save(&shared, &name, None).await?;
    shared.users_mut().remove(&name);
    Ok(Json(view(&record)))
}

/// Set a user's own limits (the whole set: what is absent goes back to the
/// server's default).
#[utoipa::path(
    post, path = "/v1/users/{name}/limits", tag = "users",
    params(("name" = String, Path, description = "the user", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    request_body = UserLimits,
    responses((status = 200, body = UserView), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn set_limits(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
    Body(limits): Body<UserLimits>,
) -> Result<Json<UserView>, ApiError> {
    if limits.max_pending.is_some_and(|max| max > 100_000_000) {
        return Err(ApiError::invalid(
            "max_pending: at most 100000000 (leave it out for the server's default)",
        ));
    }
    let Some(mut record) = shared.users().get(&name).cloned() else {
        return Err(ApiError::not_found(format!(
            "no user {name}; `muster users list` lists them"
        )));
    };
    record.max_pending = limits.max_pending;
    save(&shared, &name, Some(&record)).await?;
    shared.users_mut().put(record.clone());
    tracing::info!(user = %name, max_pending = ?record.max_pending, "user limits set");
    Ok(Json(view(&record)))
}

/// A new token for a user; the old one stops working at once.
#[utoipa::path(
    post, path = "/v1/users/{name}/rotate-token", tag = "users",
    params(("name" = String, Path, description = "the user", pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")),
    responses((status = 200, body = UserToken), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn rotate_token(
    State(shared): Shared_,
    PathParams(name): PathParams<String>,
) -> Result<Json<UserToken>, ApiError> {
    let Some(mut record) = shared.users().get(&name).cloned() else {
        return Err(ApiError::not_found(format!(
            "no user {name}; `muster users list` lists them"
        )));
    };
    let token = new_token()?;
    record.token_sha256 = token_hash(&token);
    save(&shared, &name, Some(&record)).await?;
    shared.users_mut().put(record.clone());
    Ok(Json(UserToken {
        user: view(&record),
        token,
    }))
}

/// Who the token belongs to.
#[utoipa::path(
    get, path = "/v1/whoami", tag = "users",
    responses((status = 200, body = WhoAmI)),
    security(("bearer" = []))
)]
pub async fn whoami(
    axum::Extension(identity): axum::Extension<crate::api::Identity>,
) -> Result<Json<WhoAmI>, ApiError> {
    let principal = identity
        .principal()
        .ok_or_else(|| ApiError::new(ErrorCode::PermissionDenied, "not a user's token"))?;
    Ok(Json(WhoAmI {
        name: principal.name,
        role: principal.role.name().to_string(),
        queues: principal.queues,
    }))
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// How far back: a duration (`24h`, `30d`; default 24h).
    #[param(
        pattern = "^([0-9]{1,12}|([0-9]{1,12}d)?([0-9]{1,12}h)?([0-9]{1,12}m)?([0-9]{1,12}s)?)$"
    )]
    pub since: Option<String>,
    /// Only this user's requests (`admin`, a user, `node:NAME`).
    pub user: Option<String>,
    /// At most this many entries (1 to 10,000; 1,000 by default).
    #[param(minimum = 1, maximum = 10_000)]
    pub limit: Option<u32>,
}

/// The audit log: every mutating request (who, what, which object, from
/// where, allowed or refused), newest first.
#[utoipa::path(
    get, path = "/v1/audit", tag = "users",
    params(AuditQuery),
    responses((status = 200, body = AuditList), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn audit(
    State(shared): Shared_,
    Params(query): Params<AuditQuery>,
) -> Result<Json<AuditList>, ApiError> {
    let now_ms = now().0;
    let since = match query.since.as_deref().map(muster_api::parse_api_duration) {
        None | Some(Ok(None)) => now_ms.saturating_sub(86_400_000),
        Some(Ok(Some(back))) => {
            now_ms.saturating_sub(u64::try_from(back.as_millis()).unwrap_or(u64::MAX))
        }
        Some(Err(why)) => {
            return Err(ApiError::invalid(format!(
                "since: {why}, like 24h or 30d; got {:?}",
                query.since.as_deref().unwrap_or_default()
            )));
        }
    };
    let limit = query.limit.unwrap_or(1_000);
    if !(1..=10_000).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "limit must be from 1 to 10000, got {limit}"
        )));
    }
    let entries = shared
        .store
        .audit(since, query.user.as_deref(), limit)
        .await?
        .into_iter()
        .map(|entry| AuditView {
            at_ms: entry.at_ms,
            who: entry.who,
            action: entry.action,
            object: entry.object,
            origin: entry.origin,
            status: entry.status,
            allowed: entry.allowed,
        })
        .collect();
    Ok(Json(AuditList { entries }))
}
