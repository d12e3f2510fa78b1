-- PostgreSQL 002: every lineage edge carries its parent's name, and the (child, parent) primary key
-- carries it too (INCLUDE), so a walk from a model down to its traces reads each ancestor's name in the
-- same index-only probe that finds it. Before, the walk found 35k node ids and then looked each one up
-- in entity_names: half of the query's probes (model -> 35,373 ancestors on a 1M-event store, the old
-- walk vs lineage_down.sql round-robin: 389 ms vs 214 ms, benchmarks/bench_event_store.py).
-- The name is the parent's entity_names.name; check_integrity() verifies they agree.
ALTER TABLE lineage_links ADD COLUMN parent_name TEXT COLLATE "C";
UPDATE lineage_links l SET parent_name = n.name FROM entity_names n WHERE n.node = l.parent;
ALTER TABLE lineage_links ALTER COLUMN parent_name SET NOT NULL;
ALTER TABLE lineage_links DROP CONSTRAINT lineage_links_pkey;
ALTER TABLE lineage_links ADD PRIMARY KEY (child, parent) INCLUDE (parent_name);
CREATE OR REPLACE VIEW lineage_edges AS
    SELECT c.name AS child, l.parent_name AS parent, l.seq
    FROM lineage_links l JOIN entity_names c ON c.node = l.child;
