//! The store's conformance suite: every test runs against every backend,
//! SQLite in a temporary directory and PostgreSQL in a database of its own.
//!
//! PostgreSQL is the real server (`muster_testkit::postgres`:
//! `MUSTER_TEST_POSTGRES`, which `.ci/run` sets, or a private server the
//! test process starts); without one the tests run on SQLite alone and say
//! so loudly, unless `MUSTER_REQUIRE_TOOLS` is set (as in CI).

use super::*;
use crate::records::{AllocationRecord, JobRecord, PoolRecord, QueueRecord};

/// The backends a test runs on.
struct TestStores {
    postgres: Option<muster_testkit::postgres::TestPostgres>,
}

impl TestStores {
    async fn new() -> TestStores {
        TestStores {
            postgres: muster_testkit::postgres::TestPostgres::get(),
        }
    }

    /// A fresh, empty store on each backend.
    async fn targets(&self) -> Vec<Target<'_>> {
        let mut targets = vec![Target::sqlite()];
        if let Some(postgres) = &self.postgres {
            let (url, name) = postgres.create_database("muster_test");
            targets.push(Target {
                location: StoreLocation::Postgres(url),
                _dir: None,
                database: Some((postgres, name)),
            });
        }
        targets
    }

    /// A fresh, empty PostgreSQL store (`None`: no PostgreSQL here).
    async fn postgres(&self) -> Option<Target<'_>> {
        self.targets()
            .await
            .into_iter()
            .find(|target| target.location.backend() == Backend::Postgres)
    }
}

/// One fresh store: a temporary directory, or a database of its own.
struct Target<'a> {
    location: StoreLocation,
    _dir: Option<tempfile::TempDir>,
    /// The server and the database's name, to drop it after.
    database: Option<(&'a muster_testkit::postgres::TestPostgres, String)>,
}

impl Target<'_> {
    fn sqlite() -> Target<'static> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        Target {
            location: StoreLocation::in_data_dir(dir.path()),
            _dir: Some(dir),
            database: None,
        }
    }

    fn name(&self) -> &'static str {
        self.location.backend().name()
    }

    async fn open(&self) -> SqlStore {
        SqlStore::open_at(&self.location, StoreOptions::default())
            .await
            .unwrap_or_else(|error| panic!("{}: {error}", self.name()))
    }

    /// Closes the store and drops its database.
    async fn done(self, store: SqlStore) {
        store.close().await;
        if let Some((postgres, name)) = &self.database {
            postgres.drop_database(name);
        }
    }
}

fn job_row(id: u64, state: &str, user: &str, queue: &str) -> JobRow {
    let record = JobRecord {
        id,
        spec: muster_api::JobSpec {
            name: format!("job-{id}"),
            queue: Some(queue.to_string()),
            ..muster_api::JobSpec::default()
        },
        user: user.to_string(),
        submitted_ms: 1_000 + id,
        state: state.to_string(),
        stop_cause: None,
        attempts: 1,
        exit_code: (state == "succeeded").then_some(0),
        first_failure: None,
        started_ms: Some(2_000 + id),
        finished_ms: None,
        allocations: vec![id * 10],
        history: vec![(1_000 + id, "pending".to_string())],
        pending_reason: None,
        queue_position: None,
        array: None,
    };
    JobRow {
        record: serde_json::to_string(&record).expect("JSON"),
        state: state.to_string(),
        user: user.to_string(),
        queue: queue.to_string(),
    }
}

fn allocation(id: u64, job: u64, node: &str) -> (u64, String) {
    let record = AllocationRecord {
        id,
        job,
        rank: 0,
        node: node.to_string(),
        gpus: vec![(0, 1000), (1, 500)],
        cpu_milli: 4_000,
        memory_mib: 8_192,
        generation: 3,
        state: "running".to_string(),
        exit_code: None,
        env: BTreeMap::from([("MUSTER_JOB_ID".to_string(), job.to_string())]),
        assigned_ms: 5_000,
    };
    (job, serde_json::to_string(&record).expect("JSON"))
}

fn node(name: &str) -> String {
    serde_json::to_string(&serde_json::json!({
        "name": name, "pool": "default", "rack": "r1",
        "gpus": [{"index": 0, "uuid": "GPU-1", "model": "H100", "memory_mib": 81920, "nvlink_domain": 0}],
        "cpu_milli": 64000, "memory_mib": 262144, "address": "10.0.0.1:7071", "epoch": 2,
        "state": "ready", "cordoned": false, "draining": false, "last_heartbeat_ms": 9000,
        "backend": "simulated", "driver": "550.54", "cuda": "12.4"
    }))
    .expect("JSON")
}

fn queue(name: &str, weight: u32) -> String {
    serde_json::to_string(&QueueRecord {
        name: name.to_string(),
        guaranteed_milli: 8000,
        borrow_limit_milli: None,
        weight,
        idle_timeout_s: Some(1800),
        idle_after_s: Some(600),
        idle_below_pct: Some(10),
        budget_monthly_cents: Some(500_000),
        budget_hard: true,
        members_see_jobs: true,
        max_pending: Some(500),
        max_priority_class: Some(("high".to_string(), 200)),
        allow_non_preemptible: false,
    })
    .expect("JSON")
}

