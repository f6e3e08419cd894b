-- Schema version 7: services (JSON records: the kept revisions of the
-- spec, the current one, whether it is deleted).
CREATE TABLE IF NOT EXISTS services (
    name TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
