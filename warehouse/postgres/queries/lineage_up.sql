-- Everything that descends from an entity (its impact), on PostgreSQL. %(node)s: the start entity's node
-- id (flywheel_node); %(depth)s: maximum depth. One row per descendant with its shortest depth.
-- The breadth-first walk of lineage_down.sql, over the (parent, child) index.
WITH RECURSIVE walk(frontier, seen, depth) AS (
    SELECT ARRAY[%(node)s::BIGINT], ARRAY[%(node)s::BIGINT], 0
    UNION ALL
    SELECT x.nxt, w.seen || x.nxt, w.depth + 1
    FROM walk w CROSS JOIN LATERAL (
        SELECT coalesce(array_agg(p), '{}') AS nxt FROM (
            SELECT l.child AS p FROM lineage_links l WHERE l.parent = ANY(w.frontier)
            EXCEPT SELECT unnest(w.seen)
        ) q
    ) x
    WHERE w.depth < %(depth)s AND cardinality(w.frontier) > 0
), found AS MATERIALIZED (
    SELECT unnest(frontier) AS node, depth FROM walk WHERE depth > 0
), named AS (
    SELECT n.node, n.name FROM entity_names n WHERE n.node = ANY(ARRAY(SELECT node FROM found))
)
SELECT named.name AS entity_id, found.depth
FROM found JOIN named USING (node)
ORDER BY found.depth, named.name COLLATE "C"
