-- Schema version 4: pools with a stack policy of their own.
CREATE TABLE IF NOT EXISTS pools (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
