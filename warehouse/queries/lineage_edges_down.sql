-- The edges of the causal subgraph below an entity (for trees and mermaid graphs).
-- $1: the start entity id; $2: maximum depth. The walk is lineage_down.sql's.
WITH RECURSIVE walk(entity_id, depth) USING KEY (entity_id) AS (
    SELECT $1::VARCHAR, 0
    UNION
    SELECT e.parent, min(w.depth) + 1
    FROM walk w JOIN lineage_edges e ON e.child = w.entity_id
    WHERE w.depth < $2 AND e.parent NOT IN (SELECT entity_id FROM recurring.walk)
    GROUP BY e.parent
)
SELECT e.child, e.parent
FROM lineage_edges e JOIN walk n ON e.child = n.entity_id
WHERE n.depth < $2
ORDER BY e.child, e.parent;
