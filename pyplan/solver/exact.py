"""Exact subproblems with Z3.

* `modulo_repetend`: is there a repetend with period T (a modulo schedule: block b of micro-batch
  m starts at k_b * T + o_b + m * T, o_b in [0, T)) within the lag and memory limits? Blocks
  sharing a device do not overlap modulo T; steady-state memory is checked at every block
  start: -sum(m_i k_i) - sum(m_i for o_i > o_j).
* `time_optimal`: the least makespan of a set of instances (warmup, cooldown or a whole small
  problem) with dependencies, exclusive devices, memory at block-start events and order rules.

Both use a plain Solver: T is fixed per check (keeps everything linear), and makespans are
bisected with push/pop; `method="optimize"` runs z3.Optimize instead, for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyplan.problem import Problem
from pyplan.solver.budget import Budget, check

if TYPE_CHECKING:
    import z3
else:
    class _Z3:
        """z3, imported on first use: most solves never reach an exact subproblem, and the
        import costs a noticeable part of a small plan's solve."""

        def __getattr__(self, name: str):
            import z3 as module
            globals()["z3"] = module
            return getattr(module, name)

    z3 = _Z3()

__all__ = ["Anchor", "ModuloResult", "TimeOptimal", "infeasibility_core",
           "modulo_repetend", "reoptimise", "time_optimal"]


MODULO_Z3_RATE = 4  # effort units per Z3 unit of a modulo model (about 200 ns each here)


def _solver(ctx: z3.Context) -> z3.Solver:
    return z3.SolverFor("QF_LIA", ctx=ctx)


# The models are written as SMT-LIB text and parsed by Z3 in one call: building them term by term
# through the Python API costs more than Z3 then takes to solve a phase.

def _int(value: int) -> str:
    return str(value) if value >= 0 else f"(- {-value})"


def _sum(terms: list[str]) -> str:
    return terms[0] if len(terms) == 1 else f"(+ {' '.join(terms)})"


def _at_least(x: str, y: str, *gaps: int) -> str:
    """x >= y + sum(gaps)."""
    return f"(>= {x} {_sum([y] + [_int(g) for g in gaps])})"


def _symbol(prefix: str, name: str, fallback: str) -> str:
    """A quoted SMT-LIB symbol named after a block (names that cannot be quoted: `fallback`)."""
    return f"|{prefix}{name}|" if "|" not in name and "\\" not in name else fallback


def _variable(symbol: str, ctx: z3.Context) -> z3.ArithRef:
    """The integer constant an SMT-LIB symbol (quoted or not) declares."""
    return z3.Int(symbol[1:-1] if symbol.startswith("|") else symbol, ctx)


def _text(decls: list[str], cons: list[str]) -> str:
    return "\n".join(decls + [f"(assert {c})" for c in cons])


@dataclass(frozen=True)
class ModuloResult:
    status: str  # "sat", "unsat" or "unknown" (timeout)
    starts: tuple[int, ...] = ()  # absolute start of each block of micro-batch 0


