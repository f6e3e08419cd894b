-- Schema version 3: GPU accounting. One row per task and wall-clock minute
-- (what it held, used and left idle; see muster_control::accounting),
-- kept for the server's --usage-retention; and the price list.
CREATE TABLE IF NOT EXISTS usage_minutes (
    allocation INTEGER NOT NULL,
    minute INTEGER NOT NULL,
    job INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    node TEXT NOT NULL,
    pool TEXT NOT NULL,
    gpu_model TEXT NOT NULL,
    queue TEXT NOT NULL,
    user TEXT NOT NULL,
    allocated_gpu_ms INTEGER NOT NULL,
    measured_gpu_ms INTEGER NOT NULL,
    used_gpu_ms INTEGER NOT NULL,
    idle_gpu_ms INTEGER NOT NULL,
    samples INTEGER NOT NULL,
    utilization_sum INTEGER NOT NULL,
    peak_utilization INTEGER NOT NULL,
    peak_memory_mib INTEGER NOT NULL,
    PRIMARY KEY (allocation, minute)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_by_minute ON usage_minutes (minute);
CREATE INDEX IF NOT EXISTS usage_by_job ON usage_minutes (job, minute);
CREATE TABLE IF NOT EXISTS prices (
    model TEXT PRIMARY KEY,
    per_gpu_hour REAL NOT NULL
);
