"""One rank of tests/test_sharded_diag.py, under torchrun with gloo: shard the case's model
with FSDP2 (every block, then the root), load the optimizer state into the sharded optimizer,
run the sharded diagnostic for every option set of the case and, on rank 0, save the units.
Every rank also records whether its shards of the weights and of the optimizer state came
back bit for bit."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from diag.arithmetic.engine import DiagnosticOptions
from diag.arithmetic.sharded import ShardedUpdateDiagnostic
from trainer.config import OptimConfig
from trainer.model import LoopedTransformer, ModelConfig
from trainer.optim import build_optimizer


def local_copies(model, optimizer):
    weights = [p.to_local().clone() for p in model.parameters()]
    state = [v.to_local().clone() for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return weights + state


def main(case_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    case = torch.load(case_path, weights_only=True)
    model = LoopedTransformer(ModelConfig(**case["model_config"]))
    model.load_state_dict(case["model_state"])
    # By hand, as a user's own code would shard it, not through trainer.distributed.shard_model.
    for block in (*model.prelude, *model.core, *model.coda):
        fully_shard(block)
    fully_shard(model)
    optimizer = build_optimizer(model, OptimConfig(**case["optim_config"]))
    set_optimizer_state_dict(model, optimizer, case["optimizer_state"], options=StateDictOptions(full_state_dict=True))
    before = local_copies(model, optimizer)
    units = []
    for options in case["options"]:
        diagnostic = ShardedUpdateDiagnostic(
            model, optimizer, case["eval_tokens"], DiagnosticOptions(**options), eval_mask=case["eval_mask"]
        )
        units.append(diagnostic.compare(case["batch"]))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, local_copies(model, optimizer)))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, unchanged)
    if dist.get_rank() == 0:
        torch.save({"units": [u.to_dict(data="list") for u in units], "unchanged": flags}, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
