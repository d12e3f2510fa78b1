-- The edges of the causal subgraph below an entity, on PostgreSQL (the walk of lineage_down.sql).
WITH RECURSIVE walk(node, depth) AS (
    SELECT %(node)s::BIGINT, 0
    UNION
    SELECT l.parent, w.depth + 1
    FROM walk w JOIN lineage_links l ON l.child = w.node
    WHERE w.depth < %(depth)s
), inner_nodes AS (
    SELECT DISTINCT node FROM walk WHERE depth < %(depth)s
)
SELECT c.name AS child, p.name AS parent
FROM lineage_links l JOIN inner_nodes w ON l.child = w.node
JOIN entity_names c ON c.node = l.child JOIN entity_names p ON p.node = l.parent
ORDER BY c.name COLLATE "C", p.name COLLATE "C"
