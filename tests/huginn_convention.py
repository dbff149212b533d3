"""A tiny model that follows the Huginn conventions, written here from the published
description of recurrent-depth models (a prelude embeds the tokens, one recurrent block is
applied to a latent state with the embedding injected at every iteration, a coda reads the
state out; the state starts as noise). Its forward is what the diagnostic meets in such a model:

- `num_steps` an int: that many iterations, all WITHOUT gradient (how such models serve);
- `num_steps` a pair (n_without, n_with): n_without iterations without gradient, then n_with
  with gradient (how they train, with truncated backprop);
- `num_steps` None: a depth sampled from the global RNG, as in training;
- a random initial state drawn from the global RNG on every forward, train and eval alike;
- `**kwargs`, so a keyword it does not know is swallowed;
- an output object with `.logits`.

Token mixing is a causal running mean instead of attention: the conventions are the point."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class Output:
    logits: torch.Tensor


def causal_mean(x: torch.Tensor) -> torch.Tensor:
    """Position t gets the mean of positions <= t: [B, T, D] -> [B, T, D]."""
    counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
    return x.cumsum(1) / counts


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(causal_mean(self.norm(x)))
        return x + self.mlp(self.norm(x))


class HuginnConvention(nn.Module):
    def __init__(self, vocab: int = 48, d: int = 24, init_scale: float = 1.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.prelude = Layer(d)
        self.adapter = nn.Linear(2 * d, d)  # [state, embedding] -> state
        self.core = Layer(d)
        self.coda = Layer(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.init_scale = init_scale

    def iterate(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.core(self.adapter(torch.cat((state, embedded), dim=-1)))

    def initial_state(self, embedded: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(embedded) * self.init_scale

    def forward(self, input_ids: torch.Tensor, num_steps=None, **kwargs) -> Output:
        embedded = self.prelude(self.embed(input_ids))
        if num_steps is None:
            without_grad, with_grad = int(torch.randint(0, 4, ())), int(torch.randint(1, 5, ()))
        elif isinstance(num_steps, (tuple, list)):
            without_grad, with_grad = (int(n) for n in num_steps)
        else:
            without_grad, with_grad = int(num_steps), 0
        state = self.initial_state(embedded)
        with torch.no_grad():
            for _ in range(without_grad):
                state = self.iterate(state, embedded)
        for _ in range(with_grad):
            state = self.iterate(state, embedded)
        return Output(logits=self.head(self.norm(self.coda(state))))
