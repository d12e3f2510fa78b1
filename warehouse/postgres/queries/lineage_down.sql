-- Everything an entity descends from (its causes), on PostgreSQL. %(node)s: the start entity's node id
-- (flywheel_node); %(depth)s: maximum depth. One row per depth: the ancestors first reached at that
-- depth (their shortest depth) as an array of names sorted in byte order; the caller flattens it.
-- Breadth-first, one row per level: the frontier (nodes first reached at this depth), their names and
-- every node seen so far, as arrays; the next frontier is the parents of the frontier, each with its
-- name (one index-only scan of the (child, parent) INCLUDE (parent_name) primary key for the whole
-- level, migration 002), minus those seen. Each node is expanded once, at its shortest depth.
-- Measured on model -> 35,373 ancestors of a 1M-event store (same server, round-robin):
-- - a recursive UNION of (node, depth) rows re-expanded every node reachable along paths of different
--   lengths and probed the index once per row (2x slower than one row per level);
-- - the walk before migration 002 (node ids, names looked up at the end in entity_names, one row per
--   ancestor sorted on the server): 389 ms vs 214 ms for this one (benchmarks/bench_event_store.py);
-- - of that, one row per ancestor sorted by (depth, name) on the server instead of arrays sorted per
--   level: ~20 ms; per-level arrays sorted by array_agg(... ORDER BY) instead of the sorted subquery:
--   ~20 ms slower.
WITH RECURSIVE walk(frontier, names, seen, depth) AS (
    SELECT ARRAY[%(node)s::BIGINT], ARRAY[%(name)s::TEXT] COLLATE "C", ARRAY[%(node)s::BIGINT], 0
    UNION ALL
    SELECT x.nxt, x.nms, w.seen || x.nxt, w.depth + 1
    FROM walk w CROSS JOIN LATERAL (
        -- array_agg keeps its input's order: the level's parents sorted by name
        SELECT coalesce(array_agg(q.p), '{}') AS nxt, coalesce(array_agg(q.nm), '{}') AS nms FROM (
            SELECT DISTINCT l.parent_name AS nm, l.parent AS p
            FROM lineage_links l
            WHERE l.child = ANY(w.frontier) AND l.parent NOT IN (SELECT unnest(w.seen))
            ORDER BY 1, 2
        ) q
    ) x
    WHERE w.depth < %(depth)s AND cardinality(w.frontier) > 0
)
SELECT depth, names FROM walk WHERE depth > 0 AND cardinality(names) > 0 ORDER BY depth
