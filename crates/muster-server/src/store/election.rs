//! The election of a leader among servers sharing one PostgreSQL store:
//! the `leader` row (term, holder, address, and when the lease ends, on
//! the database's clock), taken, renewed and given up. See crate::ha.

use super::{Backend, SqlStore, StoreError, database, string};
use sqlx::Row;
use std::time::Duration;

/// Who leads, as the store's `leader` row says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// The caller holds the lease, in this term.
    Leader { term: i64 },
    /// Another server does (its advertised URL and term), or nobody yet.
    Follower {
        leader: Option<(String, i64)>,
        /// How long the leader's lease runs on, by the database's clock
        /// (renewed every quarter lease, it seldom falls under three
        /// quarters).
        lease_left: Duration,
    },
}

impl SqlStore {
    /// The same store, every write of which carries `term`: a write after
    /// another server took the lease (a later term) fails with
    /// [`StoreError::Deposed`] and changes nothing.
    pub fn fenced(mut self, term: i64) -> SqlStore {
        self.term = Some(term);
        self
    }

    /// Takes or renews the leader's lease (PostgreSQL only): `id` names
    /// this server's process, `mine` is the term it leads in (`None`: not
    /// leading). The lease is taken when it has ended (on the database's
    /// clock), with the next term; renewed when `id` still holds `mine`.
    pub async fn lead(
        &self,
        id: &str,
        address: &str,
        mine: Option<i64>,
        lease: Duration,
    ) -> Result<Leadership, StoreError> {
        if self.backend != Backend::Postgres {
            return Err(StoreError::Database(
                "only a PostgreSQL store elects a leader; an SQLite file is one server's".into(),
            ));
        }
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let mut tx = self.pool.begin().await.map_err(database)?;
        sqlx::query(
            "INSERT INTO leader (id, term, holder, address, expires_ms) \
             VALUES (1, 0, '', '', 0) ON CONFLICT (id) DO NOTHING",
        )
        .execute(&mut *tx)
        .await
        .map_err(database)?;
        let row = sqlx::query(
            "SELECT term, holder, address, expires_ms, \
             CAST(extract(epoch FROM clock_timestamp()) * 1000 AS BIGINT) AS now_ms \
             FROM leader WHERE id = 1 FOR UPDATE",
        )
        .fetch_one(&mut *tx)
        .await
        .map_err(database)?;
        let term: i64 = row.try_get("term").map_err(database)?;
        let holder = string(&row, "holder")?;
        let current = string(&row, "address")?;
        let expires_ms: i64 = row.try_get("expires_ms").map_err(database)?;
        let now_ms: i64 = row.try_get("now_ms").map_err(database)?;
        let renewing = holder == id && mine == Some(term);
        let answer = if renewing || expires_ms <= now_ms {
            let next = if renewing { term } else { term + 1 };
            sqlx::query(
                "UPDATE leader SET term = $1, holder = $2, address = $3, expires_ms = $4 \
                 WHERE id = 1",
            )
            .bind(next)
            .bind(id)
            .bind(address)
            .bind(now_ms.saturating_add(lease_ms))
            .execute(&mut *tx)
            .await
            .map_err(database)?;
            Leadership::Leader { term: next }
        } else {
            Leadership::Follower {
                leader: (!holder.is_empty()).then_some((current, term)),
                lease_left: Duration::from_millis(
                    u64::try_from(expires_ms.saturating_sub(now_ms)).unwrap_or(0),
                ),
            }
        };
        tx.commit().await.map_err(database)?;
        Ok(answer)
    }

    /// The leader's advertised URL and term, as the store has them (`None`:
    /// no server has led yet, or the store is SQLite).
    pub async fn leader(&self) -> Result<Option<(String, i64)>, StoreError> {
        if self.backend != Backend::Postgres {
            return Ok(None);
        }
        let row = sqlx::query("SELECT address, term FROM leader WHERE id = 1 AND holder <> ''")
            .fetch_optional(&self.pool)
            .await
            .map_err(database)?;
        match row {
            Some(row) => Ok(Some((
                string(&row, "address")?,
                row.try_get("term").map_err(database)?,
            ))),
            None => Ok(None),
        }
    }

    /// Gives the lease up at once (a leader stopping cleanly), so a
    /// follower need not wait for it to end.
    pub async fn resign(&self, id: &str, term: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE leader SET expires_ms = 0 WHERE id = 1 AND holder = $1 AND term = $2")
            .bind(id)
            .bind(term)
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(database)
    }
}
