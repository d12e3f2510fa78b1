-- Everything an entity descends from (its causes), on PostgreSQL. %(node)s: the start entity's node id
-- (flywheel_node); %(depth)s: maximum depth. One row per ancestor with its shortest depth.
-- A recursive CTE over the (child, parent) primary key. PostgreSQL cannot keep one row per node inside
-- the recursion (no USING KEY, no aggregate in the recursive term), so UNION keeps one row per
-- (node, depth) and the outer query takes each node's shortest depth; a node reachable along paths of
-- different lengths is expanded once per length (lineage has few such diamonds per node).
WITH RECURSIVE walk(node, depth) AS (
    SELECT %(node)s::BIGINT, 0
    UNION
    SELECT l.parent, w.depth + 1
    FROM walk w JOIN lineage_links l ON l.child = w.node
    WHERE w.depth < %(depth)s
), best AS (
    SELECT node, min(depth) AS depth FROM walk GROUP BY node
)
SELECT n.name AS entity_id, b.depth
FROM best b JOIN entity_names n ON n.node = b.node
WHERE b.depth > 0
ORDER BY b.depth, n.name COLLATE "C"
