"""The targeted ``schema_values`` generator: a new value for an argument whose parameter states a
format (enum, date format, "City, State" / "City, Country", quoted example values)."""

from __future__ import annotations

import copy
import datetime as dt
import random
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from flywheel.synth.generators.base import (
    Candidate,
    GenContext,
    Generator,
    _is_one_of,
    _locate_string,
    _new_task,
    _schema_of,
    _tool_call_seed,
)
from flywheel.synth.keys import _canon_value
from flywheel.verifiers.matching import standardize_string
from flywheel.vocab.ids import canonical_json
from flywheel.vocab.messages import last_index, request_content_text

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")

#: Well-known cities a request may name without their region (as BFCL's requests do: "in New York"
#: for ``New York, NY``), with their US state (abbreviation, name) or their country.
CITY_STATES: tuple[tuple[str, str, str], ...] = (
    ("New York", "NY", "New York"), ("Los Angeles", "CA", "California"), ("Chicago", "IL", "Illinois"),
    ("Houston", "TX", "Texas"), ("Austin", "TX", "Texas"), ("Seattle", "WA", "Washington"),
    ("Boston", "MA", "Massachusetts"), ("Miami", "FL", "Florida"), ("Denver", "CO", "Colorado"),
    ("San Francisco", "CA", "California"), ("Phoenix", "AZ", "Arizona"), ("Atlanta", "GA", "Georgia"),
    ("Las Vegas", "NV", "Nevada"), ("Nashville", "TN", "Tennessee"), ("New Orleans", "LA", "Louisiana"),
    ("San Diego", "CA", "California"), ("Philadelphia", "PA", "Pennsylvania"), ("Detroit", "MI", "Michigan"),
)
CITY_COUNTRIES: tuple[tuple[str, str], ...] = (
    ("Tel Aviv", "Israel"), ("Paris", "France"), ("Tokyo", "Japan"), ("Berlin", "Germany"), ("Madrid", "Spain"),
    ("Rome", "Italy"), ("Cairo", "Egypt"), ("Toronto", "Canada"), ("Sydney", "Australia"), ("Mumbai", "India"),
    ("Lisbon", "Portugal"), ("Nairobi", "Kenya"), ("Lima", "Peru"), ("Oslo", "Norway"), ("Seoul", "South Korea"),
    ("Istanbul", "Turkey"), ("Buenos Aires", "Argentina"), ("Amsterdam", "Netherlands"), ("Dublin", "Ireland"),
    ("Vienna", "Austria"),
)
_STATE_FMT = re.compile(r"\bcity,?\s+(?:and\s+)?state\b", re.IGNORECASE)
_COUNTRY_FMT = re.compile(r"\bcity,?\s+(?:and\s+)?country\b", re.IGNORECASE)
_ABBR_EXAMPLE = re.compile(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*, [A-Z]{2}\b")
_DATE_FMT = re.compile(r"\b(yyyy|mm|dd)([-/.])(yyyy|mm|dd)\2(yyyy|mm|dd)\b", re.IGNORECASE)
_ISO_DATE = re.compile(r"\bISO[- ]?8601\b|\bISO date\b|\bISO format\b", re.IGNORECASE)
_QUOTED = re.compile(r"'([^'\n]{1,40})'|\"([^\"\n]{1,40})\"")
_DEFAULT_Q = re.compile(r"default(?:s)?(?: value)?(?: is| to| of|:)?\s*(?:'([^'\n]{1,40})'|\"([^\"\n]{1,40})\")",
                        re.IGNORECASE)
#: What the ``schema_values`` generator recognises, in the order it prefers one reading of a parameter.
SCHEMA_FORMATS = ("enum", "date", "city_state", "city_country", "described")


def _description(schema: dict) -> str:
    d = schema.get("description")
    return d if isinstance(d, str) else ""


def _date_strftime(schema: dict) -> str | None:
    """The ``strftime`` pattern of the date format a string parameter's schema or description
    states (``yyyy-mm-dd``, ``MM-DD-YYYY``, ``dd/mm/yyyy``, ``ISO 8601``, ``format: date``), or None."""
    d = _description(schema)
    m = _DATE_FMT.search(d)
    if m:
        parts = [m.group(1).lower(), m.group(3).lower(), m.group(4).lower()]
        if sorted(parts) == ["dd", "mm", "yyyy"]:
            return m.group(2).join({"yyyy": "%Y", "mm": "%m", "dd": "%d"}[p] for p in parts)
        return None
    if schema.get("format") == "date" or _ISO_DATE.search(d):
        return "%Y-%m-%d"
    return None


def _described_values(schema: dict) -> tuple[list[str], str | None]:
    """Quoted example values a description lists (``e.g., 'fastest', 'scenic'``) and its quoted
    default, if any."""
    d = _description(schema)
    vals = list(dict.fromkeys(a or b for a, b in _QUOTED.findall(d)))
    m = _DEFAULT_Q.search(d)
    return vals, (m.group(1) or m.group(2)) if m else None


def _value_format(schema: dict, v: Any) -> str | None:
    """Which stated format (:data:`SCHEMA_FORMATS`) the parameter's schema or description gives for
    the string value ``v``; None when it states none."""
    if not isinstance(v, str) or isinstance(schema.get("type"), str) and schema.get("type") != "string":
        return None
    enum = schema.get("enum")
    if isinstance(enum, list):
        strs = [e for e in enum if isinstance(e, str)]
        return "enum" if len(strs) >= 2 and any(standardize_string(e) == standardize_string(v) for e in strs) else None
    if _date_strftime(schema):
        return "date"
    d = _description(schema)
    if _STATE_FMT.search(d):
        return "city_state"
    if _COUNTRY_FMT.search(d):
        return "city_country"
    vals, _ = _described_values(schema)
    if len(vals) >= 2 and any(standardize_string(x) == standardize_string(v) for x in vals):
        return "described"
    return None


def _format_slots(seed: dict) -> list[dict]:
    """Reference arguments whose parameter states a format, each value used by one argument only."""
    calls = seed["reference"]["tool_calls"]
    usage = Counter(canonical_json(_canon_value(v)) for c in calls for v in (c.get("arguments") or {}).values())
    out = []
    for ci, c in enumerate(calls):
        for p, v in (c.get("arguments") or {}).items():
            schema = _schema_of(seed["prompt"]["tools"], c["name"], p)
            if schema is None or usage[canonical_json(_canon_value(v))] != 1:
                continue
            kind = _value_format(schema, v)
            if kind is not None:
                out.append({"call": ci, "param": p, "value": v, "schema": schema, "format": kind})
    return out


def _one_span(text: str, needles: Sequence[str]) -> tuple[int, int] | None:
    """The one place ``text`` states any of ``needles`` (spans inside a longer match merged); None
    when it states none or several."""
    spans = {m.span() for n in needles if isinstance(n, str) for m in _locate_string(text, n)}
    outer = {s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)}
    return next(iter(outer)) if len(outer) == 1 else None


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _date_renderings(d: dt.date, fmt: str) -> list[str]:
    m = _MONTHS[d.month - 1]
    return [d.strftime(fmt), d.isoformat(), d.strftime("%m/%d/%Y"), f"{m} {d.day}, {d.year}",
            f"{m} {_ordinal(d.day)}, {d.year}", f"{d.day} {m} {d.year}", f"{m} {d.day} {d.year}",
            f"{m}.{d.day}, {d.year}", f"{m[:3]}.{d.day}, {d.year}", f"{m[:3]} {d.day}, {d.year}"]


