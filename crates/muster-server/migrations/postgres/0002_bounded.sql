-- Schema version 2: columns to find jobs without reading their records,
-- and whether a job has left the server's memory.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS state TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS "user" TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS queue TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS retired BIGINT NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS jobs_retired ON jobs (retired, id);
CREATE INDEX IF NOT EXISTS jobs_by_user ON jobs ("user", id);
CREATE INDEX IF NOT EXISTS jobs_by_queue ON jobs (queue, id);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, id);
