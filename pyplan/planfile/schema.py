"""Validate a plan document against schemas/plan.schema.json, reporting the first error by
position in the file as one located, human-readable PlanError.

jsonschema takes about 0.1 s to import, half of a small plan's `pyplan solve`: a plan text
that passed once is remembered by its hash and the schema's (an empty file in the user's
cache directory, $PYPLAN_CACHE_DIR or ~/.cache/pyplan; PYPLAN_CACHE_DIR= turns it off), and
is not validated again. Only the time changes: a text that fails is never remembered.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyplan.errors import MAX_REPORTED, PlanError, PyplanError, did_you_mean
from pyplan.files import write_atomic
from pyplan.planfile.source import Source

if TYPE_CHECKING:
    import jsonschema

__all__ = ["check_schema", "load_schema", "schema_path"]

_TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string",
               "array": "a list", "object": "a mapping", "boolean": "true or false"}


def schema_path(name: str = "plan") -> Path:
    """A schema (plan, cluster): installed beside the package, or in the source tree's
    schemas/."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "schemas" / f"{name}.schema.json",
                      here.parent / "schemas" / f"{name}.schema.json"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{name}.schema.json is missing from the pyplan installation")


@lru_cache(maxsize=None)
def load_schema(name: str = "plan") -> dict:
    return json.loads(schema_path(name).read_text(encoding="utf-8"))


def _is_integer(checker, instance) -> bool:
    # JSON Schema counts 1.0 as an integer; plans want real integers (times, ids, counts).
    return isinstance(instance, int) and not isinstance(instance, bool)


@lru_cache(maxsize=None)
def _validator(name: str):
    import jsonschema

    schema = load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    draft = jsonschema.Draft202012Validator
    plan_validator = jsonschema.validators.extend(
        draft, type_checker=draft.TYPE_CHECKER.redefine("integer", _is_integer))
    return plan_validator(schema)


def _passed_marker(source: Source, name: str) -> Path | None:
    """Where the cache remembers that this text passed this schema (None: no cache)."""
    where = os.environ.get("PYPLAN_CACHE_DIR")
    if where == "":
        return None
    try:
        root = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or
                                              Path.home() / ".cache") / "pyplan"
    except (RuntimeError, KeyError):  # no home directory to be found
        return None
    key = hashlib.sha256(f"{_schema_sha256(name)}:{source.sha256}".encode())
    return root / "valid-plans" / key.hexdigest()


@lru_cache(maxsize=None)
def _schema_sha256(name: str) -> str:
    return hashlib.sha256(schema_path(name).read_bytes()).hexdigest()


def _show_path(path: tuple) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "the plan"


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _hint(error: jsonschema.ValidationError) -> str | None:
    for schema in (error.schema, getattr(error.parent, "schema", None)):
        if isinstance(schema, dict) and "x-hint" in schema:
            return schema["x-hint"]
    return None


