-- The edges of the causal subgraph below an entity (for trees and mermaid graphs).
-- $1: the start entity id; $2: maximum depth. The walk is lineage_down.sql's.
WITH RECURSIVE walk(node, depth) USING KEY (node) AS (
    SELECT (md5_number($1::VARCHAR) >> 64)::UBIGINT, 0
    UNION
    SELECT l.parent, min(w.depth) + 1
    FROM walk w JOIN lineage_links l ON l.child = w.node
    WHERE w.depth < $2 AND l.parent NOT IN (SELECT node FROM recurring.walk)
    GROUP BY l.parent
), links AS (
    SELECT l.child, l.parent FROM lineage_links l JOIN walk w ON l.child = w.node WHERE w.depth < $2
)
SELECT c.name AS child, p.name AS parent
FROM links l JOIN entity_names c ON c.node = l.child JOIN entity_names p ON p.node = l.parent
ORDER BY child, parent;
