-- Schema version 6: the leader's lease. An SQLite store has one server, so
-- the table stays empty; it is here so both stores have the same tables.
CREATE TABLE IF NOT EXISTS leader (
    id INTEGER PRIMARY KEY,
    term INTEGER NOT NULL,
    holder TEXT NOT NULL,
    address TEXT NOT NULL,
    expires_ms INTEGER NOT NULL
);