def modulo_repetend(problem: Problem, period: int, max_micro_batches: int, *,
                    min_lags: list[int] | None = None, budget: Budget = Budget()
                    ) -> ModuloResult:
    """A repetend with this period, at most `max_micro_batches` micro-batches (lag span) and
    within memory, or unsat. `min_lags` pins Tessel index assignments: lag_b >= min_lags[b]."""
    blocks = problem.blocks
    T = period
    if any(b.time > T for b in blocks):
        return ModuloResult("unsat")
    max_lag = max_micro_batches - 1
    k = len(blocks)
    off = [_symbol("o_", b.name, f"o{i}") for i, b in enumerate(blocks)]
    lag = [_symbol("k_", b.name, f"k{i}") for i, b in enumerate(blocks)]
    start = [f"(+ (* {lag[i]} {T}) {off[i]})" for i in range(k)]
    decls = [f"(declare-const {v} Int)" for v in off + lag]
    cons = []
    for i in range(k):
        cons += [f"(>= {off[i]} 0)", f"(< {off[i]} {T})",
                 f"(>= {lag[i]} {min_lags[i] if min_lags else 0})", f"(<= {lag[i]} {max_lag})"]
    for a, c in problem.edges:
        cons.append(_at_least(start[c], start[a], blocks[a].time,
                              problem.transfer.get((a, c), 0)))
    for r in problem.rules:
        cons.append(_at_least(start[r.after], start[r.before],
                              blocks[r.before].time + (r.before_shift - r.after_shift) * T))
    for i in range(k):
        for j in range(i + 1, k):
            if set(blocks[i].devices) & set(blocks[j].devices):
                ti, tj = blocks[i].time, blocks[j].time
                cons.append(f"(or (and (<= (+ {off[i]} {ti}) {off[j]}) "
                            f"(<= (+ {off[j]} {tj}) (+ {off[i]} {T}))) "
                            f"(and (<= (+ {off[j]} {tj}) {off[i]}) "
                            f"(<= (+ {off[i]} {ti}) (+ {off[j]} {T}))))")
    if problem.limited:
        for d in range(problem.num_devices):
            on = [i for i, b in enumerate(blocks) if d in b.devices]
            holding = [i for i in on if blocks[i].memory != 0]
            if not holding or problem.headroom(d) is None:
                continue
            # Memory at block j's start: -sum(m_i k_i) - sum(m_i for o_i > o_j) <= headroom.
            base = f"(- {_sum([f'(* {_int(blocks[i].memory)} {lag[i]})' for i in holding])})"
            for j in on:
                later = [f"(ite (> {off[i]} {off[j]}) {_int(blocks[i].memory)} 0)"
                         for i in holding if i != j]
                at_start = f"(- {base} {_sum(later)})" if later else base
                cons.append(f"(<= {at_start} {_int(problem.headroom(d))})")
    # Symmetries: shifting a whole schedule by a period, or rotating it within the period, gives
    # an equivalent one; let some block have lag 0 and some block offset 0.
    cons.append(f"(or {' '.join(f'(= {v} 0)' for v in lag)})" if k > 1 else f"(= {lag[0]} 0)")
    cons.append(f"(or {' '.join(f'(= {v} 0)' for v in off)})" if k > 1 else f"(= {off[0]} 0)")
    for a, c in problem.edges:  # implied (a_c > a_a), stated to help propagation
        cons.append(f"(>= {lag[c]} {lag[a]})")
    ctx = z3.Context()  # a fresh context per model keeps Z3's choices, and so results, repeatable
    solver = _solver(ctx)
    solver.from_string(_text(decls, cons))
    outcome = budget.check(solver, rate=MODULO_Z3_RATE)
    if outcome == z3.sat:
        model = solver.model()

        def value(symbol: str) -> int:
            return model.eval(_variable(symbol, ctx), model_completion=True).as_long()

        return ModuloResult("sat", tuple(value(lag[i]) * T + value(off[i]) for i in range(k)))
    return ModuloResult("unsat" if outcome == z3.unsat else "unknown")


@dataclass(frozen=True)
class TimeOptimal:
    status: str  # "optimal", "feasible" (search stopped early) or "none" (nothing better found)
    value: int = 0  # the minimised objective
    orders: tuple = ()  # per device, instances by start time
    starts: dict | None = None


@dataclass(frozen=True)
class Anchor:
    """How a phase meets the repetend, which runs as a rigid periodic block of time.

    warmup: a variable origin R (at least `floor`) is minimised; an instance on device d must
    end by R + device_time[d]; `external[i]` = c means instance i must end by R + c.
    cooldown: the origin is 0 (the last repetition's start); an instance on device d starts at
    device_time[d] or later; `external[i]` = c means instance i starts at c or later; the
    objective is the end of everything, at least `floor`.
    """

    kind: str
    device_time: dict = field(default_factory=dict)
    external: dict = field(default_factory=dict)
    floor: int = 0


