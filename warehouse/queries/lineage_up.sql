-- Everything that descends from an entity (its impact), e.g. trace -> failure -> eval -> ... -> model.
-- $1: the start entity id; $2: maximum depth. One row per descendant with its shortest depth.
-- Breadth-first with one row per entity (USING KEY), as in lineage_down.sql.
WITH RECURSIVE walk(entity_id, depth) USING KEY (entity_id) AS (
    SELECT $1::VARCHAR, 0
    UNION
    SELECT e.child, min(w.depth) + 1
    FROM walk w JOIN lineage_edges e ON e.parent = w.entity_id
    WHERE w.depth < $2 AND e.child NOT IN (SELECT entity_id FROM recurring.walk)
    GROUP BY e.child
)
SELECT entity_id, depth
FROM walk
WHERE entity_id <> $1
ORDER BY depth, entity_id;
