"""What a batch becomes on its way to PostgreSQL, built column-wise in Arrow: values in COPY's text
format (:func:`pg_text`, :func:`pg_array`), node ids as the server's signed BIGINT (:func:`signed`),
the catalog's schema versions, and the batch's names and lineage edges (:func:`names_of`,
:func:`edges_of`); used by :class:`~flywheel.store.postgres.PostgresEventStore`."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flywheel.events import CATALOG


def names_of(batch: pa.Table, cols: pa.Table, with_rows: bool = False) -> pa.Table:
    """(node, name) of every entity and causation name of a batch, once, sorted by node; ``with_rows``
    adds ``row``, the first row of the batch that mentions the name (what the collision check needs
    when two of the batch's names share a node id)."""
    causation = batch.column("causation").combine_chunks()
    pnodes = cols.column("pnodes").combine_chunks()
    rows = pa.array(np.arange(batch.num_rows, dtype=np.int64))
    t = pa.concat_tables([
        pa.table({"node": cols.column("node"), "name": cols.column("entity"), "row": rows}),
        pa.table({"node": pc.list_flatten(pnodes), "name": pc.list_flatten(causation),
                  "row": pc.take(rows, pc.list_parent_indices(causation))}),
    ])
    t = t.filter(pc.is_valid(t.column("name")))
    if not with_rows:
        return t.group_by(["node", "name"]).aggregate([]).sort_by("node")
    t = t.group_by(["node", "name"]).aggregate([("row", "min")])
    return t.select(["node", "name", "row_min"]).rename_columns(["node", "name", "row"]).sort_by("node")


def edges_of(rows: pa.Table, cols: pa.Table, seq: pa.Array) -> pa.Table:
    """(child node, parent node, parent name, seq) for every causation name of the rows that is not the
    row's entity."""
    causation = rows.column("causation").combine_chunks()
    pnodes = cols.column("pnodes").combine_chunks()
    owner = pc.list_parent_indices(causation)
    names = pc.list_flatten(causation)
    t = pa.table({"child": pc.take(cols.column("node"), owner), "parent": pc.list_flatten(pnodes), "name": names,
                  "entity": pc.take(cols.column("entity"), owner), "seq": pc.take(seq, owner)})
    keep = pc.and_(pc.is_valid(t.column("name")), pc.not_equal(t.column("name"), t.column("entity")))
    return t.filter(keep).select(["child", "parent", "name", "seq"])


def schema_versions(types: pa.ChunkedArray | pa.Array) -> pa.Array:
    versions = pa.array(np.ones(len(types), dtype=np.int32))
    for t, spec in CATALOG.items():
        if spec.schema_version != 1:
            versions = pc.if_else(pc.equal(types, t), pa.scalar(spec.schema_version, pa.int32()), versions)
    return versions


def signed(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def pg_text(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Escape strings for COPY's text format (backslash, tab, newline, carriage return)."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if not len(arr) or not pc.any(pc.match_substring_regex(arr, r"[\\\t\n\r]")).as_py():
        return arr
    for a, b in (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r")):
        arr = pc.replace_substring(arr, a, b)
    return arr


def pg_array(lists: pa.Array | pa.ChunkedArray, quote: bool) -> pa.Array:
    """A list column as PostgreSQL array literals (``{"a","b"}`` / ``{1,2}``); null elements as NULL."""
    lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    lists = pc.fill_null(lists, pa.scalar([], lists.type))
    start, end = lists.offsets[0].as_py(), lists.offsets[-1].as_py()
    values = lists.values.slice(start, end - start)
    offsets = pc.subtract(lists.offsets, pa.scalar(start, lists.offsets.type))
    text = values.cast(pa.string())
    if quote:
        text = pc.replace_substring(pc.replace_substring(text, "\\", "\\\\"), '"', '\\"')
        text = pc.binary_join_element_wise('"', text, '"', "")
    text = pc.fill_null(text, "NULL")
    joined = pc.binary_join(pa.ListArray.from_arrays(offsets, text), ",")
    return pc.binary_join_element_wise("{", joined, "}", "")