fn audit_entry(at_ms: u64, who: &str, status: u16) -> AuditEntry {
    AuditEntry {
        at_ms,
        who: who.to_string(),
        action: "POST /v1/jobs".to_string(),
        object: "/v1/jobs".to_string(),
        origin: "127.0.0.1:5000".to_string(),
        status,
        allowed: status != 403,
    }
}

/// A batch touching every table.
fn everything() -> Batch {
    let mut batch = Batch::default();
    for id in 1..=4 {
        batch
            .jobs
            .insert(id, job_row(id, "running", "alice", "team-a"));
        batch
            .allocations
            .insert(id * 10, allocation(id * 10, id, "gpu-1"));
    }
    batch
        .nodes
        .insert("gpu-1".into(), (node("gpu-1"), "token-1".into()));
    batch
        .nodes
        .insert("gpu-2".into(), (node("gpu-2"), "token-2".into()));
    batch.queues.insert("team-a".into(), queue("team-a", 2));
    batch.counters = Some(Counters {
        next_job: 5,
        next_allocation: 41,
        next_generation: 4,
        next_epoch: 6,
    });
    batch.next_task_group = Some(9);
    batch.prices.insert("H100".into(), Some(2.5));
    batch.pools.insert(
        "inference".into(),
        Some(
            serde_json::to_string(&PoolRecord {
                name: "inference".into(),
                stack_policy: "majority".into(),
                required: BTreeMap::from([("driver".to_string(), "550.54".to_string())]),
                allowed_mounts: vec!["/datasets".to_string()],
                inference: true,
            })
            .expect("JSON"),
        ),
    );
    batch.users.insert(
        "alice".into(),
        Some(
            serde_json::to_string(&crate::users::UserRecord {
                name: "alice".into(),
                role: crate::users::Role::User,
                queues: vec!["team-a".into()],
                token_sha256: "ab".repeat(32),
                created_ms: 7,
                max_pending: Some(500),
                task_group: Some(8),
            })
            .expect("JSON"),
        ),
    );
    batch.join_tokens.insert(
        "jt-000000000001".into(),
        Some(
            serde_json::to_string(&crate::jointokens::JoinTokenRecord {
                id: "jt-000000000001".into(),
                hash: "cd".repeat(32),
                created_ms: 9,
                expires_ms: Some(3_600_009),
                max_uses: Some(10),
                uses: 3,
                pool: Some("train".into()),
                revoked: false,
                initial: false,
            })
            .expect("JSON"),
        ),
    );
    batch.secrets.insert(
        ("hf-token".into(), "team-a".into()),
        Some(
            serde_json::to_string(&crate::secrets::SecretRecord {
                name: "hf-token".into(),
                queue: "team-a".into(),
                sealed: "c2VhbGVk".into(),
                updated_ms: 8,
            })
            .expect("JSON"),
        ),
    );
    batch.audit.push(audit_entry(100, "alice", 201));
    batch.audit.push(audit_entry(200, "bob", 403));
    batch
        .idempotency
        .insert(("alice".into(), "key-1".into()), (1, 100));
    batch.usage.push(UsageMinute {
        minute_ms: 60_000,
        allocation: 10,
        job: 1,
        node: "gpu-1".into(),
        pool: "default".into(),
        gpu_model: "H100".into(),
        queue: "team-a".into(),
        user: "alice".into(),
        allocated_gpu_ms: 60_000,
        ..UsageMinute::default()
    });
    batch
}