def _leaf(error: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """For oneOf/anyOf, the alternative whose type matches the value explains best."""
    while error.validator in ("oneOf", "anyOf") and error.context:
        typed = [e for e in error.context if e.validator not in ("type", "const", "oneOf")]
        deeper = [e for e in error.context if len(e.absolute_path) > len(error.absolute_path)]
        pick = deeper or typed
        if not pick:
            break
        # (deepest first; of alternatives with required keys, the one the mapping began)
        pick.sort(key=lambda e: (-len(e.absolute_path), -_begun(e)))
        error = pick[0]
    return error


def _begun(error: jsonschema.ValidationError) -> int:
    """How many of an alternative's required keys the value has."""
    if error.validator != "required" or not isinstance(error.instance, dict):
        return 0
    return sum(key in error.instance for key in error.validator_value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return "e" in text.lower()


def _to_plan_error(source: Source, error: jsonschema.ValidationError) -> PlanError:
    path = tuple(error.absolute_path)
    where = _show_path(path)
    kind = error.validator
    value = error.instance
    if kind == "additionalProperties":
        allowed = list(error.schema.get("properties", {}))
        unknown = [k for k in value if k not in allowed]
        key = min(unknown, key=lambda k: source.locate(path + (k,), key=True))
        hint = did_you_mean(key, allowed) or ("allowed keys: " + ", ".join(allowed))
        context = f" in {where}" if path else ""
        return source.error(path + (key,), f"unknown key {key!r}{context}", hint, key=True)
    if kind == "required":
        missing = [k for k in error.validator_value if k not in value]
        allowed = dict(error.schema.get("properties", {}))
        parent = error.parent  # (a required key of one alternative: the mapping's own keys)
        while parent is not None:
            if isinstance(parent.schema, dict):
                allowed.update(parent.schema.get("properties", {}))
            parent = parent.parent
        for key in value:  # a misspelt required key explains the missing one
            if key not in allowed and did_you_mean(key, missing):
                return source.error(path + (key,), f"unknown key {key!r}"
                                    + (f" in {where}" if path else ""),
                                    did_you_mean(key, missing), key=True)
        prop = allowed.get(missing[0], {})
        return source.error(path, f"missing required key '{missing[0]}' in {where}",
                            prop.get("description"))
    if kind == "type":
        expected = error.validator_value
        names = [expected] if isinstance(expected, str) else expected
        wanted = " or ".join(_TYPE_NAMES.get(n, n) for n in names)
        hint = _hint(error)
        if isinstance(value, str) and "number" in names and _is_number(value):
            hint = (f"YAML reads {value} as text (a number in exponent form needs a dot: "
                    f"{value.replace('e', '.0e', 1) if '.' not in value else value})")
        return source.error(path, f"{where} must be {wanted}, got {_describe(value)}", hint)
    if kind == "enum":
        options = error.validator_value
        hint = did_you_mean(value, options) if isinstance(value, str) else None
        return source.error(path, f"{where} must be one of {', '.join(map(str, options))}; "
                            f"got {_describe(value)}", hint or _hint(error))
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=",
              "exclusiveMaximum": "<"}[kind]
        return source.error(path, f"{where} must be {op} {error.validator_value}, "
                            f"got {_describe(value)}", _hint(error))
    if kind in ("minItems", "minProperties") and error.validator_value > 1:
        what = "items" if kind == "minItems" else "keys"
        return source.error(path, f"{where} must have at least {error.validator_value} {what}, "
                            f"got {len(value)}", _hint(error))
    if kind in ("minItems", "minProperties"):
        return source.error(path, f"{where} must not be empty", _hint(error))
    if kind == "pattern":
        return source.error(path, f"{where} has an invalid form: {_describe(value)}",
                            _hint(error))
    if kind == "const":
        return source.error(path, f"{where} must be {_describe(error.validator_value)}, "
                            f"got {_describe(value)}", _hint(error))
    return source.error(path, f"{where} has the wrong form: {_describe(value)}", _hint(error))


def check_schema(source: Source, name: str = "plan") -> None:
    """Raise a PlanError for the first violation of schemas/NAME.schema.json in file order,
    carrying the next ones (each place once) for a compiler-like report."""
    marker = _passed_marker(source, name)
    try:
        if marker is not None and marker.is_file():
            return
    except OSError:  # a path the system refuses (too long, unreadable): no cache
        marker = None
    errors = list(_validator(name).iter_errors(source.data))
    if not errors:
        if marker is not None:
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(marker, "")
            except (OSError, PyplanError):
                pass  # a read-only home: validate every time
        return
    # A mapping with an unknown key (a misspelt one, most often) fails its required keys and
    # alternatives too: those follow from the unknown key, which is the error to report.
    unknown = {tuple(e.absolute_path) for e in errors if e.validator == "additionalProperties"}
    errors = [e for e in errors if e.validator not in ("required", "oneOf", "anyOf")
              or tuple(e.absolute_path) not in unknown] or errors
    plan_errors = sorted((_to_plan_error(source, _leaf(e)) for e in errors),
                         key=lambda e: (e.line, e.column, str(e)))
    first, seen = plan_errors[0], {(plan_errors[0].line, plan_errors[0].column)}
    for error in plan_errors[1:]:
        if (error.line, error.column) not in seen and len(first.others) < MAX_REPORTED - 1:
            seen.add((error.line, error.column))
            first.others.append(error)
    raise first
