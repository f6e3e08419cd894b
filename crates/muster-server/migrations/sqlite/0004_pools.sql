-- Schema version 4: pools with a stack policy of their own (JSON records:
-- the policy and the versions it requires).
CREATE TABLE IF NOT EXISTS pools (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
