"""One process of tests/test_diag_ranks.py's random-forward test, alone or as a rank under
torchrun with gloo: a looped model that draws its initial state from the global RNG, diagnosed
unit by unit with the units spread over the ranks as `depthdiag diagnose` spreads them (unit k to
rank k % N, each rank with its own diagnostic of the snapshot); rank 0 writes every unit's NLLs
and benefit to the JSON file named by its argument."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from diag.arithmetic.engine import DiagnosticOptions, UpdateDiagnostic

VOCAB, SEQ, UNITS = 32, 8, 4


class NoisyStart(nn.Module):
    """`forward(ids, steps=K)`: K iterations of one block on a state that starts as fresh noise."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.block = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, steps):
        embedded = self.embed(input_ids)
        state = torch.randn_like(embedded)
        for _ in range(steps):
            state = torch.tanh(self.block(torch.cat((state, embedded), dim=-1)))
        return self.head(state)


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    torch.manual_seed(0)
    model = NoisyStart()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
        F.cross_entropy(model(batch[:, :-1], steps=2 + step).flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    batches = torch.randint(0, VOCAB, (UNITS, 4, SEQ + 1), generator=generator)
    eval_tokens = torch.randint(0, VOCAB, (10, SEQ + 1), generator=generator)
    options = DiagnosticOptions(update_depths=(2, 6), serving_depths=(1, 3, 6), depth_kwarg="steps", eval_batch_size=4)
    diagnostic = UpdateDiagnostic(model, optimizer, eval_tokens, options)
    units = {}
    for k in range(rank, UNITS, world_size):
        unit = diagnostic.compare(batches[k])
        units[k] = {name: unit[name].values.tolist() for name in ("nll", "nll_before", "benefit")}
    if world_size > 1:
        every = [None] * world_size
        dist.all_gather_object(every, units)
        units = {k: v for part in every for k, v in part.items()}
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump({str(k): units[k] for k in sorted(units)}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