#[tokio::test]
async fn every_record_round_trips_and_later_writes_win() {
    let stores = TestStores::new().await;
    for target in stores.targets().await {
        let backend = target.name();
        let store = target.open().await;
        assert!(store.is_empty().await.unwrap(), "{backend}");
        store.write(&everything()).await.unwrap();
        assert!(!store.is_empty().await.unwrap(), "{backend}");
        // Later: a job changes state, one retires, a node leaves, a queue
        // changes, a price, a pool, a user and a secret are removed, a key
        // is used again (the latest row wins).
        let mut later = Batch::default();
        later
            .jobs
            .insert(2, job_row(2, "succeeded", "alice", "team-a"));
        later.retired.insert(3);
        later.removed_nodes.insert("gpu-2".into());
        later.queues.insert("team-a".into(), queue("team-a", 5));
        later.prices.insert("H100".into(), None);
        later.prices.insert("L4".into(), Some(0.75));
        later.pools.insert("inference".into(), None);
        later.users.insert("alice".into(), None);
        later
            .secrets
            .insert(("hf-token".into(), "team-a".into()), None);
        later
            .idempotency
            .insert(("alice".into(), "key-1".into()), (4, 300));
        // A lower mark of group numbers, written late, lowers nothing.
        later.next_task_group = Some(3);
        store.write(&later).await.unwrap();
        store.close().await;

        let store = target.open().await;
        let loaded = store.load().await.unwrap();
        let ids: Vec<u64> = loaded.jobs.iter().map(|job| job.id).collect();
        assert_eq!(
            ids,
            vec![1, 2, 4],
            "{backend}: the retired job is not loaded"
        );
        assert_eq!(loaded.jobs[1].state, "succeeded", "{backend}");
        assert_eq!(loaded.jobs[0].spec.queue.as_deref(), Some("team-a"));
        let allocations: Vec<u64> = loaded.allocations.iter().map(|a| a.id).collect();
        assert_eq!(allocations, vec![10, 20, 40], "{backend}");
        assert_eq!(loaded.allocations[0].gpus, vec![(0, 1000), (1, 500)]);
        assert_eq!(loaded.nodes.len(), 1, "{backend}");
        assert_eq!(loaded.nodes[0].0.name, "gpu-1");
        assert_eq!(loaded.nodes[0].1, "token-1");
        assert_eq!(loaded.queues.len(), 1);
        assert_eq!(
            loaded.queues[0].weight, 5,
            "{backend}: the later record wins"
        );
        assert_eq!(loaded.queues[0].budget_monthly_cents, Some(500_000));
        assert!(loaded.pools.is_empty() && loaded.users.is_empty() && loaded.secrets.is_empty());
        assert_eq!(loaded.join_tokens.len(), 1, "{backend}");
        assert_eq!(loaded.join_tokens[0].uses, 3, "{backend}");
        assert_eq!(loaded.join_tokens[0].pool.as_deref(), Some("train"));
        assert_eq!(
            loaded.idempotency,
            vec![
                ("alice".to_string(), "key-1".to_string(), 1, 100),
                ("alice".to_string(), "key-1".to_string(), 4, 300)
            ],
            "{backend}: keys in the order written"
        );
        assert_eq!(
            loaded.counters,
            Counters {
                next_job: 5,
                next_allocation: 41,
                next_generation: 4,
                next_epoch: 6
            }
        );
        assert_eq!(loaded.next_task_group, 9, "{backend}: only ever up");
        assert_eq!(
            store.prices().await.unwrap(),
            BTreeMap::from([("L4".to_string(), 0.75)]),
            "{backend}"
        );
        let (job, allocations) = store.retired_job(3).await.unwrap().expect("job 3");
        assert_eq!((job.id, allocations.len()), (3, 1), "{backend}");
        assert!(store.retired_job(99).await.unwrap().is_none());
        target.done(store).await;
    }
}

#[tokio::test]
async fn retired_jobs_are_found_by_state_user_queue_and_page() {
    let stores = TestStores::new().await;
    for target in stores.targets().await {
        let backend = target.name();
        let store = target.open().await;
        let mut batch = Batch::default();
        for id in 1..=30u64 {
            let state = if id % 3 == 0 { "failed" } else { "succeeded" };
            let user = if id % 2 == 0 { "alice" } else { "bob" };
            let queue = if id <= 15 { "team-a" } else { "team-b" };
            batch.jobs.insert(id, job_row(id, state, user, queue));
            batch
                .allocations
                .insert(id * 10, allocation(id * 10, id, "gpu-1"));
            if id <= 28 {
                batch.retired.insert(id);
            }
        }
        store.write(&batch).await.unwrap();
        let ids =
            |jobs: Vec<StoredJob>| jobs.into_iter().map(|(job, _)| job.id).collect::<Vec<_>>();
        let all = JobFilter::default();
        assert_eq!(
            ids(store.retired_jobs(&all, None, None, 5).await.unwrap()),
            vec![28, 27, 26, 25, 24],
            "{backend}: newest first; 29 and 30 are not retired"
        );
        assert_eq!(
            ids(store.retired_jobs(&all, Some(24), None, 3).await.unwrap()),
            vec![23, 22, 21],
            "{backend}: the next page"
        );
        assert_eq!(
            ids(store.retired_jobs(&all, None, Some(26), 10).await.unwrap()),
            vec![28, 27],
            "{backend}: newer than"
        );
        let failed_alice_b = JobFilter {
            states: Some(vec!["failed".into()]),
            user: Some("alice".into()),
            queue: Some("team-b".into()),
        };
        assert_eq!(
            ids(store
                .retired_jobs(&failed_alice_b, None, None, 10)
                .await
                .unwrap()),
            vec![24, 18],
            "{backend}"
        );
        let either = JobFilter {
            states: Some(vec!["failed".into(), "succeeded".into()]),
            ..JobFilter::default()
        };
        assert_eq!(
            store
                .retired_jobs(&either, None, None, 100)
                .await
                .unwrap()
                .len(),
            28
        );
        let none = JobFilter {
            states: Some(Vec::new()),
            ..JobFilter::default()
        };
        assert!(
            store
                .retired_jobs(&none, None, None, 10)
                .await
                .unwrap()
                .is_empty()
        );
        let listed = store.retired_jobs(&all, None, None, 1).await.unwrap();
        assert_eq!(listed[0].1.len(), 1, "{backend}: with its allocations");
        assert_eq!(listed[0].1[0].id, 280);
        target.done(store).await;
    }
}

