"""StructuredOutputsParams: what a request's output must match (vLLM's field names), checked without xgrammar.

Exactly one kind per request: `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON
object), `regex` (the whole output matches it), `choice` (the output is one of the strings) or `grammar`
(EBNF / GBNF text, root rule `root`). Whether a schema, regex or grammar is valid is known only once it is
compiled (spmd_engine/structured/grammars.py); that error becomes the request's error row too.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any, Mapping

KINDS = ("json", "json_object", "regex", "choice", "grammar")
FIELD = "sampling.structured_outputs"


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None  # a JSON schema (dict or JSON text)
    json_object: bool | None = None  # True: any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF, root rule `root`

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams | None":
        """A params object from a request's value (the dataclass, or a dict of its fields); None stays None.
        Raises ValueError (one line naming the field) for anything else."""
        if value is None or isinstance(value, cls):
            return value.validate() if value is not None else None
        if not isinstance(value, Mapping):
            raise ValueError(f"{FIELD} must be an object with one of {', '.join(KINDS)}, got "
                             f"{type(value).__name__}")
        unknown = [k for k in value if k not in KINDS]
        if unknown:
            raise ValueError(f"{FIELD}.{str(unknown[0])[:40]} is not a structured output kind (known: "
                             f"{', '.join(KINDS)})")
        return cls(**dict(value)).validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> "StructuredOutputsParams":
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{FIELD} must set exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"{FIELD}.json is not valid JSON ({str(exc)[:80]})") from None
            else:
                parsed = value
                try:  # the cache key is its JSON text
                    _json.dumps(value, sort_keys=True)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{FIELD}.json is not JSON ({str(exc)[:80]})") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"{FIELD}.json must be a JSON schema object, got {type(parsed).__name__}")
        elif kind == "json_object" and value is not True:
            raise ValueError(f"{FIELD}.json_object must be true, got {value!r}")
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"{FIELD}.{kind} must be a non-empty string, got {type(value).__name__}")
        elif kind == "choice" and (not isinstance(value, list) or not value
                                   or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"{FIELD}.choice must be a non-empty list of non-empty strings")
        return self

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar depends on (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = _json.dumps(value)
        else:
            text = value
        return kind, text

    def to_dict(self) -> dict:
        """The set field only (what an outputs row's `sampling` shows)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}
