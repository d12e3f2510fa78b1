-- The edges of the causal subgraph below an entity, on PostgreSQL: every edge out of a node that the
-- walk of lineage_down.sql reaches at a depth below %(depth)s (the start included).
WITH RECURSIVE walk(frontier, seen, depth) AS (
    SELECT ARRAY[%(node)s::BIGINT], ARRAY[%(node)s::BIGINT], 0
    UNION ALL
    SELECT x.nxt, w.seen || x.nxt, w.depth + 1
    FROM walk w CROSS JOIN LATERAL (
        SELECT coalesce(array_agg(p), '{}') AS nxt FROM (
            SELECT l.parent AS p FROM lineage_links l WHERE l.child = ANY(w.frontier)
            EXCEPT SELECT unnest(w.seen)
        ) q
    ) x
    WHERE w.depth < %(depth)s AND cardinality(w.frontier) > 0
), links AS MATERIALIZED (
    SELECT l.child, l.parent FROM lineage_links l
    WHERE l.child = ANY(ARRAY(SELECT unnest(frontier) FROM walk WHERE depth < %(depth)s))
), named AS (
    SELECT n.node, n.name FROM entity_names n
    WHERE n.node = ANY(ARRAY(SELECT child FROM links UNION SELECT parent FROM links))
)
SELECT c.name AS child, p.name AS parent
FROM links l JOIN named c ON c.node = l.child JOIN named p ON p.node = l.parent
ORDER BY c.name COLLATE "C", p.name COLLATE "C"