#[tokio::test]
async fn the_audit_log_reads_newest_first_by_user_and_is_pruned() {
    let stores = TestStores::new().await;
    for target in stores.targets().await {
        let backend = target.name();
        let store = target.open().await;
        let mut batch = Batch::default();
        for i in 0..10u64 {
            let who = if i % 2 == 0 { "alice" } else { "bob" };
            batch
                .audit
                .push(audit_entry(1_000 + i, who, if i == 3 { 403 } else { 201 }));
        }
        store.write(&batch).await.unwrap();
        let entries = store.audit(0, None, 3).await.unwrap();
        let times: Vec<u64> = entries.iter().map(|e| e.at_ms).collect();
        assert_eq!(times, vec![1_009, 1_008, 1_007], "{backend}");
        let bob = store.audit(1_002, Some("bob"), 100).await.unwrap();
        let times: Vec<u64> = bob.iter().map(|e| e.at_ms).collect();
        assert_eq!(times, vec![1_009, 1_007, 1_005, 1_003], "{backend}");
        let refused = bob.iter().find(|e| e.at_ms == 1_003).expect("entry");
        assert!(
            !refused.allowed && refused.status == 403,
            "{backend}: {refused:?}"
        );
        assert!(bob[0].allowed);
        assert_eq!(bob[0], audit_entry(1_009, "bob", 201));
        store
            .write(&Batch {
                prune_audit_before: Some(1_005),
                prune_idempotency_before: Some(1),
                ..Batch::default()
            })
            .await
            .unwrap();
        assert_eq!(
            store.audit(0, None, 100).await.unwrap().len(),
            5,
            "{backend}"
        );
        target.done(store).await;
    }
}

/// More rows than one statement takes (the store splits them).
#[tokio::test]
async fn a_large_batch_is_written_whole() {
    let stores = TestStores::new().await;
    for target in stores.targets().await {
        let backend = target.name();
        let store = target.open().await;
        let count = 2 * ROWS_PER_STATEMENT as u64 + 34;
        let mut batch = Batch::default();
        for id in 1..=count {
            batch
                .jobs
                .insert(id, job_row(id, "succeeded", "alice", "team-a"));
            batch
                .allocations
                .insert(id * 10, allocation(id * 10, id, "gpu-1"));
            batch.audit.push(audit_entry(id, "alice", 201));
            batch
                .idempotency
                .insert(("alice".into(), format!("key-{id}")), (id, id));
        }
        store.write(&batch).await.unwrap();
        let retire = Batch {
            retired: (1..=count - 10).collect(),
            ..Batch::default()
        };
        store.write(&retire).await.unwrap();
        let loaded = store.load().await.unwrap();
        assert_eq!(loaded.jobs.len(), 10, "{backend}");
        assert_eq!(loaded.allocations.len(), 10, "{backend}");
        assert_eq!(loaded.idempotency.len() as u64, count, "{backend}");
        assert_eq!(
            store.audit(0, None, u32::MAX).await.unwrap().len() as u64,
            count
        );
        let retired = store
            .retired_jobs(&JobFilter::default(), None, None, u32::MAX)
            .await
            .unwrap();
        assert_eq!(retired.len() as u64, count - 10, "{backend}");
        assert!(
            retired
                .iter()
                .all(|(_, allocations)| allocations.len() == 1)
        );
        target.done(store).await;
    }
}

/// `--migrate-from`: a store's whole content lands in another (SQLite into
/// PostgreSQL where there is one; SQLite into SQLite always), and a store
/// that already holds a cluster is not written over.
#[tokio::test]
async fn a_store_copies_into_an_empty_one_whole() {
    let stores = TestStores::new().await;
    let source_target = Target::sqlite();
    let source = source_target.open().await;
    source.write(&everything()).await.unwrap();
    let mut more = Batch::default();
    more.retired.insert(2);
    more.jobs.insert(2, job_row(2, "failed", "alice", "team-a"));
    source.write(&more).await.unwrap();
    usage_on(&source).await;
    let before = source.load().await.unwrap();
    for target in stores.targets().await {
        let backend = target.name();
        let store = target.open().await;
        let counts = store.copy_from(&source).await.unwrap();
        let rows = |table: &str| {
            counts
                .iter()
                .find(|(name, _)| *name == table)
                .map(|(_, rows)| *rows)
        };
        assert_eq!(rows("jobs"), Some(4), "{backend}: {counts:?}");
        // 90 minutes of job 7 and 60 of job 8, less the 60 pruned.
        assert_eq!(rows("usage_minutes"), Some(90), "{backend}: {counts:?}");
        let after = store.load().await.unwrap();
        assert_eq!(
            format!("{:?}", after.jobs),
            format!("{:?}", before.jobs),
            "{backend}"
        );
        assert_eq!(
            format!("{:?}", after.allocations),
            format!("{:?}", before.allocations)
        );
        assert_eq!(format!("{:?}", after.nodes), format!("{:?}", before.nodes));
        assert_eq!(
            format!("{:?}", after.queues),
            format!("{:?}", before.queues)
        );
        assert_eq!(format!("{:?}", after.pools), format!("{:?}", before.pools));
        assert_eq!(format!("{:?}", after.users), format!("{:?}", before.users));
        assert_eq!(
            format!("{:?}", after.join_tokens),
            format!("{:?}", before.join_tokens)
        );
        assert_eq!(before.join_tokens.len(), 1);
        assert_eq!(
            format!("{:?}", after.secrets),
            format!("{:?}", before.secrets)
        );
        assert_eq!(after.idempotency, before.idempotency);
        assert_eq!(after.counters, before.counters);
        assert_eq!(after.next_task_group, before.next_task_group);
        assert_eq!(before.next_task_group, 9);
        assert_eq!(
            store.prices().await.unwrap(),
            source.prices().await.unwrap()
        );
        assert_eq!(
            store.audit(0, None, 100).await.unwrap(),
            source.audit(0, None, 100).await.unwrap(),
            "{backend}"
        );
        assert_eq!(
            format!("{:?}", store.job_usage(7, 1_000).await.unwrap()),
            format!("{:?}", source.job_usage(7, 1_000).await.unwrap()),
            "{backend}"
        );
        let retired = store
            .retired_jobs(&JobFilter::default(), None, None, 10)
            .await
            .unwrap();
        assert_eq!(retired.len(), 1, "{backend}");
        assert_eq!(retired[0].0.state, "failed");
        // The target now holds a cluster: a second copy is refused, and
        // nothing in it changes.
        let error = store.copy_from(&source).await.unwrap_err().to_string();
        assert!(error.contains("already holds"), "{backend}: {error}");
        assert_eq!(store.load().await.unwrap().jobs.len(), 3);
        target.done(store).await;
    }
    source_target.done(source).await;
}

