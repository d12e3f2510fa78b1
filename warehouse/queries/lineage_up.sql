-- Everything that descends from an entity (its impact), e.g. trace -> failure -> eval -> ... -> model.
-- $1: the start entity id; $2: maximum depth. One row per descendant with its shortest depth.
-- Breadth-first over node ids with one row per node (USING KEY), as in lineage_down.sql.
WITH RECURSIVE walk(node, depth) USING KEY (node) AS (
    SELECT (md5_number($1::VARCHAR) >> 64)::UBIGINT, 0
    UNION
    SELECT l.child, min(w.depth) + 1
    FROM walk w JOIN lineage_links l ON l.parent = w.node
    WHERE w.depth < $2 AND l.child NOT IN (SELECT node FROM recurring.walk)
    GROUP BY l.child
)
SELECT n.name AS entity_id, w.depth
FROM walk w JOIN entity_names n ON n.node = w.node
WHERE w.depth > 0
ORDER BY w.depth, n.name;
