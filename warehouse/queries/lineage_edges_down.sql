-- The edges of the causal subgraph below an entity (for trees and mermaid graphs).
-- $1: the start entity id; $2: maximum depth.
WITH RECURSIVE walk(entity_id, depth) AS (
    SELECT $1::VARCHAR, 0
    UNION
    SELECT e.parent, w.depth + 1
    FROM walk w JOIN lineage_edges e ON e.child = w.entity_id
    WHERE w.depth < $2
),
nodes AS (SELECT DISTINCT entity_id FROM walk)
SELECT e.child, e.parent
FROM lineage_edges e JOIN nodes n ON e.child = n.entity_id
ORDER BY e.child, e.parent;