/// Servers starting together on one database migrate it once.
#[tokio::test]
async fn stores_opened_together_share_one_schema() {
    let stores = TestStores::new().await;
    for target in stores.targets().await {
        let backend = target.name();
        let opened = futures_util::future::join_all(
            (0..4).map(|_| SqlStore::open_at(&target.location, StoreOptions::default())),
        )
        .await;
        let opened: Vec<SqlStore> = opened
            .into_iter()
            .map(|store| store.unwrap_or_else(|error| panic!("{backend}: {error}")))
            .collect();
        opened[0].write(&everything()).await.unwrap();
        assert_eq!(opened[3].load().await.unwrap().jobs.len(), 4, "{backend}");
        for store in &opened[1..] {
            store.close().await;
        }
        let store = opened.into_iter().next().expect("a store");
        target.done(store).await;
    }
}

#[test]
fn a_store_is_named_by_a_path_or_a_url() {
    assert_eq!(
        StoreLocation::parse("sqlite:/var/lib/muster/muster.db"),
        Ok(StoreLocation::Sqlite("/var/lib/muster/muster.db".into()))
    );
    assert_eq!(
        StoreLocation::parse("sqlite:///tmp/m.db"),
        Ok(StoreLocation::Sqlite("/tmp/m.db".into()))
    );
    let url = "postgres://muster:s3cret@db.internal:5432/muster?sslmode=require";
    let location = StoreLocation::parse(url).unwrap();
    assert_eq!(location, StoreLocation::Postgres(url.into()));
    assert_eq!(
        location.describe(),
        "postgres://muster:***@db.internal:5432/muster?sslmode=require"
    );
    assert_eq!(
        StoreLocation::Postgres("postgresql://muster@db/m".into()).describe(),
        "postgresql://muster@db/m"
    );
    let error = StoreLocation::parse("mysql://x").unwrap_err();
    assert!(
        error.contains("sqlite:PATH") && error.contains("postgres://"),
        "{error}"
    );
    assert!(StoreLocation::parse("sqlite:").is_err());
}

/// A PostgreSQL server that is not there: a clear error, no panic.
#[tokio::test]
async fn an_unreachable_postgres_is_a_clear_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let location = StoreLocation::Postgres(format!("postgres://muster:pw@127.0.0.1:{port}/muster"));
    let error = SqlStore::open_at(&location, StoreOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("cannot open the store at postgres://muster:***@127.0.0.1"),
        "{error}"
    );
    assert!(
        error.contains("check that PostgreSQL is running"),
        "{error}"
    );
    assert!(
        !error.contains("pw@"),
        "the password stays out of messages: {error}"
    );
}

/// A hand-computed month: team-a held 2 H100s for 90 minutes (one hour
/// busy at 80%, half an hour idle), team-b one L4 for an hour without
/// telemetry; H100s cost 2.50 an hour, L4s have no price.
#[tokio::test]
async fn usage_minutes_sum_to_the_hand_computed_cost() {
    let stores = TestStores::new().await;
    for target in stores.targets().await {
        let store = target.open().await;
        usage_on(&store).await;
        target.done(store).await;
    }
}

