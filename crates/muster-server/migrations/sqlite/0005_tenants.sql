-- Schema version 5: users (a token's hash, never the token), the audit
-- log of mutating requests, and idempotency keys of submissions.
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
-- One row per request: the rowid orders them (no AUTOINCREMENT, whose
-- bookkeeping costs each insert), one index by time for --since and the
-- pruning; --user filters within the time range.
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY,
    at INTEGER NOT NULL,
    who TEXT NOT NULL,
    action TEXT NOT NULL,
    object TEXT NOT NULL,
    origin TEXT NOT NULL,
    status INTEGER NOT NULL,
    allowed INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_time ON audit (at);
-- Appended to, never looked up: the server keeps the keys of the last day
-- in memory and reads them all at start (the latest row of a key wins).
CREATE TABLE IF NOT EXISTS idempotency (
    user TEXT NOT NULL,
    key TEXT NOT NULL,
    job INTEGER NOT NULL,
    at INTEGER NOT NULL
);
-- Pruned hourly by a scan: at most a day of keys.
-- Secrets, encrypted (ChaCha20-Poly1305 with the key in secrets.key beside
-- the store): one per name and queue ('' for every queue).
CREATE TABLE IF NOT EXISTS secrets (
    name TEXT NOT NULL,
    queue TEXT NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (name, queue)
) WITHOUT ROWID;
