-- Everything an entity descends from (its causes), e.g. model -> run -> rollouts -> env -> ... -> trace.
-- $1: the start entity id; $2: maximum depth. One row per ancestor with its shortest depth.
-- Breadth-first over node ids (migration 003) with one row per node (USING KEY): a node is expanded
-- once, at the first (and so shortest) depth it is reached. A plain UNION keeps one row per (node,
-- depth) and re-expands every node reachable along paths of different lengths (lineage is full of
-- such diamonds: an eval reached through its suite, its env and a synth batch). Names are resolved
-- once, at the end.
WITH RECURSIVE walk(node, depth) USING KEY (node) AS (
    SELECT (md5_number($1::VARCHAR) >> 64)::UBIGINT, 0
    UNION
    SELECT l.parent, min(w.depth) + 1
    FROM walk w JOIN lineage_links l ON l.child = w.node
    WHERE w.depth < $2 AND l.parent NOT IN (SELECT node FROM recurring.walk)
    GROUP BY l.parent
)
SELECT n.name AS entity_id, w.depth
FROM walk w JOIN entity_names n ON n.node = w.node
WHERE w.depth > 0
ORDER BY w.depth, n.name;
