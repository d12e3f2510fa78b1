"""Records and messages of the sandbox harness (:mod:`_sandbox_harness`): one-line records, framed
messages on the proxy path's pipes, and the tagged-JSON codec of plain data.

Loaded in the sandbox as a top-level module next to the harness (``python -I -S``: standard library
only). The codec's tags are those of :func:`flywheel.io_grading.decode_value`; values are exact
built-in types only, so an object of the candidate's cannot pass for plain data.
"""

import os

# Every character str.splitlines() breaks at. A record is one "\n"-terminated line (the supervisor
# splits on "\n" only), and a message never holds any of these raw: escaping all of them keeps an
# honest failure message from looking like a second record to any line reader (issue 31, finding 10).
_LINE_BREAKS = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
                for c in (0x0a, 0x0b, 0x0c, 0x0d, 0x1c, 0x1d, 0x1e, 0x85, 0x2028, 0x2029)}
_LINE_BREAKS[0x0a], _LINE_BREAKS[0x0d], _LINE_BREAKS[ord("\\")] = "\\n", "\\r", "\\\\"


def _one_line(text, limit=300):
    return text.translate(_LINE_BREAKS)[:limit]


# ------------------------------------------------------------------- tagged JSON of plain data


def _encoder(on_other=None):
    """A serialiser of plain data to tagged JSON (see :func:`flywheel.io_grading.decode_value`) that
    needs no ``json`` import (its ``re`` dependency costs ~6 ms per run). ``on_other(v)`` returns the
    text for a value that is not plain data (the proxy path's handles); without it such a value is
    ``Unencodable``."""
    try:
        from _json import encode_basestring_ascii as esc
    except ImportError:  # an interpreter without the C accelerator: the slower pure-Python one
        from json.encoder import py_encode_basestring_ascii as esc

    limit, max_depth = 1 << 20, 64
    t_none, t_bool, t_int, t_float, t_str = type(None), bool, int, float, str
    t_bytes, t_complex, t_list, t_tuple, t_set, t_fs, t_dict = bytes, complex, list, tuple, set, frozenset, dict
    float_repr, int_repr, type_ = float.__repr__, int.__repr__, type

    class Unencodable(Exception):
        pass

    def enc(v, depth, out, size):
        t = type_(v)
        if depth > max_depth:
            raise Unencodable("nested more than 64 levels")
        if t is t_none:
            s = "null"
        elif t is t_bool:
            s = "true" if v else "false"
        elif t is t_int:
            # Decimal conversion of ints over 4300 digits raises (CVE-2020-10735 limit); hex does not.
            s = int_repr(v) if v.bit_length() <= 10000 else '{"x":"' + hex(v) + '"}'
        elif t is t_float:
            s = '{"f":"' + float_repr(v) + '"}'
        elif t is t_str:
            s = esc(v)
        elif t is t_bytes:
            s = '{"b":"' + v.hex() + '"}'
        elif t is t_complex:
            s = '{"c":[{"f":"' + float_repr(v.real) + '"},{"f":"' + float_repr(v.imag) + '"}]}'
        elif t is t_list or t is t_tuple or t is t_set or t is t_fs:
            head = "[" if t is t_list else ('{"t":[' if t is t_tuple else ('{"s":[' if t is t_set else '{"fs":['))
            out.append(head)
            size += len(head)
            first = True
            for x in v:
                if not first:
                    out.append(",")
                first = False
                size = enc(x, depth + 1, out, size + 1)
            out.append("]" if t is t_list else "]}")
            return size + 2
        elif t is t_dict:
            out.append('{"d":[')
            size += 6
            first = True
            for k, x in v.items():
                if not first:
                    out.append(",")
                first = False
                out.append("[")
                size = enc(k, depth + 1, out, size + 2)
                out.append(",")
                size = enc(x, depth + 1, out, size + 1)
                out.append("]")
            out.append("]}")
            return size + 3
        elif on_other is not None:
            s = on_other(v)
        else:
            raise Unencodable(f"a {t.__name__} is not plain data")
        if size + len(s) > limit:
            raise Unencodable("larger than 1 MiB serialised")
        out.append(s)
        return size + len(s)

    def encode(v):
        out = []
        enc(v, 0, out, 0)
        return "".join(out)

    return encode, Unencodable


# ------------------------------------------------------- framed messages (the proxy path's pipes)


def _send(fd, text):
    data = text.encode("utf-8", "surrogatepass")
    view = memoryview(b"%08x" % len(data) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd, limit):
    """One framed message (``%08x`` length + UTF-8 text), or None at end of file."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    try:
        n = int(head, 16)
    except ValueError:
        raise ValueError("malformed frame") from None
    if n > limit:
        raise ValueError(f"message larger than {limit} bytes")
    body = _read_exact(fd, n)
    if body is None:
        return None
    return body.decode("utf-8", "surrogatepass")


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _decoder(handle):
    """The inverse of :func:`_encoder` (tags of :func:`flywheel.io_grading.decode_value`), plus
    ``{"h": n}`` -> ``handle(n)``. Builds exact built-in types only; ValueError on anything else.
    Parses with the C scanner of ``_json`` directly: ``import json`` (its ``re``) cost 25-35 ms per
    process on the development machine, in each of the proxy path's two processes."""

    def no_float(s):
        raise ValueError(f"untagged float {s[:40]!r}")

    try:
        from _json import make_scanner

        class _Ctx:
            strict, object_hook, object_pairs_hook, parse_int = True, None, None, int
            parse_float = parse_constant = staticmethod(no_float)

        scan = make_scanner(_Ctx())

        def loads(text):
            try:
                obj, end = scan(text, 0)
            except StopIteration:
                raise ValueError("not JSON") from None
            if end != len(text):
                raise ValueError("trailing data after the value")
            return obj
    except ImportError:  # an interpreter without the C accelerator
        import json

        def loads(text):
            return json.loads(text, parse_float=no_float, parse_constant=no_float)

    def untag(v, depth):
        if depth > 66:
            raise ValueError("nested too deeply")
        if v is None or type(v) in (bool, int, str):
            return v
        if type(v) is list:
            return [untag(x, depth + 1) for x in v]
        if type(v) is not dict or len(v) != 1:
            raise ValueError("malformed value")
        (tag, body), = v.items()
        if tag == "h" and type(body) is int:
            return handle(body)
        if tag == "f" and type(body) is str:
            return float(body)
        if tag == "x" and type(body) is str:
            return int(body, 16)
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2:
            a, b = (untag(x, depth + 1) for x in body)
            return complex(a, b)
        if tag in ("t", "s", "fs") and type(body) is list:
            items = [untag(x, depth + 1) for x in body]
            return tuple(items) if tag == "t" else (set(items) if tag == "s" else frozenset(items))
        if tag == "d" and type(body) is list:
            return {untag(k, depth + 1): untag(x, depth + 1) for k, x in body}
        raise ValueError(f"unknown tag {str(tag)[:20]!r}")

    def decode(text):
        try:
            return untag(loads(text), 0)
        except (RecursionError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"malformed value ({type(e).__name__})") from None

    return decode

