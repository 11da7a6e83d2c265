"""Run under torch.distributed.run (gloo): every rank prints one JSON line per case, comparing
pyplan's vocabulary-parallel loss and all-reduces with the same computation in one process."""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pyplan.models.vocab import _cross_entropy_form, parallel_loss
from pyplan.models.collectives import STAR_BYTES, all_reduce_
from pyplan.comm import leave

LOSSES = {
    "mean": lambda l, t: F.cross_entropy(l.reshape(-1, l.shape[-1]), t.reshape(-1)),
    "ignore_index": lambda l, t: F.cross_entropy(l.view(-1, l.shape[-1]).float(), t.view(-1),
                                                 ignore_index=3),
    "bf16_upcast": lambda l, t: F.cross_entropy(l.flatten(0, 1).float(), t.flatten()),
    "sum": lambda l, t: F.cross_entropy(l.reshape(-1, l.shape[-1]), t.reshape(-1),
                                        reduction="sum"),
    "log_softmax_nll": lambda l, t: F.nll_loss(F.log_softmax(l, -1).reshape(-1, l.shape[-1]),
                                               t.reshape(-1)),
}


def main() -> None:
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(ranks)))
    torch.manual_seed(0)
    whole = torch.randn(3, 5, 8 * ranks)
    targets = torch.randint(0, whole.shape[-1], (3, 5))
    targets[0, :2] = 3  # some ignored under ignore_index=3
    for name, loss in LOSSES.items():
        dtype = torch.bfloat16 if name == "bf16_upcast" else torch.float32
        logits = whole.to(dtype)
        reference = logits.clone().requires_grad_()
        expected = loss(reference, targets)
        expected.backward()
        local = logits.chunk(ranks, -1)[rank].clone().requires_grad_()
        value = parallel_loss(loss)(local, targets, group)
        # pyplan's contract: the loss's gradient is seeded on the block's first rank only.
        (value if rank == 0 else value * 0).backward()
        fused = _cross_entropy_form(loss, tuple(logits.shape), dtype, tuple(targets.shape),
                                    targets.dtype) is not None
        want = reference.grad.chunk(ranks, -1)[rank]
        print(json.dumps({"case": name, "rank": rank, "fused": fused,
                          "loss": abs(value.float() - expected.float()).item(),
                          "grad": (local.grad.float() - want.float()).abs().max().item()}))
    for size in (16, STAR_BYTES // 4 + 1):  # the star, then gloo's own ring
        for op, reduce in (("sum", torch.sum), ("max", torch.amax), ("min", torch.amin)):
            parts = torch.arange(ranks * size, dtype=torch.float32).reshape(ranks, size) \
                .remainder(7.0) - 3.0 * torch.arange(ranks).unsqueeze(-1)
            found = all_reduce_(parts[rank].clone(), group, op)
            print(json.dumps({"case": f"all_reduce {op} {size}", "rank": rank,
                              "error": (found - reduce(parts, 0)).abs().max().item()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # a rank: no interpreter teardown (see pyplan.comm.leave)
