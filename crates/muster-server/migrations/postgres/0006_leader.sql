-- Schema version 6: the leader's lease (one row): several servers on one
-- database elect one leader, and every write of the leader carries its
-- term (see src/ha.rs). expires_ms is on the database's clock.
CREATE TABLE IF NOT EXISTS leader (
    id BIGINT PRIMARY KEY,
    term BIGINT NOT NULL,
    holder TEXT NOT NULL,
    address TEXT NOT NULL,
    expires_ms BIGINT NOT NULL
);