def _parse_date(v: str, fmt: str) -> dt.date | None:
    for f in (fmt, "%Y-%m-%d"):
        try:
            return dt.datetime.strptime(v.strip(), f).date()
        except ValueError:
            continue
    return None


def _allowed_values(seed: dict, slot: dict) -> list[Any]:
    spec = ((seed["verifier"]["expected"][slot["call"]].get("arguments") or {}).get(slot["param"]))
    vals = spec["one_of"] if _is_one_of(spec) else [spec]
    return [slot["value"], *[x for x in vals if isinstance(x, str)]]


def _format_edit(seed: dict, slot: dict, text: str, rng: random.Random,
                 taken: set[str]) -> tuple[tuple[int, int], str, Any, list[Any], dict] | None:
    """(span of the request, its new text, the new reference value, the values the verifier
    accepts, detail) for one format-stated argument; None when the request does not state its value
    in one place or no other value fits."""
    kind, v, schema = slot["format"], slot["value"], slot["schema"]

    def free(c: str) -> bool:
        return standardize_string(c) not in taken and not _locate_string(text, c)

    if kind == "enum":
        span = _one_span(text, [v, v.replace("_", " ")])
        opts = [e for e in schema["enum"] if isinstance(e, str) and standardize_string(e) != standardize_string(v)
                and free(e) and free(e.replace("_", " "))]
        if span is None or not opts:
            return None
        new = rng.choice(opts)
        return span, new.replace("_", " "), new, [new], {}
    if kind == "described":
        vals, default = _described_values(schema)
        span = _one_span(text, [v])
        opts = [x for x in vals if standardize_string(x) != standardize_string(v) and free(x)
                and (default is None or standardize_string(x) != standardize_string(default))]
        if span is None or not opts:
            return None
        new = rng.choice(opts)
        return span, new, new, [new], {"described_values": vals, "default": default}
    if kind == "date":
        fmt = _date_strftime(schema)
        old = _parse_date(v, fmt) if fmt else None
        if old is None:
            return None
        span = _one_span(text, _date_renderings(old, fmt))
        if span is None:
            return None
        for _ in range(10):
            new_d = dt.date(rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28))
            if new_d != old:
                break
        m = _MONTHS[new_d.month - 1]
        said = rng.choice([f"{m} {new_d.day}, {new_d.year}", f"{new_d.day} {m} {new_d.year}",
                           f"{m} {_ordinal(new_d.day)}, {new_d.year}"])
        new = new_d.strftime(fmt)
        return span, said, new, [new], {"date_format": fmt}
    # city_state / city_country: the request names the city (the region maybe in prose), the
    # answer writes "City, Region" as the description asks.
    seen = _allowed_values(seed, slot)
    if not any("," in a for a in seen):
        return None  # the seed's answer is not a "City, Region" itself: not a city to swap
    needles = [x for a in seen for x in (a, a.split(",")[0].strip())]
    span = _one_span(text, needles)
    if span is None:
        return None
    if kind == "city_state":
        abbr = bool(_ABBR_EXAMPLE.search(_description(schema)))
        opts = [c for c in CITY_STATES if free(c[0])]
        if not opts:
            return None
        city, code, state = rng.choice(opts)
        new = f"{city}, {code}" if abbr else f"{city}, {state}"
        allowed = list(dict.fromkeys([new, f"{city}, {code}", f"{city}, {state}"]))
        said = city if rng.random() < 0.7 else f"{city}, {state}"
    else:
        opts2 = [c for c in CITY_COUNTRIES if free(c[0])]
        if not opts2:
            return None
        city, country = rng.choice(opts2)
        new = allowed_one = f"{city}, {country}"
        allowed = [allowed_one]
        said = city if rng.random() < 0.7 else f"{city} in {country}"
    return span, said, new, allowed, {}


