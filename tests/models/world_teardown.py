"""Run under torch.distributed.run on one rank: prints the gloo threads still alive after
pyplan's world (devices.join_world) is destroyed, once torch._dynamo has been imported."""

import gc
import glob

import torch
import torch.distributed as dist

from pyplan.comm.devices import join_world


def threads() -> list[str]:
    return sorted(open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm"))


join_world("cpu")
torch.empty(4, device="meta") + 1  # imports torch._dynamo, as pyplan's meta-tensor probes do
dist.destroy_process_group()
gc.collect()
print("threads", " ".join(t for t in threads() if "gloo" in t) or "none")
