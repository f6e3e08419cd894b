-- Schema version 3: GPU accounting (one row per task and wall-clock
-- minute) and the price list.
CREATE TABLE IF NOT EXISTS usage_minutes (
    allocation BIGINT NOT NULL,
    minute BIGINT NOT NULL,
    job BIGINT NOT NULL,
    rank BIGINT NOT NULL,
    node TEXT NOT NULL,
    pool TEXT NOT NULL,
    gpu_model TEXT NOT NULL,
    queue TEXT NOT NULL,
    "user" TEXT NOT NULL,
    allocated_gpu_ms BIGINT NOT NULL,
    measured_gpu_ms BIGINT NOT NULL,
    used_gpu_ms BIGINT NOT NULL,
    idle_gpu_ms BIGINT NOT NULL,
    samples BIGINT NOT NULL,
    utilization_sum BIGINT NOT NULL,
    peak_utilization BIGINT NOT NULL,
    peak_memory_mib BIGINT NOT NULL,
    PRIMARY KEY (allocation, minute)
);
CREATE INDEX IF NOT EXISTS usage_by_minute ON usage_minutes (minute);
CREATE INDEX IF NOT EXISTS usage_by_job ON usage_minutes (job, minute);
CREATE TABLE IF NOT EXISTS prices (
    model TEXT PRIMARY KEY,
    per_gpu_hour DOUBLE PRECISION NOT NULL
);
