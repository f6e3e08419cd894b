-- Schema version 2: columns to find jobs without reading their records,
-- and whether a job has left the server's memory (retired: finished and
-- past the retention; read from here on demand).
ALTER TABLE jobs ADD COLUMN state TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN user TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN queue TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN retired INTEGER NOT NULL DEFAULT 0;
UPDATE jobs SET
    state = coalesce(json_extract(record, '$.state'), ''),
    user = coalesce(json_extract(record, '$.user'), ''),
    queue = coalesce(json_extract(record, '$.spec.queue'), 'default');
CREATE INDEX IF NOT EXISTS jobs_retired ON jobs (retired, id);
CREATE INDEX IF NOT EXISTS jobs_by_user ON jobs (user, id);
CREATE INDEX IF NOT EXISTS jobs_by_queue ON jobs (queue, id);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, id);
