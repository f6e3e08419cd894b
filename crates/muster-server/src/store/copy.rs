//! Copying a whole store into an empty one (`--migrate-from`): every
//! table, streamed a few hundred rows at a time, in one transaction.

use super::{ROWS_PER_STATEMENT, SqlStore, StoreError, Value, database, insert_rows};
use sqlx::{AssertSqlSafe, Row};

/// A column's kind, for copying rows between stores.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Int,
    Text,
    Real,
}

/// Every table a store holds, with its columns (the ones written; an
/// `id` the database hands out is left to it) and the order to read them
/// in (insertion order where it matters: the audit log and idempotency
/// keys, whose latest row wins).
/// A table: its name, its columns and their kinds, and the order to read
/// it in (empty: the order rows were inserted in).
type Table = (&'static str, &'static [(&'static str, Kind)], &'static str);

const TABLES: [Table; 14] = {
    use Kind::{Int, Real, Text};
    [
        ("meta", &[("key", Text), ("value", Int)], "key"),
        (
            "jobs",
            &[
                ("id", Int),
                ("record", Text),
                ("state", Text),
                ("\"user\"", Text),
                ("queue", Text),
                ("retired", Int),
            ],
            "id",
        ),
        (
            "allocations",
            &[("id", Int), ("job", Int), ("record", Text)],
            "id",
        ),
        (
            "nodes",
            &[("name", Text), ("record", Text), ("token", Text)],
            "name",
        ),
        ("queues", &[("name", Text), ("record", Text)], "name"),
        (
            "usage_minutes",
            &[
                ("allocation", Int),
                ("minute", Int),
                ("job", Int),
                ("rank", Int),
                ("node", Text),
                ("pool", Text),
                ("gpu_model", Text),
                ("queue", Text),
                ("\"user\"", Text),
                ("allocated_gpu_ms", Int),
                ("measured_gpu_ms", Int),
                ("used_gpu_ms", Int),
                ("idle_gpu_ms", Int),
                ("samples", Int),
                ("utilization_sum", Int),
                ("peak_utilization", Int),
                ("peak_memory_mib", Int),
            ],
            "allocation, minute",
        ),
        (
            "prices",
            &[("model", Text), ("per_gpu_hour", Real)],
            "model",
        ),
        ("pools", &[("name", Text), ("record", Text)], "name"),
        ("users", &[("name", Text), ("record", Text)], "name"),
        ("services", &[("name", Text), ("record", Text)], "name"),
        ("join_tokens", &[("name", Text), ("record", Text)], "name"),
        (
            "audit",
            &[
                ("at", Int),
                ("who", Text),
                ("action", Text),
                ("object", Text),
                ("origin", Text),
                ("status", Int),
                ("allowed", Int),
            ],
            "id",
        ),
        (
            "idempotency",
            &[("\"user\"", Text), ("key", Text), ("job", Int), ("at", Int)],
            "", // insertion order, the backend's own
        ),
        (
            "secrets",
            &[("name", Text), ("queue", Text), ("record", Text)],
            "name, queue",
        ),
    ]
};

/// Rows copied per table by [`SqlStore::copy_from`].
pub type CopyCounts = Vec<(&'static str, u64)>;

impl SqlStore {
    /// Whether the store holds nothing yet (no counters, jobs or nodes).
    pub async fn is_empty(&self) -> Result<bool, StoreError> {
        for table in ["meta", "jobs", "nodes"] {
            let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT CAST(count(*) AS BIGINT) FROM {table}"
            )))
            .fetch_one(&self.pool)
            .await
            .map_err(database)?;
            if rows > 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Copies every row of `source` into this store, which must be empty,
    /// in one transaction: all of it lands or none. Rows are streamed, a
    /// few hundred at a time, so a large store needs little memory.
    pub async fn copy_from(&self, source: &SqlStore) -> Result<CopyCounts, StoreError> {
        use futures_util::TryStreamExt;
        if !self.is_empty().await? {
            return Err(StoreError::Database(format!(
                "{} already holds a cluster's state; copy into an empty database (and drop --migrate-from once a copy has been made)",
                self.location
            )));
        }
        let mut tx = self.pool.begin().await.map_err(database)?;
        let mut counts = Vec::new();
        for (table, columns, order) in TABLES {
            let names: Vec<&str> = columns.iter().map(|(name, _)| *name).collect();
            let order = if order.is_empty() {
                source.backend.insertion_order()
            } else {
                order
            };
            let select = format!("SELECT {} FROM {table} ORDER BY {order}", names.join(", "));
            let target = format!("{table} ({})", names.join(", "));
            let mut rows = sqlx::query(AssertSqlSafe(select)).fetch(&source.pool);
            let mut pending: Vec<Vec<Value>> = Vec::new();
            let mut copied = 0u64;
            loop {
                let row = rows.try_next().await.map_err(database)?;
                if let Some(row) = &row {
                    let mut values = Vec::with_capacity(columns.len());
                    for (index, (_, kind)) in columns.iter().enumerate() {
                        values.push(match kind {
                            Kind::Int => Value::Int(row.try_get(index).map_err(database)?),
                            Kind::Text => Value::Text(row.try_get(index).map_err(database)?),
                            Kind::Real => Value::Real(row.try_get(index).map_err(database)?),
                        });
                    }
                    pending.push(values);
                }
                if pending.len() >= ROWS_PER_STATEMENT || (row.is_none() && !pending.is_empty()) {
                    copied += pending.len() as u64;
                    insert_rows(&mut tx, &target, "", std::mem::take(&mut pending)).await?;
                }
                if row.is_none() {
                    break;
                }
            }
            counts.push((table, copied));
        }
        tx.commit().await.map_err(database)?;
        Ok(counts)
    }
}
