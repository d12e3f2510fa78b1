-- Everything an entity descends from (its causes), e.g. model -> run -> rollouts -> env -> ... -> trace.
-- $1: the start entity id; $2: maximum depth. One row per ancestor with its shortest depth.
-- Breadth-first with one row per entity (USING KEY): an entity is expanded once, at the first (and so
-- shortest) depth it is reached. A plain UNION keeps one row per (entity, depth) and re-expands every
-- entity reachable along paths of different lengths (lineage is full of such diamonds: an eval reached
-- through its suite, its env and a synth batch). Measured on the 1M-event benchmark graph, which has
-- few of them: 103 ms vs 107 ms median.
WITH RECURSIVE walk(entity_id, depth) USING KEY (entity_id) AS (
    SELECT $1::VARCHAR, 0
    UNION
    SELECT e.parent, min(w.depth) + 1
    FROM walk w JOIN lineage_edges e ON e.child = w.entity_id
    WHERE w.depth < $2 AND e.parent NOT IN (SELECT entity_id FROM recurring.walk)
    GROUP BY e.parent
)
SELECT entity_id, depth
FROM walk
WHERE entity_id <> $1
ORDER BY depth, entity_id;
