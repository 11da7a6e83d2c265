"""The seal of a resolved plan: a digest of each top-level field as pyplan wrote it.

Everything `run`, `show` and `export` use comes from the resolved plan, and most of it (the
recompute choices, the status, the capacity, the schedule) cannot be derived again without
solving again. So the writer ends the file with one digest per field of the document's
canonical content (the data the YAML holds: formatting and comments aside), and the reader
refuses a file whose fields do not match theirs, naming the first such field at its line. The
seal covers every field generically, those added later included; a plan given as text
(`plan: null`) is sealed the same way.
"""

from __future__ import annotations

import hashlib
import json

import yaml

from pyplan.spec.source import Source, parse_yaml

__all__ = ["SEAL", "check_seal", "reseal", "seal_lines"]

SEAL = "seal"
_DOMAIN = b"pyplan resolved plan, field "
_HINT = "the file was edited; re-run pyplan solve"


def canonical(value) -> str:
    """One text per value: types told apart (1, 1.0, "1" and true differ), mapping order kept."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{canonical(k)}:{canonical(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(canonical(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return f"i{value}"
    if isinstance(value, float):
        return f"f{value!r}"
    if isinstance(value, str):
        return json.dumps(value)
    return f"?{type(value).__name__}:{value!r}"  # a timestamp, say: never written by pyplan


def digest(key, value) -> str:
    data = _DOMAIN + canonical(key).encode("utf-8", "surrogatepass") + b"\0" + \
        canonical(value).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:16]


def seal_lines(text: str) -> list[str]:
    """The seal of a resolved plan's text (everything but a seal), as lines to append."""
    data = parse_yaml(text, "<resolved plan>").data
    lines = [f"{SEAL}:  # a digest of each field above: pyplan refuses a file whose fields "
             "do not match"]
    lines += [f"  {key}: {_text(digest(key, value))}" for key, value in data.items()
              if key != SEAL]
    return lines


def _text(digest: str) -> str:
    """A digest YAML reads as a string: quoted when it reads as a number (all digits)."""
    plain = yaml.SafeLoader.resolve(yaml.SafeLoader, yaml.ScalarNode, digest, (True, False))
    return digest if plain == "tag:yaml.org,2002:str" else f'"{digest}"'



def reseal(text: str) -> str:
    """The text with its seal replaced by one that matches it (what an edit would need)."""
    head = text.split(f"\n{SEAL}:", 1)[0].rstrip("\n") + "\n"
    return head + "\n".join(seal_lines(head)) + "\n"


def check_seal(source: Source) -> None:
    """PlanError naming the first field (in file order) that is not as pyplan wrote it."""
    doc = source.data
    seal = doc.get(SEAL)
    if not isinstance(seal, dict) or not all(isinstance(v, str) for v in seal.values()):
        raise source.error((SEAL,) if SEAL in doc else (),
                           f"the resolved plan has no '{SEAL}'" if SEAL not in doc else
                           "the seal must map each field to its digest",
                           "written by an older pyplan or edited; re-run pyplan solve")
    for key, value in doc.items():
        if key == SEAL:
            continue
        if key not in seal:
            raise source.error((key,), f"field '{key}' was not written by pyplan", _HINT,
                               key=True)
        if seal[key] != digest(key, value):
            raise source.error((key,), f"'{key}' is not as pyplan wrote it: it does not "
                               "match the seal", _HINT, key=True)
    for key in seal:
        if key not in doc:
            raise source.error((SEAL, key), f"field '{key}' is missing", _HINT, key=True)
