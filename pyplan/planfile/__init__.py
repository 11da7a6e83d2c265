"""The plan file: safe YAML loading with positions, JSON-Schema validation, memory units and the
typed plan. Named pyplan.spec before issue #43 (docs/changelog.md)."""

from pyplan.planfile.plan import load_spec, parse_spec, spec_from_text
from pyplan.planfile.source import Source, load_yaml, parse_yaml
from pyplan.planfile import types
from pyplan.planfile.types import *  # noqa: F403 - the typed spec
from pyplan.planfile.units import count, format_memory, parse_memory

__all__ = [*types.__all__, "Source", "count", "format_memory", "load_spec", "load_yaml",
           "parse_memory", "parse_spec", "parse_yaml", "spec_from_text"]
