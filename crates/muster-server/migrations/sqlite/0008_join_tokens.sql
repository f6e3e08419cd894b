-- Schema version 8: join tokens (JSON records: the token's SHA-256, its
-- expiry, uses, pool, whether revoked; never the token itself).
CREATE TABLE IF NOT EXISTS join_tokens (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
