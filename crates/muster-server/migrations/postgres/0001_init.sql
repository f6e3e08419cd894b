-- muster's store on PostgreSQL, schema version 1 (the same tables as the
-- SQLite store's version 1; see ../sqlite). Every row holds one JSON
-- record; the columns beside it are for lookups.
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY NOT NULL,
    value BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id BIGINT PRIMARY KEY NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS allocations (
    id BIGINT PRIMARY KEY NOT NULL,
    job BIGINT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS allocations_by_job ON allocations (job);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY NOT NULL,
    record TEXT NOT NULL,
    token TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS queues (
    name TEXT PRIMARY KEY NOT NULL,
    record TEXT NOT NULL
);
