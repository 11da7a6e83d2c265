"""Direct calls into the extension with arguments it cannot hold: every one raises a Python
error (ValueError or IndexError) instead of crashing the interpreter or exhausting memory."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

G2 = "g=_core.Graph(1,[_core.Block('a',1,0,[0]),_core.Block('b',1,0,[0])],[(0,1)]); "

CASES = {
 "empty-graph-evaluate": "g=_core.Graph(1,[],[]); print(_core.evaluate(g,[[]]).ok)",
 "orders-bad-block": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate(g,[[(5,0)]]).ok)",
 "orders-neg-mb": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate(g,[[(0,-3)]]).ok)",
 "orders-huge-mb": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate(g,[[(0,2**30)]]).ok)",
 "orders-too-many-devices": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate(g,[[(0,0)],[(0,0)]]).ok)",
 "orders-too-few-devices": "g=_core.Graph(2,[_core.Block('a',1,0,[0,1])],[]); print(_core.evaluate(g,[[(0,0)]]).ok)",
 "complete-neg": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate(g,[[(0,0)]],complete_micro_batches=-5).ok)",
 "complete-huge": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate(g,[[(0,0)]],complete_micro_batches=2**31-1).ok)",
 "initial-mem-len": "g=_core.Graph(2,[_core.Block('a',1,0,[0,1])],[]); print(_core.evaluate(g,[[(0,0)],[(0,0)]],initial_memory=[1]).ok)",
 "huge-time": "g=_core.Graph(1,[_core.Block('a',2**62,0,[0]),_core.Block('b',2**62,0,[0])],[(0,1)]); print(_core.evaluate(g,[[(0,0),(1,0)]]).makespan)",
 "huge-devices": "g=_core.Graph(2**30,[],[]); print(g.num_devices)",
 "neg-devices": "g=_core.Graph(-1,[],[]); print(g)",
 "eval-repetend-len": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate_repetend(g,[0,0,0],[[0]]).feasible)",
 "eval-repetend-bad-block": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate_repetend(g,[0],[[7]]).feasible)",
 "eval-repetend-neg-index": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate_repetend(g,[-4],[[0]]).feasible)",
 "eval-repetend-huge-index": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.evaluate_repetend(g,[2**31-1],[[0]]).feasible)",
 "list-schedule-len": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.list_schedule_repetend(g,[0,1,2]).feasible)",
 "modulo-neg": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.modulo_schedule(g,-1,-1,-1,-1))",
 "modulo-huge-nr": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.modulo_schedule(g,1,2**31-1,-1,100))",
 "search-neg": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.search_repetends(g,-1,-1,0,0,10,0.0))",
 "search-huge-nr": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.search_repetends(g,10**6,-1,0,0,10,0.1))",
 "rank-neg": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.rank_repetends(g,-1,-1,1,-5,-1,-1,0.0))",
 "periodic-neg-n": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); r=_core.list_schedule_repetend(g,[0]); print(_core.periodic_orders(g,r,-3))",
 "periodic-huge-n": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); r=_core.list_schedule_repetend(g,[0]); print(len(_core.periodic_orders(g,r,2**31-1)))",
 "periodic-makespan-neg": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); r=_core.list_schedule_repetend(g,[0]); print(_core.periodic_makespan(g,r,-3,-1))",
 "extend-neg": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); r=_core.list_schedule_repetend(g,[0]); print(_core.extend(g,[[]],r,[[]],-3))",
 "extend-mismatch-graph": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); g2=_core.Graph(1,[_core.Block('a',1,0,[0]),_core.Block('b',1,0,[0])],[]); r=_core.list_schedule_repetend(g2,[0,0]); print(_core.extend(g,[[]],r,[[]],4))",
 "from-starts-len": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.repetend_from_starts(g,[0,1,2],2))",
 "from-starts-zero-period": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.repetend_from_starts(g,[0],0))",
 "warmup-neg": "print(_core.warmup_blocks([-5, 2**31-1]))",
 "cooldown-neg": "print(_core.cooldown_blocks([-5, 3]))",
 "memory-fits-mismatch": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); g2=_core.Graph(3,[_core.Block('a',1,0,[2])],[]); r=_core.list_schedule_repetend(g2,[0]); print(_core.memory_fits(r,1))",
 "makespan-bound-neg": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(g.makespan_bound(-5, -7))",
 "rule-bad": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[],[_core.OrderRule(0,2**31-1,0,-2**31,0)]); print(_core.evaluate(g,[[(0,0),(0,1)]]).ok)",
 "longest-paths": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.longest_paths(g, [5]))",
 "delays-length": "g=_core.Graph(1,[_core.Block('a',1,0,[0]),_core.Block('b',1,0,[0])],[(0,1)],[],[],[1,2]); print(g)",
 "delay-negative": "g=_core.Graph(1,[_core.Block('a',1,0,[0]),_core.Block('b',1,0,[0])],[(0,1)],[],[],[-1]); print(g)",
 "delay-huge": "g=_core.Graph(1,[_core.Block('a',1,0,[0]),_core.Block('b',1,0,[0])],[(0,1)],[],[],[2**62]); print(g.critical_path())",
 "phase-huge-n": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.list_schedule_phase(g,[(0,0)],[0],[0],2**31-1))",
 "phase-neg-n": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.list_schedule_phase(g,[(0,0)],[],[0],-3))",
 "phase-short-start": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.list_schedule_phase(g,[(0,0)],[0],[0],10**7))",
 "phase-bad-instance": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.list_schedule_phase(g,[(0,-1)],[0],[0],1))",
 "phase-huge-time": "g=_core.Graph(1,[_core.Block('a',1,0,[0])],[]); print(_core.list_schedule_phase(g,[(0,0)],[-2**63],[0],1))",
 # every index a call is given is checked (these read past the end or divided by zero)
 "successors-out-of-range": G2 + "print(g.successors(5))",
 "successors-negative": G2 + "print(g.successors(-1))",
 "predecessors-out-of-range": G2 + "print(g.predecessors(2))",
 "blocks-on-negative": G2 + "print(g.blocks_on(-1))",
 "blocks-on-out-of-range": G2 + "print(g.blocks_on(1))",
 "repetend-bound-increasing": G2 + "print(_core.repetend_bound(g,[0,1]))",
 "repetend-bound-negative": G2 + "print(_core.repetend_bound(g,[-5,-9]))",
 "repetend-bound-huge": G2 + "print(_core.repetend_bound(g,[2**31-1,0]))",
 "enumerator-huge": G2 + "print(list(_core.RepetendEnumerator(g,2**31-1))[:3])",
 "makespan-bound-huge": G2 + "print(g.makespan_bound(2**31-1))",
 "from-starts-span": G2 + "print(_core.repetend_from_starts(g,[0,2**62],1).indices)",
 "from-starts-many-periods": G2 + "print(_core.repetend_from_starts(g,[0,10**6],1).indices)",
 "bubble-rate-other-graph": "g=_core.Graph(2,[_core.Block('a',1,0,[0]),_core.Block('b',1,0,[1])],[(0,1)]); r=_core.list_schedule_repetend(g,[0,0]); print(r.bubble_rate(_core.Graph(1,[_core.Block('a',1,0,[0])],[])))",
 "repetend-of-a-graph-like-it": "g=_core.Graph(2,[_core.Block('a',1,0,[0]),_core.Block('b',1,0,[1])],[(0,1)]); h=_core.Graph(2,[_core.Block('a',1,0,[1]),_core.Block('b',1,0,[0])],[]); r=_core.list_schedule_repetend(g,[0,0]); print(_core.periodic_orders(h,r,3))",
 "memory-sums-beyond-int64": "g=_core.Graph(1,[_core.Block('a',1,2**60,[0]),_core.Block('b',1,2**60,[0])],[],[],[2**60]); print(_core.evaluate(g,[[[(0,m),(1,m)][i] for m in range(5) for i in (0,1)]]).peak_memory)",
}

ACCEPTED = {"memory-fits-mismatch"}

RUNNER = """
import json, sys
from pyplan import _core
results = {}
for name, code in json.loads(sys.argv[1]).items():
    try:
        exec(code, {"_core": _core, "print": lambda *a: None})
        results[name] = "returned"
    except (ValueError, IndexError, TypeError) as exc:
        results[name] = type(exc).__name__
    print(name, file=sys.stderr, flush=True)  # the last name shows where a crash happened
print(json.dumps(results))
"""


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))


def test_bad_arguments_raise_python_errors(tmp_path):
    # (outside the source tree, which would shadow an installed, compiled pyplan)
    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(CASES)],
                            capture_output=True, text=True, timeout=120, preexec_fn=_limited,
                            cwd=tmp_path)
    assert result.returncode == 0, f"crashed after: {result.stderr.splitlines()[-1:]}"
    outcome = json.loads(result.stdout)
    for name, what in outcome.items():
        if name in ACCEPTED:
            assert what == "returned", name
        else:
            assert what in ("ValueError", "IndexError", "TypeError"), (name, what)
