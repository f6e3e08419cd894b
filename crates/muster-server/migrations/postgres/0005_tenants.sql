-- Schema version 5: users (a token's hash, never the token), the audit
-- log of mutating requests, idempotency keys of submissions, and secrets
-- (sealed with the key in the data directory's secrets.key).
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    id BIGSERIAL PRIMARY KEY,
    at BIGINT NOT NULL,
    who TEXT NOT NULL,
    action TEXT NOT NULL,
    object TEXT NOT NULL,
    origin TEXT NOT NULL,
    status BIGINT NOT NULL,
    allowed BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_time ON audit (at);
-- The id orders the keys (SQLite's rowid does there): the latest row of a
-- key wins.
CREATE TABLE IF NOT EXISTS idempotency (
    id BIGSERIAL PRIMARY KEY,
    "user" TEXT NOT NULL,
    key TEXT NOT NULL,
    job BIGINT NOT NULL,
    at BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS secrets (
    name TEXT NOT NULL,
    queue TEXT NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (name, queue)
);
