-- The edges of the causal subgraph below an entity, on PostgreSQL: every edge out of a node that the
-- walk of lineage_down.sql reaches at a depth below %(depth)s (the start included). %(name)s: the
-- start entity's id, %(node)s its node id. Names come from the walk and from the edges (migration 002).
WITH RECURSIVE walk(frontier, names, seen, depth) AS (
    SELECT ARRAY[%(node)s::BIGINT], ARRAY[%(name)s::TEXT] COLLATE "C", ARRAY[%(node)s::BIGINT], 0
    UNION ALL
    SELECT x.nxt, x.nms, w.seen || x.nxt, w.depth + 1
    FROM walk w CROSS JOIN LATERAL (
        SELECT coalesce(array_agg(q.p), '{}') AS nxt, coalesce(array_agg(q.nm), '{}') AS nms FROM (
            SELECT DISTINCT l.parent_name AS nm, l.parent AS p
            FROM lineage_links l
            WHERE l.child = ANY(w.frontier) AND l.parent NOT IN (SELECT unnest(w.seen))
        ) q
    ) x
    WHERE w.depth < %(depth)s AND cardinality(w.frontier) > 0
), nodes AS MATERIALIZED (
    SELECT u.node, u.name FROM walk w CROSS JOIN LATERAL unnest(w.frontier, w.names) AS u(node, name)
    WHERE w.depth < %(depth)s
)
SELECT n.name AS child, l.parent_name AS parent
FROM lineage_links l JOIN nodes n ON n.node = l.child
WHERE l.child = ANY(ARRAY(SELECT node FROM nodes))
ORDER BY 1, 2