async fn usage_on(store: &SqlStore) {
    let minute = muster_control::accounting::MINUTE_MS;
    let base = 1_000 * minute;
    let mut batch = Batch::default();
    for m in 0..90 {
        let idle = m >= 60;
        batch.usage.push(UsageMinute {
            minute_ms: base + m * minute,
            allocation: 1,
            job: 7,
            rank: 0,
            node: "gpu-1".into(),
            pool: "default".into(),
            gpu_model: "H100-80GB".into(),
            queue: "team-a".into(),
            user: "alice".into(),
            allocated_gpu_ms: 2 * minute,
            measured_gpu_ms: 2 * minute,
            used_gpu_ms: if idle { 0 } else { 2 * minute * 80 / 100 },
            idle_gpu_ms: if idle { 2 * minute } else { 0 },
            samples: 6,
            utilization_sum: if idle { 0 } else { 480 },
            peak_utilization: if idle { 0 } else { 80 },
            peak_memory_mib: 1_000,
        });
    }
    for m in 0..60 {
        batch.usage.push(UsageMinute {
            minute_ms: base + m * minute,
            allocation: 2,
            job: 8,
            node: "gpu-2".into(),
            pool: "inference".into(),
            gpu_model: "L4".into(),
            queue: "team-b".into(),
            user: "bob".into(),
            allocated_gpu_ms: minute,
            ..UsageMinute::default()
        });
    }
    // A minute written twice (a flush after a restart) adds up.
    let mut again = batch.usage[0].clone();
    again.allocated_gpu_ms = 0;
    again.measured_gpu_ms = 0;
    again.used_gpu_ms = 0;
    again.samples = 1;
    batch.usage.push(again);
    batch.prices.insert("H100-80GB".into(), Some(2.5));
    batch.prices.insert("A100".into(), Some(1.0));
    store.write(&batch).await.unwrap();
    let mut batch = Batch::default();
    batch.prices.insert("A100".into(), None);
    store.write(&batch).await.unwrap();
    let prices = store.prices().await.unwrap();
    assert_eq!(prices.get("H100-80GB"), Some(&2.5));
    assert!(!prices.contains_key("A100"), "a removed price is gone");
    let totals = store.usage_totals(CostBy::Queue, base).await.unwrap();
    let report = muster_control::accounting::cost_report(&totals, &prices);
    assert_eq!(report.len(), 2);
    let a = &report[0];
    assert_eq!(a.key, "team-a");
    assert!((a.allocated_gpu_hours - 3.0).abs() < 1e-9, "{a:?}");
    assert!((a.used_gpu_hours - 1.6).abs() < 1e-9, "{a:?}");
    assert!((a.idle_gpu_hours - 1.0).abs() < 1e-9, "{a:?}");
    assert!((a.cost - 7.5).abs() < 1e-9, "{a:?}");
    assert!((a.waste - 2.5).abs() < 1e-9, "{a:?}");
    let b = &report[1];
    assert_eq!(b.key, "team-b");
    assert_eq!(b.cost, 0.0);
    assert!((b.unpriced_gpu_hours - 1.0).abs() < 1e-9);
    assert!((b.unmeasured_gpu_hours - 1.0).abs() < 1e-9);
    // Grouped by job and by pool; and a window that starts later.
    let by_job = store.usage_totals(CostBy::Job, base).await.unwrap();
    assert!(by_job.iter().any(|t| t.key == "7"));
    let by_pool = store.usage_totals(CostBy::Pool, base).await.unwrap();
    assert!(by_pool.iter().any(|t| t.key == "inference"));
    let late = store
        .usage_totals(CostBy::Queue, base + 60 * minute)
        .await
        .unwrap();
    assert_eq!(late.len(), 1, "team-b's minutes all lie before");
    assert_eq!(late[0].idle_gpu_ms, 60 * minute);
    // A job's minutes read back, the duplicate folded in.
    let minutes = store.job_usage(7, 10_000).await.unwrap();
    assert_eq!(minutes.len(), 90);
    assert_eq!(minutes[0].samples, 7);
    assert_eq!(
        store.job_usage(7, 5).await.unwrap()[0].minute_ms,
        base + 85 * minute
    );
    // The cluster per minute: both jobs' first minute.
    let cluster = store.cluster_minutes(base).await.unwrap();
    assert_eq!(cluster.len(), 90);
    assert_eq!(cluster[0], (base, 3 * minute, 2 * minute * 80 / 100));
    // Pruning drops what lies before the retention.
    let batch = Batch {
        prune_usage_before: Some(base + 30 * minute),
        ..Batch::default()
    };
    store.write(&batch).await.unwrap();
    assert_eq!(store.job_usage(7, 10_000).await.unwrap().len(), 60);
}