class SchemaValuesGenerator(Generator):
    """Re-asks a seed with a new value for an argument whose parameter *states a format* (an enum,
    a date format, "City, State" / "City, Country", quoted example values in the description), the
    request saying it naturally and the reference writing it as the schema asks. No variant where
    the schema and description state no format."""

    name = "schema_values"

    def __init__(self, max_args: int = 1):
        super().__init__(max_args=max_args)

    def applicable(self, seed: dict) -> bool:
        return _tool_call_seed(seed) and bool(_format_slots(seed))

    def one(self, seed: dict, k: int, rng: random.Random, ctx: GenContext) -> Candidate | None:
        msgs = copy.deepcopy(seed["prompt"]["messages"])
        ui = last_index(msgs, "user")
        if ui is None:
            return None
        text = request_content_text(msgs[ui].get("content"))
        slots = _format_slots(seed)
        rng.shuffle(slots)
        taken = {standardize_string(str(s["value"])) for s in slots}
        edits: list[tuple[tuple[int, int], str, dict, Any, list[Any], dict]] = []
        for s in slots:
            if len(edits) >= self.params["max_args"]:
                break
            got = _format_edit(seed, s, text, rng, taken)
            if got is None:
                continue
            span, said, new, allowed, extra = got
            if any(not (span[1] <= a or b <= span[0]) for (a, b), *_ in edits):
                continue
            taken.add(standardize_string(str(new)))
            edits.append((span, said, s, new, allowed, extra))
        if not edits:
            return None
        calls = copy.deepcopy(seed["reference"]["tool_calls"])
        expected = copy.deepcopy(seed["verifier"]["expected"])
        for (a, b), said, s, new, allowed, _ in sorted(edits, key=lambda e: -e[0][0]):
            text = text[:a] + said + text[b:]
            calls[s["call"]]["arguments"][s["param"]] = new
            expected[s["call"]].setdefault("arguments", {})[s["param"]] = {"one_of": allowed, "optional": False}
        msgs[ui] = {**msgs[ui], "content": text}
        detail = {"changed": [{"call": calls[s["call"]]["name"], "param": s["param"], "format": s["format"],
                               "from": s["value"], "to": new, "said": said, **extra}
                              for _, said, s, new, _, extra in edits]}
        task = _new_task(seed, messages=msgs, tools=copy.deepcopy(seed["prompt"]["tools"]), expected=expected,
                         reference={"tool_calls": calls}, generator=self.name, params=self.params, detail=detail,
                         seeds=[seed["task_id"]])
        return Candidate(task, self.name, [seed["task_id"]])


