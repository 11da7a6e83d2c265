"""Plan specification: safe YAML loading with positions, JSON-Schema validation, typed spec."""

from pyplan.spec.plan import load_spec, parse_spec, spec_from_text
from pyplan.spec.source import Source, load_yaml, parse_yaml
from pyplan.spec import types
from pyplan.spec.types import *  # noqa: F403 - the typed spec
from pyplan.spec.units import count, format_memory, parse_memory

__all__ = [*types.__all__, "Source", "count", "format_memory", "load_spec", "load_yaml",
           "parse_memory", "parse_spec", "parse_yaml", "spec_from_text"]
