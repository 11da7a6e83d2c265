"""Exporters: a schedule (or a measured run) as a picture, a trace, or another tool's format."""

# Every format of `pyplan export` and what it writes: the one list `pyplan --help` and
# `pyplan export --help` are made from (pyplan/cli/export.py gives each its writer).
FORMATS = {
    "svg": "timeline picture",
    "chrome": "Chrome/Perfetto trace JSON",
    "torch-csv": "torch.distributed.pipelining schedule",
    "megatron-layout": "Megatron-LM's pipeline layout string",
    "megatron-args": "Megatron-LM's pretrain_gpt.py arguments",
    "torchtitan": "a Python module setting its Trainer.Config",
}
