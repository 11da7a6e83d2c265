"""Round 6's hostile round on round 5's features, as seeded generators by class (the house
style of tests/test_fuzz.py): each case must end in exit 0, 2 or 3 with error lines only, each
`error: ...` or `FILE:LINE:COL: error: ...`, never a traceback or a hang (a CPU-time limit per
command). `PYPLAN_FUZZ_CASES` scales the cases (a long run: PYPLAN_FUZZ_CASES=2000).

- plan: `pyplan plan` with a cluster YAML whose numbers are zeros, NaN, infinities, negative,
  tiny or huge, a config.json of an unknown family, 0 layers, a vocabulary of 1, fields of the
  wrong type, MoE sizes that do not fit, and every flag with counts that divide nothing;
- mesh: tensor-parallel styles (mesh.tensor_plan's and the model's own, packed_colwise:N of
  any N) on modules they do not fit, MoE styles on dense models and attention, with and
  without sequence parallelism, applied to tiny Hugging Face models over a fake 2-rank world;
- run flags: round 5's options of `pyplan run` (--compile, --params, --profile and
  --profile-steps, --async-save, --save, --resume, --max-time, --steps with --accumulate,
  --save-every, --keep-last) together with hostile values, read before anything launches
  (--dry-run), and a full disk (ENOSPC injected where DCP writes) during an async save;
- resume: `--resume auto` and `--resume DIR` on odd folders (step folders that are files,
  links to themselves or nowhere, records that are damaged, /dev/zero, directories, hidden
  half-renamed steps, names that are nearly steps): a CheckpointError or an OSError, each of
  which every rank reports in one line (checkpoint.agree), never another exception.
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


# ---------------------------------------------------------------- mesh styles

MESH_FAMILIES = ["llama", "mixtral", "gpt2", "qwen3", "qwen2_moe"]
ODD_STYLES = ["packed_colwise:3", "packed_colwise:0", "packed_colwise:-1", "packed_colwise:x",
              "packed_colwise:7", "colwise:2", "nope", ""]


def test_mesh_styles_on_modules_they_do_not_fit_are_one_line(fake_world):
    """Each case: parallelize (what a rank of `pyplan run` does with the plan's mesh) returns
    or raises a one-line PlanError. Found: packed_colwise:x raised ValueError, :0 a
    ZeroDivisionError, a width the tensor ranks (times a packed layer's parts) do not divide
    a RuntimeError of torch's unflatten; each is one line naming the module now. (A style that
    fits its module but not its neighbours, colwise_rep before a row-wise layer, fails in the
    first forward: one line from `pyplan run` naming the rank and instruction, exit 1.)"""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import hf

    from pyplan.errors import PlanError
    from pyplan.mesh.tensor import STYLES, parallelize, tensor_plan

    hf.transformers_quiet()
    rng = random.Random(SEED)
    failures, outcomes = [], {"built": 0, "refused": 0}
    for case in range(max(CASES // 15, 12)):
        family = rng.choice(MESH_FAMILIES)
        torch.manual_seed(0)
        model = hf.build(family, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        names = [n for n, _ in model.named_modules() if n]
        overrides = {}
        for _ in range(rng.randint(1, 3)):
            parts = rng.choice(names).split(".")
            if rng.random() < 0.3:
                parts[rng.randrange(len(parts))] = "*"
            overrides[".".join(parts)] = rng.choice(list(STYLES) + ODD_STYLES)
        try:
            parallelize(model, tensor_plan(model, overrides), fake_world,
                        where="p.yaml mesh", sequence=rng.random() < 0.5)
            outcomes["built"] += 1
        except PlanError as exc:
            outcomes["refused"] += 1
            if "\n" in str(exc) or not exc.message.startswith("p.yaml mesh: "):
                failures.append((case, family, overrides, str(exc)))
        except Exception as exc:  # noqa: BLE001 - what the test reports
            failures.append((case, family, overrides, f"{type(exc).__name__}: {exc}"))
    print(f"mesh styles: {outcomes}")
    assert not failures, failures[:3]


# ---------------------------------------------------------------- pyplan run's round-5 flags

RUN_VALUES = {
    "--compile": ["inductor", "aot_eager", "nope", "", "eager", "x" * 300],
    "--params": ["fp32", "bf16", "fp16", "x"],
    "--dtype": ["fp32", "bf16", "fp16"],
    "--profile": ["prof", "afile", "/dev/null", "adir", "prof/deep/er", "", "ck"],
    "--profile-steps": ["1", "0", "-1", "1..0", "x", "99999999999", "1,2", "2..3", "1e9",
                        "nan"],
    "--async-save": None,
    "--save": ["ck", "afile", "/dev/null", "adir", "", "prof"],
    "--resume": ["auto", "ck", "afile", "/dev/null", "", "nope"],
    "--max-time": ["0", "-1", "nan", "1e400", "1d", "10:00", "1h30m", "3600", "1e-9", "inf",
                   "x"],
    "--steps": ["0", "1", "-1", "1e9", "99999999999", "x"],
    "--iterations": ["0", "1", "3"],
    "--accumulate": ["0", "1", "2", "1000000", "1000001", "-1", "x"],
    "--save-every": ["0", "1", "-1"],
    "--keep-last": ["0", "1", "-1"],
    "--eval-every": ["0", "1"],
}


def test_run_flags_of_round_5_together_are_read_in_one_line(tmp_path, monkeypatch):
    from conftest import PLANS

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    rng = random.Random(SEED)
    failures, codes = [], {}
    for case in range(max(CASES // 3, 40)):
        args = ["run", PLANS / "transformer-vshape.resolved.yaml", "--dry-run"]
        for flag in rng.sample(sorted(RUN_VALUES), rng.randint(1, 5)):
            values = RUN_VALUES[flag]
            args += [flag] if values is None else [flag, rng.choice(values)]
        code, err = _run(args)
        codes[code] = codes.get(code, 0) + 1
        if not _clean(code, err) or code == 3:
            failures.append((case, [str(a) for a in args[3:]], code, err[-600:]))
    print(f"run flags: {codes}")
    assert not failures, failures[:3]


# ---------------------------------------------------------------- --resume on odd folders

RECORD = {"format": 1, "step": 4, "batches": 4, "plan": "two", "seed": 0}
STEP_NAMES = ["step-00000004", "step-00000002", "step-99999999999999999999",
              ".step-00000004.partial", ".step-00000004.replaced", "step-0000004", "stepx",
              "step-00000004\n", "step-\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff14"]
RECORD_TEXTS = [b"{", b"[]", b"\0\0", b"x" * 10, b"\xff\xfe", b'{"format": 1, "step": NaN}']


def _odd_record(rng: random.Random) -> bytes:
    record = dict(RECORD)
    for _ in range(rng.randint(0, 3)):
        record[rng.choice(["format", "step", "batches", "plan", "seed", "training", "history",
                           "plan_sha256", "optimizer"])] = rng.choice(NUMBERS + WRONG)
    return json.dumps(record).encode()


def _odd_folder(rng: random.Random, root: Path) -> None:
    for _ in range(rng.randint(0, 4)):
        path = root / rng.choice(STEP_NAMES)
        if path.exists() or path.is_symlink():
            continue
        kind = rng.choice(["file", "dir", "record", "record", "record directory", "link",
                           "loop", "dangling", "zeros"])
        if kind == "file":
            path.write_text("x")
        elif kind == "link":
            path.symlink_to(root)
        elif kind == "loop":
            path.symlink_to(path)
        elif kind == "dangling":
            path.symlink_to(root / "nowhere")
        else:
            path.mkdir()
            if kind == "record":
                (path / "pyplan.json").write_bytes(rng.choice([_odd_record(rng),
                                                               *RECORD_TEXTS]))
                if rng.random() < 0.5:
                    (path / ".metadata").write_text("x")
            elif kind == "record directory":
                (path / "pyplan.json").mkdir()
            elif kind == "zeros":
                (path / "pyplan.json").symlink_to("/dev/zero")


def test_resume_on_odd_folders_is_a_checkpoint_error_or_an_os_error(tmp_path):
    import shutil

    from pyplan.errors import PyplanError
    from pyplan.train import checkpoint

    rng = random.Random(SEED)
    failures, outcomes = [], {"found": 0, "none": 0, "refused": 0}
    for case in range(max(CASES // 6, 30)):
        root = tmp_path / f"ck{case}"
        root.mkdir()
        _odd_folder(rng, root)
        target = rng.choice([root, root / "step-00000004", root / "nope", Path("/dev/null"),
                             root / "step-00000004" / "pyplan.json"])
        for look in (checkpoint.newest, checkpoint.named):
            try:
                outcomes["none" if look(target) is None else "found"] += 1
            except (PyplanError, OSError):
                outcomes["refused"] += 1
            except BaseException as exc:  # noqa: BLE001 - what the test reports
                failures.append((case, look.__name__, sorted(p.name for p in root.iterdir()),
                                 f"{type(exc).__name__}: {exc}"))
        shutil.rmtree(root)
    print(f"resume folders: {outcomes}")
    assert not failures, failures[:3]


# ---------------------------------------------------------------- a full disk under --save

FULL_DISK = """\
import os

if os.environ.get("PYPLAN_TEST_ENOSPC"):  # RANK:TEXT: that rank's disk is full for files
    import errno                          # whose path holds TEXT (a step's folder)

    import torch.distributed.checkpoint.filesystem as filesystem

    rank, _, text = os.environ["PYPLAN_TEST_ENOSPC"].partition(":")
    write = filesystem._write_item

    def full(transforms, stream, *args, **kwargs):
        if os.environ.get("RANK") == rank and text in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(transforms, stream, *args, **kwargs)

    filesystem._write_item = full
"""


@pytest.mark.torchrun
@pytest.mark.slow  # (as --fail-at RANK:save's failing write in tests/test_run_flags.py)
def test_a_full_disk_during_an_async_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """ENOSPC where DCP writes rank 1's part of step 2 (injected through a sitecustomize in
    the launcher's and so the workers' interpreter: no tmpfs to fill here): every rank says
    so in one line, exit 2; the temporary folder goes, step 1 stays (with --async-save the
    failure is seen at a later step's end, or at the run's last). A synchronous save's full
    disk: tests/test_checkpoints.py (a file-size limit)."""
    from test_checkpoints import launch, listing, solved

    solved(tmp_path, "two", [["0"], ["1", "2", "3", "4", "5"]])
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FULL_DISK)
    path = os.pathsep.join(filter(None, [str(tmp_path / "inject"),
                                         os.environ.get("PYTHONPATH")]))
    code, out, err = launch(tmp_path, "two.resolved.yaml", 2, "--iterations", 3, "--save",
                            "ck", "--save-every", 1, "--async-save",
                            env={"PYTHONPATH": path, "PYPLAN_TEST_ENOSPC": "1:step-00000002"})
    assert code == 2 and len(err) == 2 and len(set(err)) == 1, err
    assert err[0] == ("error: cannot write the checkpoint of step 2 in ck: rank 1: No space "
                      "left on device (hint: ck/step-00000001 is intact)"), err
    assert listing(tmp_path / "ck") == ["step-00000001"]


def test_the_partition_api_takes_the_clis_optimizer_names_only():
    """pyplan.partition_model(optimizer="adam") raised KeyError deep in the weights' bytes (the
    CLI mapped adam to adamw; it refuses adam now, with a hint, as pyplan run does)."""
    from pyplan.errors import PlanError
    from pyplan.measure.partitioner import partition_model

    with pytest.raises(PlanError, match="optimizer must be one of sgd, adamw, got 'adam'"):
        partition_model("m:f", "m:d", "m:l", devices=2, output="p.yaml", optimizer="adam")
    code, err = _run(["partition", "m:f", "--data", "m:d", "--loss", "m:l", "--devices", "2",
                      "--optimizer", "adam", "-o", "p.yaml"])
    assert (code, err) == (2, "error: --optimizer 'adam' is not one of sgd, adamw (hint: adamw: "
                           "torch.optim.AdamW, Adam with decoupled weight decay (--weight-decay 0 "
                           "makes it Adam); pyplan has no other Adam)\n")
