"""Order constraints in nnScaler's op-order form, written as readable strings.

    "stage0.f[m+4] < stage0.b[m]"            block stage0 (forward) of micro-batch m+4 finishes
                                             before stage0.b of micro-batch m starts, for every m
    "f3.s1[m] < s1.b[m-3] if m >= 3"         only for m >= 3
    {rule: "stage{s}.f[m+{D-s}] < stage{s}.b[m]", for: {s: "0..3"}}   one rule per s

A reference NAME.f means the forward block NAME; NAME.b / NAME.w are derived backward blocks.
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass

from pyplan.planfile.plan import MAX_SHIFT

__all__ = ["ParsedRule", "RuleSyntaxError", "expand_template", "parse_rule"]

_REF = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z_][A-Za-z0-9_-]*)?)\s*"
                  r"\[\s*m\s*(?:([+-])\s*(\d+)\s*)?\]\s*")
_COND = re.compile(r"\s*if\s+m\s*(>=|>)\s*(-?\d+)\s*$")
_FORM = "write rules like \"stage0.f[m+4] < stage0.b[m]\" (optionally ending with \"if m >= 2\")"


class RuleSyntaxError(ValueError):
    """A malformed rule; `offset` is the character position of the problem in the text."""

    def __init__(self, message: str, offset: int, hint: str = _FORM) -> None:
        super().__init__(message)
        self.offset = offset
        self.hint = hint


@dataclass(frozen=True)
class ParsedRule:
    """before[m + before_shift] < after[m + after_shift] for all m >= min_m."""

    before: str
    before_shift: int
    after: str
    after_shift: int
    min_m: int
    before_at: int  # text offsets of the names, for error messages
    after_at: int


def _ref(text: str, pos: int) -> tuple[str, int, int, int]:
    match = _REF.match(text, pos)
    if not match:
        raise RuleSyntaxError(f"expected a block reference like name[m+1] at {text[pos:]!r}",
                              pos)
    name, sign, number = match.groups()
    if number is not None and len(number.lstrip("0")) > 6:
        raise RuleSyntaxError(f"the shift {sign}{number} is beyond {MAX_SHIFT:,}",
                              match.start(3), "shifts reach at most a million micro-batches")
    shift = int(number or 0) * (-1 if sign == "-" else 1)
    return name, shift, match.start(1), match.end()


def parse_rule(text: str) -> ParsedRule:
    """Parse one rule; raises RuleSyntaxError with the offending offset."""
    before, before_shift, before_at, pos = _ref(text, 0)
    if not text.startswith("<", pos):
        raise RuleSyntaxError(f"expected '<' after {text[:pos].strip()!r}", pos)
    after, after_shift, after_at, pos = _ref(text, pos + 1)
    min_m = 0
    rest = text[pos:]
    if rest.strip():
        cond = _COND.match(rest)
        if not cond:
            raise RuleSyntaxError(f"unexpected text {rest.strip()!r}", pos)
        op, bound = cond.groups()
        if len(bound.lstrip("-0")) > 6:
            raise RuleSyntaxError(f"the condition's bound {bound} is beyond {MAX_SHIFT:,}",
                                  pos + rest.index(bound))
        min_m = int(bound) + (1 if op == ">" else 0)
    return ParsedRule(before, before_shift, after, after_shift, min_m, before_at, after_at)


_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load,
            ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub, ast.UAdd)


def _evaluate(expr: str, names: dict[str, int], offset: int) -> int:
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise RuleSyntaxError(f"cannot read {{{expr}}}", offset,
                              "use integers, loop variables, D and + - * // %") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise RuleSyntaxError(f"{{{expr}}} is not simple arithmetic", offset,
                                  "use integers, loop variables, D and + - * // %")
        if isinstance(node, ast.Name) and node.id not in names:
            raise RuleSyntaxError(f"unknown name '{node.id}' in {{{expr}}}", offset,
                                  "known: " + ", ".join(sorted(names)))
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            raise RuleSyntaxError(f"{{{expr}}} may only use integers", offset)
    try:
        value = eval(compile(tree, "<rule>", "eval"), {"__builtins__": {}}, dict(names))
    except ZeroDivisionError:
        raise RuleSyntaxError(f"division by zero in {{{expr}}}", offset) from None
    return int(value)


def expand_template(text: str, loop: dict[str, tuple[int, ...]],
                    constants: dict[str, int]) -> list[str]:
    """Every instance of a templated rule: {expressions} evaluated per loop binding.

    A value that makes an index like m+-1 is written as m-1.
    """
    variables = list(loop)
    rules = []
    for values in itertools.product(*(loop[v] for v in variables)):
        names = dict(constants, **dict(zip(variables, values)))

        def substitute(match: re.Match) -> str:
            return str(_evaluate(match.group(1), names, match.start()))

        rule = re.sub(r"\{([^{}]*)\}", substitute, text)
        rules.append(re.sub(r"\+\s*-", "-", re.sub(r"-\s*-", "+", rule)))
    return rules