/// The server on PostgreSQL, through its API: a cluster moved over from
/// SQLite with `migrate_from` keeps its jobs and its id counter, keeps what
/// it accepts across a restart, and a second copy onto it is refused.
#[tokio::test]
async fn a_server_moves_from_sqlite_to_postgres_and_keeps_its_jobs() {
    let stores = TestStores::new().await;
    let Some(target) = stores.postgres().await else {
        return; // said loudly above; CI requires PostgreSQL
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let config = |dir: &Path| {
        let mut config = crate::ServerConfig::new(dir.to_path_buf());
        config.listen = "127.0.0.1:0".parse().expect("an address");
        config
    };
    let submit = |server: &crate::ServerHandle, name: &str| {
        let request = http
            .post(format!("http://{}/v1/jobs", server.addr()))
            .bearer_auth(server.admin_token())
            .json(&serde_json::json!({"spec": {"name": name, "command": ["true"], "gpus": 1}}));
        async move {
            let response = request.send().await.expect("submitted");
            assert_eq!(response.status(), reqwest::StatusCode::CREATED);
            let body: serde_json::Value = response.json().await.expect("JSON");
            body["id"].as_u64().expect("an id")
        }
    };
    let names = |server: &crate::ServerHandle| {
        let request = http
            .get(format!("http://{}/v1/jobs", server.addr()))
            .bearer_auth(server.admin_token());
        async move {
            let body: serde_json::Value = request
                .send()
                .await
                .expect("listed")
                .json()
                .await
                .expect("JSON");
            let mut names: Vec<String> = body["jobs"]
                .as_array()
                .expect("jobs")
                .iter()
                .map(|job| job["name"].as_str().expect("a name").to_string())
                .collect();
            names.sort();
            names
        }
    };
    // A cluster on SQLite takes two jobs.
    let old_dir = tempfile::tempdir().expect("a directory");
    let old = crate::Server::start(config(old_dir.path()))
        .await
        .expect("starts on SQLite");
    assert_eq!(submit(&old, "first").await, 1);
    assert_eq!(submit(&old, "second").await, 2);
    old.shutdown().await;
    // Moved to PostgreSQL: both jobs, and the next id follows on.
    let new_dir = tempfile::tempdir().expect("a directory");
    let moved = crate::ServerConfig {
        store: Some(target.location.clone()),
        migrate_from: Some(StoreLocation::in_data_dir(old_dir.path())),
        ..config(new_dir.path())
    };
    let server = crate::Server::start(moved.clone())
        .await
        .expect("starts on PostgreSQL");
    assert!(server.store_location().starts_with("postgres://"));
    assert_eq!(names(&server).await, vec!["first", "second"]);
    assert_eq!(submit(&server, "third").await, 3);
    server.shutdown().await;
    // A restart on PostgreSQL alone finds all three.
    let again = crate::ServerConfig {
        migrate_from: None,
        ..moved.clone()
    };
    let server = crate::Server::start(again).await.expect("restarts");
    assert_eq!(names(&server).await, vec!["first", "second", "third"]);
    server.shutdown().await;
    // Copying again would write over a live cluster: refused, nothing lost.
    let error = match crate::Server::start(moved.clone()).await {
        Ok(_) => panic!("a second copy onto a live cluster must be refused"),
        Err(error) => format!("{error:#}"),
    };
    assert!(error.contains("already holds"), "{error:#}");
    let server = crate::Server::start(crate::ServerConfig {
        migrate_from: None,
        ..moved
    })
    .await
    .expect("restarts");
    assert_eq!(names(&server).await.len(), 3);
    let store = server.store.clone();
    server.shutdown().await;
    target.done(store).await;
}

/// The election and its fencing, on two handles of one PostgreSQL
/// database (two servers): one leads at a time, a lease that is not renewed
/// passes to the other with the next term, and the deposed leader's writes
/// are refused whole, even one that was under way.
#[tokio::test]
async fn one_server_leads_and_a_deposed_leaders_writes_are_refused() {
    let stores = TestStores::new().await;
    let Some(target) = stores.postgres().await else {
        return; // said loudly above; CI requires PostgreSQL
    };
    let lease = Duration::from_millis(600);
    let a = target.open().await;
    let b = target.open().await;
    assert_eq!(
        a.lead("a", "https://a:7070", None, lease).await.unwrap(),
        Leadership::Leader { term: 1 }
    );
    match b.lead("b", "https://b:7070", None, lease).await.unwrap() {
        Leadership::Follower { leader, lease_left } => {
            assert_eq!(leader, Some(("https://a:7070".to_string(), 1)));
            assert!(lease_left <= lease, "{lease_left:?}");
        }
        other => panic!("{other:?}"),
    }
    // Renewed in time, the lease stays with a, in the same term.
    tokio::time::sleep(lease / 2).await;
    assert_eq!(
        a.lead("a", "https://a:7070", Some(1), lease).await.unwrap(),
        Leadership::Leader { term: 1 }
    );
    tokio::time::sleep(lease / 2).await;
    assert!(matches!(
        b.lead("b", "https://b:7070", None, lease).await.unwrap(),
        Leadership::Follower { .. }
    ));
    let a = a.fenced(1);
    let mut batch = Batch::default();
    batch
        .jobs
        .insert(1, job_row(1, "pending", "alice", "team-a"));
    a.write(&batch).await.expect("the leader writes");
    // a stops renewing (paused, partitioned): b takes term 2 once the
    // lease has ended, and a's next write changes nothing.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    assert_eq!(
        b.lead("b", "https://b:7070", None, lease).await.unwrap(),
        Leadership::Leader { term: 2 }
    );
    let b = b.fenced(2);
    let mut late = Batch::default();
    late.jobs
        .insert(1, job_row(1, "succeeded", "alice", "team-a"));
    late.jobs
        .insert(2, job_row(2, "pending", "alice", "team-a"));
    let error = a.write(&late).await.unwrap_err();
    assert!(
        matches!(
            error,
            StoreError::Deposed {
                mine: 1,
                current: 2
            }
        ),
        "{error}"
    );
    assert!(
        error.to_string().contains("no longer the leader"),
        "{error}"
    );
    let loaded = b.load().await.unwrap();
    assert_eq!(loaded.jobs.len(), 1, "the deposed write left nothing");
    assert_eq!(loaded.jobs[0].state, "pending");
    // a, waking up, learns who leads; it cannot renew its old term.
    assert!(matches!(
        a.lead("a", "https://a:7070", Some(1), lease).await.unwrap(),
        Leadership::Follower {
            leader: Some((url, 2)),
            ..
        } if url == "https://b:7070"
    ));
    b.write(&late).await.expect("the new leader writes");
    // A leader that stops cleanly hands over at once.
    b.resign("b", 2).await.unwrap();
    assert_eq!(
        a.lead("a", "https://a:7070", None, lease).await.unwrap(),
        Leadership::Leader { term: 3 }
    );
    // A write under way when a takeover comes: the takeover waits for its
    // commit, so it lands whole in the old term, and the next is refused.
    let c = target.open().await.fenced(3);
    let mut big = Batch::default();
    for id in 10..1_010 {
        big.jobs.insert(id, job_row(id, "pending", "bob", "team-b"));
    }
    let (written, taken) = tokio::join!(c.write(&big), async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        // Ends the lease (as time would) and takes the next term.
        sqlx::query("UPDATE leader SET expires_ms = 0 WHERE id = 1")
            .execute(&b.pool)
            .await
            .unwrap();
        b.lead("b", "https://b:7070", None, lease).await
    });
    assert_eq!(taken.unwrap(), Leadership::Leader { term: 4 });
    let jobs = b.load().await.unwrap().jobs.len();
    match written {
        Ok(()) => assert_eq!(jobs, 1_002, "the write landed whole"),
        Err(StoreError::Deposed { .. }) => assert_eq!(jobs, 2, "the write left nothing"),
        Err(error) => panic!("{error}"),
    }
    assert!(matches!(
        c.write(&big).await,
        Err(StoreError::Deposed {
            mine: 3,
            current: 4
        })
    ));
    a.close().await;
    c.close().await;
    target.done(b).await;
}

