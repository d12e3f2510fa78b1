-- Everything that descends from an entity (its impact), on PostgreSQL; see lineage_down.sql.
-- Walks the (parent, child) index upwards.
WITH RECURSIVE walk(node, depth) AS (
    SELECT %(node)s::BIGINT, 0
    UNION
    SELECT l.child, w.depth + 1
    FROM walk w JOIN lineage_links l ON l.parent = w.node
    WHERE w.depth < %(depth)s
), best AS (
    SELECT node, min(depth) AS depth FROM walk GROUP BY node
)
SELECT n.name AS entity_id, b.depth
FROM best b JOIN entity_names n ON n.node = b.node
WHERE b.depth > 0
ORDER BY b.depth, n.name COLLATE "C"
