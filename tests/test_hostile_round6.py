"""Round 6's hostile round on round 5's features, as seeded generators by class (the house
style of tests/test_fuzz.py): each case must end in exit 0, 2 or 3 with error lines only, each
`error: ...` or `FILE:LINE:COL: error: ...`, never a traceback or a hang (a CPU-time limit per
command). `PYPLAN_FUZZ_CASES` scales the cases (a long run: PYPLAN_FUZZ_CASES=2000).

- plan: `pyplan plan` with a cluster YAML whose numbers are zeros, NaN, infinities, negative,
  tiny or huge, a config.json of an unknown family, 0 layers, a vocabulary of 1, fields of the
  wrong type, MoE sizes that do not fit, and every flag with counts that divide nothing.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import re
import signal
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from pyplan.cli.main import main

CASES = int(os.environ.get("PYPLAN_FUZZ_CASES", "300"))
SEED = int(os.environ.get("PYPLAN_FUZZ_SEED", "0"))
CASE_SECONDS = 20  # CPU seconds per command
ERROR = re.compile(r"^(\S+:\d+:\d+: )?(error|warning): ")
PRESETS = Path(__file__).resolve().parents[1] / "pyplan" / "cluster" / "presets"


class _Hang(BaseException):
    pass


def _on_limit(signum, frame):
    raise _Hang


def _run(args) -> tuple[object, str]:
    """(exit code, or "hang" or "traceback", stderr) of `pyplan ARGS`, in this process."""
    err = io.StringIO()
    previous = signal.signal(signal.SIGPROF, _on_limit)
    signal.setitimer(signal.ITIMER_PROF, CASE_SECONDS)
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main([str(a) for a in args])
    except _Hang:
        return "hang", err.getvalue()
    except SystemExit as exc:
        return f"SystemExit({exc.code})", err.getvalue()
    except BaseException:  # noqa: BLE001 - what the test reports
        return "traceback", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
    return code, err.getvalue()


def _clean(code, err: str) -> bool:
    lines = [line for line in err.splitlines() if line]
    return code in (0, 2, 3) and len(lines) <= 10 and all(ERROR.match(x) for x in lines) \
        and (code == 0 or any(line.startswith(("error", "warning")) or ": error: " in line
                              for line in lines))


# ---------------------------------------------------------------- pyplan plan

NUMBERS = [0, -1, 1, 2, 3, 7, float("nan"), float("inf"), -float("inf"), 1e308, 1e-308,
           2**63, 10**40, 0.5, -0.5]
WRONG = ["x", "", None, [], {}, True, [[1]], {"a": 1}]
# What YAML reads as a float only as text in the file (.nan, .inf), and numbers as text.
TEXTS = [".nan", ".inf", "-.inf", "1e308", "1.0e-308", "99999999999999999999", "x", "null",
         "[]", "{}", "true", "0", "-1", "1.0e-9", "0.0009"]
LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
             max_position_embeddings=2048)
MIXTRAL = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
CONFIG_KEYS = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim",
               "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "tie_word_embeddings", "n_layer", "decoder_sparse_step", "mlp_only_layers",
               "max_position_embeddings"]
FAMILIES = ["bert", "unknown_family", "gpt2", "mixtral", "mamba", "x" * 500, "", "llama"]
FLAGS = ["--gpus", "--tp", "--pp", "--dp", "--vpp", "--micro-batch", "--top"]
COUNTS = ["0", "1", "2", "3", "5", "7", "-1", "1e9", "nan", "64", "4096", "x", "1000001"]


def _leaves(doc, path=()):
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _leaves(value, path + (key,))
    else:
        yield path


def _set(doc, path, value) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _plan_case(rng: random.Random, folder: Path) -> tuple[str, list]:
    """One `pyplan plan` command line over a mutated cluster file and config.json."""
    kind = rng.choice(["cluster", "cluster-text", "config", "family", "flags", "mixed"])
    cluster = yaml.safe_load((PRESETS / rng.choice(["dgx-h100.yaml",
                                                    "dgx-a100-80gb.yaml"])).read_text())
    cluster["nodes"] = rng.choice([1, 2, 4])
    config = copy.deepcopy(rng.choice([LLAMA, MIXTRAL]))
    if kind in ("cluster", "mixed"):
        for _ in range(rng.randint(1, 3)):
            _set(cluster, rng.choice(list(_leaves(cluster))), rng.choice(NUMBERS + WRONG))
    text = yaml.safe_dump(cluster)
    if kind == "cluster-text":  # a number replaced in the text: .nan, .inf, 1e-9 as YAML has it
        numbers = list(re.finditer(r"(?<=: )-?[0-9][0-9.e+]*(?=\n)", text))
        spot = rng.choice(numbers)
        text = text[:spot.start()] + rng.choice(TEXTS) + text[spot.end():]
    if kind in ("config", "mixed"):
        for _ in range(rng.randint(1, 3)):
            config[rng.choice(CONFIG_KEYS[1:])] = rng.choice(NUMBERS + WRONG)
    if kind == "family":
        config["model_type"] = rng.choice(FAMILIES)
        config[rng.choice(["num_hidden_layers", "vocab_size"])] = rng.choice([0, 1])
    (folder / "c.yaml").write_text(text)
    (folder / "config.json").write_text(json.dumps(config))  # (NaN as JSON's NaN)
    args = ["plan", folder / "config.json", "--cluster", folder / "c.yaml",
            "--global-batch", rng.choice(["8", "1", "0", "3", "1024", "1000000000"]),
            "--seq", rng.choice(["128", "1", "0", "7", "2147483648"])]
    if kind in ("flags", "mixed"):
        for flag in rng.sample(FLAGS, rng.randint(1, 4)):
            args += [flag, rng.choice(COUNTS)]
        for flag, values in (("--schedule", ["zb-v", "interleaved-1f1b", "search", "gpipe"]),
                             ("--recompute", ["none", "selective", "full"]),
                             ("--dtype", ["fp16", "fp32"])):
            if rng.random() < 0.3:
                args += [flag, rng.choice(values)]
        args += [f for f in ("--no-flash-attention", "--json", "--no-sequence-parallel",
                             "--distributed-optimizer") if rng.random() < 0.2]
    return kind, args


def test_plan_takes_every_hostile_cluster_model_and_flag_in_one_line(tmp_path):
    rng = random.Random(SEED)
    failures, kinds = [], {}
    for case in range(max(CASES // 10, 20)):
        kind, args = _plan_case(rng, tmp_path)
        kinds[kind] = kinds.get(kind, 0) + 1
        code, err = _run(args)
        if not _clean(code, err):
            failures.append((case, kind, [str(a) for a in args[4:]], code, err[-800:],
                             (tmp_path / "config.json").read_text()[:300]))
    print(f"pyplan plan: {sum(kinds.values())} cases {kinds}")
    assert not failures, failures[:3]


@pytest.mark.parametrize("edit, message", [
    (("gbs_per_gpu: 50", "gbs_per_gpu: .nan"),
     r"c.yaml:\d+:\d+: error: network.gbs_per_gpu must be a finite number, got nan"),
    (("memory_gib: 80", "memory_gib: .inf"),
     r"c.yaml:\d+:\d+: error: gpu.memory_gib must be a finite number, got inf"),
    (("link_gbs: 450", "link_gbs: 1.0e-308"), r"c.yaml:\d+:\d+: error: .*0.001"),
])
def test_a_cluster_number_that_is_not_a_size_is_refused_where_it_is(tmp_path, edit, message):
    """Found by the generator: NaN and infinities passed the schema's bounds (the costs then
    raised ValueError: cannot convert float NaN to integer), and a bandwidth of 1e-308
    overflowed the times (OverflowError)."""
    text = (PRESETS / "dgx-h100.yaml").read_text()
    assert edit[0] in text
    (tmp_path / "c.yaml").write_text(text.replace(edit[0], edit[1]) + "nodes: 1\n")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    code, err = _run(["plan", tmp_path / "config.json", "--cluster", tmp_path / "c.yaml",
                      "--global-batch", "8", "--seq", "128"])
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(message, err), err


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": "x"}, "transformers cannot read this config: Validation error for field "
     "'hidden_size': TypeError: Field 'hidden_size' expected int, got str (value: 'x')"),
    ({"model_type": "llama", "num_local_experts": float("nan")},
     "the number of experts must be an integer from 0"),
    ({"num_experts_per_tok": 9}, "9 experts per token of 4 experts"),
    ({"num_hidden_layers": 10**8}, "num_hidden_layers must be an integer from 1 to 100,000"),
    ({"model_type": "whatever"}, "model_type 'whatever' is not a family pyplan plan knows"),
])
def test_a_config_that_is_not_a_model_is_one_line(tmp_path, changes, message):
    """Found by the generator: transformers' strict config classes raise their own error type
    (a traceback), MoE sizes were not checked (NaN experts: ValueError in the costs; a string:
    TypeError), a huge layer count looped for ever, and an unknown family's refusal listed all
    ~900 of transformers' families."""
    (tmp_path / "c.yaml").write_text((PRESETS / "dgx-h100.yaml").read_text() + "nodes: 1\n")
    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL, **changes}))
    code, err = _run(["plan", tmp_path / "config.json", "--cluster", tmp_path / "c.yaml",
                      "--global-batch", "8", "--seq", "128"])
    assert code == 2 and err.count("\n") == 1 and len(err) < 600, err
    assert message in err, err