/// A leader stopped (SIGSTOP) inside a transaction holds the `leader`
/// row's share lock, which a takeover waits for: PostgreSQL ends that
/// session once it has idled past the limit, the takeover goes through,
/// and the stopped leader's transaction commits nothing.
#[tokio::test]
async fn a_leader_stopped_inside_a_transaction_holds_a_takeover_back_only_briefly() {
    let stores = TestStores::new().await;
    let Some(target) = stores.postgres().await else {
        return; // said loudly above; CI requires PostgreSQL
    };
    let lease = Duration::from_millis(600);
    let limit = Duration::from_millis(700);
    let options = StoreOptions {
        idle_transaction_limit: Some(limit),
        ..StoreOptions::default()
    };
    let a = SqlStore::open_at(&target.location, options).await.unwrap();
    let b = target.open().await;
    assert_eq!(
        a.lead("a", "https://a:7070", None, lease).await.unwrap(),
        Leadership::Leader { term: 1 }
    );
    // a's writer is stopped between two statements of a transaction.
    let mut stuck = a.pool.begin().await.unwrap();
    sqlx::query("SELECT term FROM leader WHERE id = 1 FOR SHARE")
        .execute(&mut *stuck)
        .await
        .unwrap();
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let asked = std::time::Instant::now();
    let taken = tokio::time::timeout(
        Duration::from_secs(20),
        b.lead("b", "https://b:7070", None, lease),
    )
    .await
    .expect("the takeover is not held back for long")
    .unwrap();
    assert_eq!(taken, Leadership::Leader { term: 2 });
    eprintln!("the takeover waited {:?}", asked.elapsed());
    // a wakes: its session is gone, and nothing of it commits.
    let woke = sqlx::query("INSERT INTO meta (key, value) VALUES ('stuck', 1)")
        .execute(&mut *stuck)
        .await;
    let committed = match woke {
        Ok(_) => stuck.commit().await,
        Err(error) => {
            // Returned to the pool, which closing waits for.
            drop(stuck);
            Err(error)
        }
    };
    assert!(committed.is_err(), "the ended session commits nothing");
    let row = sqlx::query("SELECT value FROM meta WHERE key = 'stuck'")
        .fetch_optional(&b.pool)
        .await
        .unwrap();
    assert!(row.is_none());
    a.close().await;
    target.done(b).await;
}

#[tokio::test]
async fn an_sqlite_store_has_no_election() {
    let target = Target::sqlite();
    let store = target.open().await;
    let error = store
        .lead("a", "https://a:7070", None, Duration::from_secs(4))
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("only a PostgreSQL store"),
        "{error}"
    );
    target.done(store).await;
}