class _TimeModel:
    """Start-time variables of a set of instances and the constraint families over them, as
    SMT-LIB text. Each family can go under a label (a Boolean assumption) so an unsat core can
    name it."""

    OBJECTIVE = "objective"

    def __init__(self, problem: Problem, instances) -> None:
        self.problem = problem
        self.inst = sorted(set(map(tuple, instances)), key=lambda x: (x[1], x[0]))
        self.index = {x: i for i, x in enumerate(self.inst)}
        self.time = [problem.blocks[b].time for b, _ in self.inst]
        self.start = [_symbol("s_", f"{problem.blocks[b].name}@{m}", f"s{i}")
                      for i, (b, m) in enumerate(self.inst)]
        self.decls = [f"(declare-const {s} Int)" for s in self.start]
        self.cons: list[str] = [f"(>= {s} 0)" for s in self.start]
        self.labels: dict[str, str] = {}
        self.before: dict[tuple[int, int], str] = {}
        self.on_device = [[i for i, (b, _) in enumerate(self.inst)
                           if d in problem.blocks[b].devices]
                          for d in range(problem.num_devices)]
        self.ctx = z3.Context()  # a fresh context per model keeps Z3's choices repeatable

    def _add(self, constraint: str, label: str | None) -> None:
        if label is None:
            self.cons.append(constraint)
            return
        if label not in self.labels:
            self.labels[label] = name = f"label_{len(self.labels)}"
            self.decls.append(f"(declare-const {name} Bool)")
        self.cons.append(f"(=> {self.labels[label]} {constraint})")

    def solver(self, solver=None):
        """A Z3 solver (or `solver`) holding the model."""
        solver = _solver(self.ctx) if solver is None else solver
        solver.from_string(_text(self.decls, self.cons))
        return solver

    def variable(self, symbol: str):
        return _variable(symbol, self.ctx)

    def literals(self) -> dict[str, z3.BoolRef]:
        return {label: z3.Bool(name, self.ctx) for label, name in self.labels.items()}

    def add_dependencies(self) -> None:
        s, index = self.start, self.index
        micro_batches = sorted({m for _, m in self.inst})
        for a, c in self.problem.edges:
            gaps = (self.problem.blocks[a].time, self.problem.transfer.get((a, c), 0))
            for m in micro_batches:
                if (a, m) in index and (c, m) in index:
                    self.cons.append(_at_least(s[index[(c, m)]], s[index[(a, m)]], *gaps))

    def add_rules(self, labelled: bool = False) -> None:
        """Order rules between the instances present (a rule naming a micro-batch outside the
        set holds vacuously); labelled by rule position when asked."""
        s, index = self.start, self.index
        for k, r in enumerate(self.problem.rules):
            for (b, m) in self.inst:
                if b != r.before:
                    continue
                var = m - r.before_shift
                other = (r.after, var + r.after_shift)
                if var >= r.min_m and other in index and other != (b, m):
                    self._add(_at_least(s[index[other]], s[index[(b, m)]],
                                        self.time[index[(b, m)]]),
                              f"rule {k}" if labelled else None)

    def add_symmetry(self) -> None:
        """Instances of one block run in micro-batch order (Tessel Property 4.1)."""
        previous: dict[int, int] = {}
        for b, m in self.inst:
            if b in previous:
                self.cons.append(f"(< {self.start[self.index[(b, previous[b])]]} "
                                 f"{self.start[self.index[(b, m)]]})")
            previous[b] = m

    def add_devices(self, keep=None, free=frozenset()) -> None:
        """Instances sharing a device do not overlap; one Boolean per pair fixes their order.
        `keep`: per device, an order of the instances (a schedule's) that every pair keeps
        unless both are in `free` (a neighbourhood): such pairs get no Boolean, and only
        consecutive kept instances and the pairs of a free one need a constraint."""
        s, t = self.start, self.time
        for d, on in enumerate(self.on_device):
            position = None
            if keep is not None:
                position = {x: p for p, x in enumerate(map(tuple, keep[d]))}
                on = sorted(on, key=lambda i: position[self.inst[i]])
                kept = [i for i in on if self.inst[i] not in free]
                for i, j in zip(kept, kept[1:]):
                    self.cons.append(f"(<= (+ {s[i]} {t[i]}) {s[j]})")
            for x in range(len(on)):
                for y in range(x + 1, len(on)):
                    i, j = on[x], on[y]
                    if (i, j) in self.before or (j, i) in self.before:
                        continue
                    if position is not None and not (self.inst[i] in free and
                                                     self.inst[j] in free):
                        self.before[(i, j)] = "true"  # (on is in the kept order)
                        if self.inst[i] in free or self.inst[j] in free:
                            self.cons.append(f"(<= (+ {s[i]} {t[i]}) {s[j]})")
                        continue
                    self.before[(i, j)] = p = f"p_{i}_{j}"
                    self.decls.append(f"(declare-const {p} Bool)")
                    self.cons.append(f"(ite {p} (<= (+ {s[i]} {t[i]}) {s[j]}) "
                                     f"(<= (+ {s[j]} {t[j]}) {s[i]}))")

    def _precedes(self, i: int, j: int) -> str:
        if (i, j) in self.before:
            return self.before[(i, j)]
        other = self.before[(j, i)]
        return "false" if other == "true" else f"(not {other})"

    def add_memory(self, initial: list[int] | None = None, labelled: bool = False) -> None:
        """Memory at every block start (deltas of the instances ordered before it)."""
        problem = self.problem
        blocks, inst = problem.blocks, self.inst
        init = initial or [0] * problem.num_devices
        for d, on in enumerate(self.on_device):
            positive = sum(max(0, blocks[inst[i][0]].memory) for i in on)
            if problem.headroom(d) is None or init[d] + positive <= problem.headroom(d):
                continue  # unlimited, or cannot overflow whatever the order
            for j in on:
                own = init[d] + blocks[inst[j][0]].memory
                earlier = []
                for i in on:
                    if i == j or blocks[inst[i][0]].memory == 0:
                        continue
                    first = self._precedes(i, j)
                    if first in ("true", "false"):  # a kept order: a constant
                        own += blocks[inst[i][0]].memory if first == "true" else 0
                    else:
                        earlier.append(f"(ite {first} {_int(blocks[inst[i][0]].memory)} 0)")
                if earlier:
                    self._add(f"(<= (+ {_int(own)} {_sum(earlier)}) "
                              f"{_int(problem.headroom(d))})", "memory" if labelled else None)
                elif own > problem.headroom(d):
                    self._add("false", "memory" if labelled else None)

    def add_objective(self, anchor: Anchor | None) -> None:
        objective = self.OBJECTIVE
        self.decls.append(f"(declare-const {objective} Int)")
        s, t = self.start, self.time
        blocks = self.problem.blocks
        if anchor is None or anchor.kind == "cooldown":
            # With data-parallel replicas a gradient block is followed by its stage's
            # synchronisation (on each device they also queue: this bound ignores that).
            sync = self.problem.sync_time
            self.cons += [_at_least(objective, s[i], t[i], 0 if blocks[b].is_forward else sync)
                          for i, (b, _) in enumerate(self.inst)]
        if anchor is None:
            return
        self.cons.append(f"(>= {objective} {_int(anchor.floor)})")
        warmup = anchor.kind == "warmup"
        for i, (b, _) in enumerate(self.inst):
            for d in blocks[b].devices:
                if d in anchor.device_time:
                    due = anchor.device_time[d]
                    self.cons.append(f"(<= (+ {s[i]} {t[i]}) (+ {objective} {_int(due)}))"
                                     if warmup else f"(>= {s[i]} {_int(due)})")
        for x, c in anchor.external.items():
            i = self.index[x]
            self.cons.append(f"(<= (+ {s[i]} {t[i]}) (+ {objective} {_int(c)}))" if warmup
                             else f"(>= {s[i]} {_int(c)})")

    def bounds(self, lower_bound: int, upper_bound: int | None,
               anchor: Anchor | None) -> tuple[int, int]:
        """The objective's range to search: from the lower bound (or the anchor's floor) to
        just below `upper_bound`, else to everything run one after another."""
        floor = anchor.floor if anchor is not None else 0
        lo = max(lower_bound, floor)
        if upper_bound is not None:
            return lo, upper_bound - 1
        waits = list(anchor.device_time.values()) if anchor is not None else []
        transfers = sum(self.problem.transfers) * len({m for _, m in self.inst})
        return lo, sum(self.time) + transfers + max([0, floor] + waits)

    def minimise(self, lo: int, hi: int, budget: Budget, *, top_first: bool = False
                 ) -> TimeOptimal:
        """Bisection on the objective with push/pop; proven unless the budget cut it short. A
        probe Z3 cannot settle with half the units left gives up on that target and the ones
        below it (no longer a proof) and tries above it with the rest. `top_first`: probe `hi`
        first (where `hi` is just below a schedule in hand, which is usually optimal: one
        unsat answer proves it, and the tightest probe is the costly one anyway)."""
        solver = self.solver()
        objective = self.variable(self.OBJECTIVE)
        best, proven = None, True
        while lo <= hi:
            if budget.spent:
                proven = False
                break
            mid = hi if top_first else (lo + hi) // 2
            top_first = False
            solver.push()
            solver.add(objective <= mid)
            left = budget.units_left()
            outcome = budget.check(solver) if left is None or mid == hi else \
                budget.slice(max(1, left // 2)).check(solver)
            if outcome == z3.sat:
                best = solver.model()
                hi = best.eval(objective).as_long() - 1
            elif outcome == z3.unsat:
                lo = mid + 1
            else:
                proven = False
                lo = mid + 1
            solver.pop()
            if outcome == z3.unknown and (mid == hi or budget.expired()):
                break
        if best is None:
            return TimeOptimal("none" if proven else "unknown")
        return self.result(best, "optimal" if proven else "feasible")

    def optimise(self, hi: int, budget: Budget) -> TimeOptimal:
        """z3.Optimize instead of bisection (for comparison)."""
        opt = self.solver(z3.Optimize(ctx=self.ctx))
        ms = budget.remaining_ms()
        if ms is not None:
            opt.set("timeout", ms)
        objective = self.variable(self.OBJECTIVE)
        opt.add(objective <= hi)
        handle = opt.minimize(objective)
        if check(opt) != z3.sat:
            return TimeOptimal("none")
        found = opt.model()
        exact = opt.lower(handle).as_long() == found.eval(objective).as_long()
        return self.result(found, "optimal" if exact else "feasible")

    def result(self, model, status: str) -> TimeOptimal:
        """Start times from a Z3 model, and per device the instances in start order."""
        blocks = self.problem.blocks
        starts = {x: model.eval(self.variable(self.start[i]), model_completion=True).as_long()
                  for i, x in enumerate(self.inst)}
        orders = tuple(tuple(sorted((x for x in self.inst if d in blocks[x[0]].devices),
                                    key=lambda x: (starts[x], x[1], x[0])))
                       for d in range(self.problem.num_devices))
        return TimeOptimal(status, model.eval(self.variable(self.OBJECTIVE)).as_long(), orders,
                           starts)


def time_optimal(problem: Problem, instances: list[tuple[int, int]], *,
                 initial_memory: list[int] | None = None, lower_bound: int = 0,
                 upper_bound: int | None = None, anchor: Anchor | None = None,
                 symmetry: bool = True, budget: Budget = Budget(),
                 method: str = "bisection", top_first: bool = False) -> TimeOptimal:
    """Least makespan of `instances` (block, micro-batch), strictly below `upper_bound`; with an
    anchor, the least warmup origin or cooldown end instead.

    Dependencies to instances outside the set count as already done (or are given by the
    anchor); memory starts at `initial_memory` per device; `symmetry` orders instances of one
    block by micro-batch (Tessel Property 4.1). status "none" means proven: no schedule below
    `upper_bound`. `top_first`: ask first whether anything is below `upper_bound` at all.
    """
    model = _TimeModel(problem, instances)
    model.add_dependencies()
    model.add_rules()
    if symmetry:
        model.add_symmetry()
    model.add_devices()
    model.add_memory(initial_memory)
    model.add_objective(anchor)
    lo, hi = model.bounds(lower_bound, upper_bound, anchor)
    if lo > hi:
        return TimeOptimal("none")
    if method == "optimize":
        return model.optimise(hi, budget)
    return model.minimise(lo, hi, budget, top_first=top_first and upper_bound is not None)


def reoptimise(problem: Problem, orders, free, *, upper_bound: int,
               budget: Budget = Budget()) -> TimeOptimal:
    """A schedule of all the plan's instances shorter than `upper_bound` (one Z3 check: any
    that is shorter, status "optimal" meaning only that one was found) when every device keeps
    `orders` (a schedule's) except among the instances in `free`, which Z3 may reorder and
    which, with everything else, may move in time: a large-neighbourhood step. "none": there
    is none in this neighbourhood."""
    everything = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    model = _TimeModel(problem, everything)
    model.add_dependencies()
    model.add_rules()
    if not problem.rules:  # a block's micro-batches stay in order (the runtime's, torch's)
        model.add_symmetry()
    model.add_devices(keep=orders, free=frozenset(map(tuple, free)))
    model.add_memory()
    model.add_objective(None)
    if upper_bound - 1 < problem.makespan_bound():
        return TimeOptimal("none")
    return model.minimise(upper_bound - 1, upper_bound - 1, budget)


def infeasibility_core(problem: Problem, *, budget: Budget = Budget()) -> list[str] | None:
    """Why no schedule of the problem's micro-batches exists: the labels ("rule K", "memory")
    of a minimal unsat core, or None when a schedule exists or Z3 could not tell in time."""
    everything = [(b.index, m) for m in range(problem.num_micro_batches) for b in problem.blocks]
    model = _TimeModel(problem, everything)
    model.add_dependencies()
    model.add_rules(labelled=True)
    model.add_devices()
    model.add_memory(labelled=True)
    solver = model.solver()
    labels = model.literals()
    literals = list(labels.values())
    # The first check sets the budget's time and unit limits; the core's checks stay under them.
    if budget.check(solver, *literals) != z3.unsat:
        return None
    core = [lit for lit in literals if any(lit.eq(c) for c in solver.unsat_core())]
    if check(solver, *core) != z3.unsat:
        core = literals
    for lit in list(core):  # deletion pass: keep only what the contradiction needs
        rest = [c for c in core if not c.eq(lit)]
        if check(solver, *rest) == z3.unsat:
            core = rest
    return [label for label, lit in labels.items() if any(lit.eq(c) for c in core)]
