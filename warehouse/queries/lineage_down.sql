-- Everything an entity descends from (its causes), e.g. model -> run -> rollouts -> env -> ... -> trace.
-- $1: the start entity id; $2: maximum depth. One row per ancestor with its shortest depth.
WITH RECURSIVE walk(entity_id, depth) AS (
    SELECT $1::VARCHAR, 0
    UNION
    SELECT e.parent, w.depth + 1
    FROM walk w JOIN lineage_edges e ON e.child = w.entity_id
    WHERE w.depth < $2
)
SELECT w.entity_id, min(w.depth) AS depth
FROM walk w
WHERE w.entity_id <> $1
GROUP BY w.entity_id
ORDER BY depth, w.entity_id;
