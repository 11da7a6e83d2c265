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
import re
from json.encoder import encode_basestring_ascii

import yaml

from pyplan.planfile.source import Source, parse_yaml

__all__ = ["SEAL", "check_seal", "reseal", "seal_lines"]

SEAL = "seal"
_DOMAIN = b"pyplan resolved plan, field "
_HINT = "the file was edited; re-run pyplan solve"


def canonical(value) -> str:
    """One text per value: types told apart (1, 1.0, "1" and true differ), mapping order kept."""
    if isinstance(value, str):  # (first: a schedule is mostly strings)
        return encode_basestring_ascii(value)  # what json.dumps gives, without its set-up
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
    return f"?{type(value).__name__}:{value!r}"  # a timestamp, say: never written by pyplan


def digest(key, value) -> str:
    data = _DOMAIN + canonical(key).encode("utf-8", "surrogatepass") + b"\0" + \
        canonical(value).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:16]


def seal_lines(text: str) -> list[str]:
    """The seal of a resolved plan's text (everything but a seal), as lines to append."""
    data = _data(text)
    lines = [f"{SEAL}:  # a digest of each field above: pyplan refuses a file whose fields "
             "do not match"]
    lines += [f"  {key}: {_text(digest(key, value))}" for key, value in data.items()
              if key != SEAL]
    return lines


# The schedule as the writer lays it out: per phase, per device, "block@micro-batch start"
# entries, each a plain YAML string. Read line by line it is the same data the YAML parser
# gives, at a fraction of its cost (1,024 micro-batches on 64 devices: 200,000 entries).
_SCHEDULE = "schedule:"
_PHASE = re.compile(r"  (warmup|repetend|cooldown):")
_DEVICE = re.compile(r"    (0|[1-9][0-9]{0,8}):( \[\])?")
_ENTRY = re.compile(r"      - ([A-Za-z_][A-Za-z0-9_.-]*@-?[0-9]{1,9} -?[0-9]{1,18})")


def _data(text: str) -> dict:
    """The document's data: the schedule read as laid out (when it is), the rest parsed."""
    lines = text.split("\n")
    try:
        first = lines.index(_SCHEDULE)
    except ValueError:
        return parse_yaml(text, "<resolved plan>").data
    last = first + 1
    while last < len(lines) and lines[last].startswith(" "):
        last += 1
    schedule = _schedule(lines[first + 1:last])
    if schedule is None:  # not as the writer lays it out: the parser decides
        return parse_yaml(text, "<resolved plan>").data
    rest = "\n".join(lines[:first] + [f"{_SCHEDULE} null"] + lines[last:])
    data = parse_yaml(rest, "<resolved plan>").data
    data["schedule"] = schedule  # (in its place: the key order is the file's)
    return data


def _schedule(lines: list[str]) -> dict | None:
    """Phases of device lists of entries, or None where a line is not of that form."""
    phases: dict = {}
    devices: dict | None = None
    entries: list | None = None
    for line in lines:
        entry = _ENTRY.fullmatch(line)
        if entry is not None:
            if entries is None:
                return None
            entries.append(entry.group(1))
            continue
        device = _DEVICE.fullmatch(line)
        if device is not None:
            number = int(device.group(1))
            if devices is None or number in devices or \
                    (entries is not None and not entries):  # (a device with no entries)
                return None
            entries = None if device.group(2) else []
            devices[number] = [] if entries is None else entries
            continue
        phase = _PHASE.fullmatch(line)
        if phase is None or phase.group(1) in phases or devices == {} or \
                (entries is not None and not entries):
            return None
        devices = phases[phase.group(1)] = {}
        entries = None
    if not phases or devices == {} or (entries is not None and not entries):
        return None
    return phases


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
