"""Middle-loop looped transformer (Geiping et al. 2025; Saunshi et al. 2025).

    input_ids [B, T]
      -> embed                                   e0    [B, T, d]
      -> prelude (n_prelude blocks)              e     [B, T, d]
      -> state s_0 (zeros, or seeded noise)            [B, T, d]
      -> K times: s_k = core(inject(s_{k-1}, e))       [B, T, d]
      -> norm -> coda (n_coda blocks) -> norm -> lm head   logits [B, T, V]

One shared core is applied K times (the depth), so one set of weights serves
at any depth. `nll_by_depth` reads out after every requested iteration of a
single pass, which is how every serving depth is evaluated at the cost of the
deepest one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import InputError

IGNORE_INDEX = -1
"""Target value that `nll_by_depth` and the training loss skip."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    """Number of token ids the embedding and the head cover."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables are built for."""
    d_model: int = 128
    """Residual stream width."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""
    n_prelude: int = 1
    """Untied blocks applied once before the loop."""
    n_core: int = 2
    """Blocks in the shared recurrent core, applied K times."""
    n_coda: int = 1
    """Untied blocks applied once after the loop."""
    d_ff: int = 0
    """MLP hidden width; 0 picks 4*d_model (gelu) or the 8/3*d_model rounded to 64 of LLaMA (swiglu)."""
    mlp: str = "gelu"
    """'gelu' or 'swiglu'."""
    norm: str = "pre"
    """'pre' (RMSNorm before each sublayer) or 'sandwich' (also after, as in Huginn)."""
    injection: str = "concat"
    """'concat': state = adapter(cat(state, e)), a linear map 2d -> d; 'add': state + e."""
    adapter_init: str = "sum"
    """Initial adapter for injection='concat': 'sum' gives adapter(cat(state, e)) = state + e,
    so the state carries through the iterations; 'input' gives e, the state path starting
    at zero. Both pass the prelude output through at the first iteration from a zero state.
    With 'input' a fixed-depth model can learn to ignore the state and stays depth-robust;
    with 'sum' it specialises to its training depth, as the paper's models do."""
    init_state: str = "zeros"
    """'zeros' (deterministic) or 'noise' (Gaussian, seeded by state_noise_seed, so still deterministic)."""
    state_noise_std: float = 1.0
    """Standard deviation of the initial state when init_state='noise'."""
    state_noise_seed: int = 0
    """Seed of the initial-state noise: every call draws the same noise, so depths stay pure functions."""
    backprop_depth: int = 0
    """Backpropagate through only the last this-many iterations (Huginn uses 8); 0 means full backprop."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the lm head."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of linear and embedding weights at initialisation."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "max_seq_len", "d_model", "n_heads", "n_core")
        for name in positive:
            if getattr(self, name) < 1:
                raise InputError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda", "d_ff", "backprop_depth"):
            if getattr(self, name) < 0:
                raise InputError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise InputError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}")
        if (self.d_model // self.n_heads) % 2:
            raise InputError("model.d_model / model.n_heads must be even for rotary embeddings")
        choices = {
            "mlp": ("gelu", "swiglu"),
            "norm": ("pre", "sandwich"),
            "injection": ("concat", "add"),
            "adapter_init": ("sum", "input"),
            "init_state": ("zeros", "noise"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"model.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.state_noise_std < 0 or self.init_std <= 0 or self.norm_eps <= 0:
            raise InputError("model.state_noise_std must be >= 0; init_std and norm_eps > 0")

    @property
    def ff_width(self) -> int:
        """The MLP hidden width actually used."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**values)


class RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32: under bf16 autocast its input arrives in bf16 while
    its weight stays fp32, a mix that has no fused kernel and loses precision. Under FSDP2's
    bf16 mixed precision the weight arrives in bf16 instead (an fp32 weight's .float() is itself)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding over interleaved pairs (x[2i], x[2i+1]) of each head.

    Written as x * cos + swap(x) * sin with the tables repeated per pair, where swap
    exchanges the two entries of every pair; sin carries the sign (-sin, +sin). This is
    the same arithmetic as (x1 cos - x2 sin, x1 sin + x2 cos), to the bit, in four
    kernels instead of six plus a stack, for queries and keys together."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # [T, Dh/2]
        # Non-persistent: derived from the config, so never part of a checkpoint.
        self.register_buffer("cos", angles.cos().repeat_interleave(2, dim=-1), persistent=False)  # [T, Dh]
        self.register_buffer(
            "sin", torch.stack((-angles.sin(), angles.sin()), dim=-1).flatten(-2), persistent=False
        )  # [T, Dh]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., T, Dh]: queries and keys together, so both take one pass
        T = x.shape[-2]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        swapped = torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return x * cos + swapped * sin


EXPLICIT_ATTENTION_MAX_LEN = 64
"""Longest sequence for which bf16 attention on the CPU is written out as two matmuls
and a softmax rather than calling a fused kernel (see `_cpu_low_precision_attention`)."""


def _cpu_low_precision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of bf16 q, k, v [B, H, T, Dh] on the CPU, in the fastest form measured.

    torch's CPU flash attention is about 3x slower (forward and backward) in bf16 than in
    fp32, so longer sequences run it in fp32. Up to EXPLICIT_ATTENTION_MAX_LEN tokens the
    written-out form is faster still (forward+backward at [32, 4, 64, 32], one thread:
    about 5 ms, against 6 ms for fp32 flash and 18 ms for bf16 flash; at 128 tokens flash
    wins), and torch.compile fuses its scaling, mask and softmax. The softmax runs in fp32, on
    scores the first matmul returns in bf16; its weights go into the second matmul in bf16,
    as autocast would round them."""
    T = q.shape[-2]
    if T > EXPLICIT_ATTENTION_MAX_LEN:
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(v.dtype)
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, H, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return weights.to(v.dtype) @ v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        B, T, d = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)  # [3, B, H, T, Dh]
        q, k = rotary(qkv[:2])  # [B, H, T, Dh] each
        v = qkv[2]
        if v.device.type == "cpu" and v.dtype != torch.float32:
            # The test is on v, not x: autocast makes qkv bf16 whatever the residual stream's dtype.
            y = _cpu_low_precision_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        width = cfg.ff_width
        self.up = nn.Linear(cfg.d_model, width, bias=False)
        self.gate = nn.Linear(cfg.d_model, width, bias=False) if self.swiglu else None
        self.down = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        sandwich = cfg.norm == "sandwich"
        self.attn_post_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps) if sandwich else nn.Identity()
        self.mlp_post_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps) if sandwich else nn.Identity()

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        return self.feed_forward(self.attend(x, rotary))

    def attend(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """The attention sublayer with its residual: x [B, T, d] -> [B, T, d]."""
        return x + self.attn_post_norm(self.attn(self.attn_norm(x), rotary))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP sublayer with its residual, token by token: x [..., d] -> [..., d]."""
        return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))


class LoopedTransformer(nn.Module):
    """Prelude, a shared core applied `depth` times, coda. See the module docstring."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        self.adapter = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False) if cfg.injection == "concat" else None
        self.core = nn.ModuleList(Block(cfg) for _ in range(cfg.n_core))
        self.loop_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.d_model // cfg.n_heads, cfg.max_seq_len)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        cfg = self.config
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=cfg.init_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        # GPT-2's scaled init of residual projections, counting each block once: scaling by
        # the applied depth would make the initialisation depend on the schedule.
        n_blocks = cfg.n_prelude + cfg.n_core + cfg.n_coda
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * n_blocks))
        if self.adapter is not None:
            # adapter(cat(state, e)) = [state +] e at initialisation: from the zero initial
            # state the first iteration sees exactly the prelude output.
            d = cfg.d_model
            with torch.no_grad():
                self.adapter.weight.zero_()
                self.adapter.weight[:, d:].copy_(torch.eye(d))
                if cfg.adapter_init == "sum":
                    self.adapter.weight[:, :d].copy_(torch.eye(d))
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    # --- the pass ---------------------------------------------------------------------------

    def _prelude(self, input_ids: torch.Tensor) -> torch.Tensor:
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise InputError(f"sequence length {T} exceeds model.max_seq_len={self.config.max_seq_len}")
        e = self.embed(input_ids)  # [B, T, d]
        for block in self.prelude:
            e = block(e, self.rotary)
        return e

    def _initial_state(self, e: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if cfg.init_state == "zeros":
            return torch.zeros_like(e)
        # A fixed generator per call: the same noise every time, so the output at every
        # depth stays a pure function of the weights and the input.
        gen = torch.Generator(device="cpu").manual_seed(cfg.state_noise_seed)
        noise = torch.randn(e.shape, generator=gen, dtype=torch.float32)
        return (cfg.state_noise_std * noise).to(device=e.device, dtype=e.dtype)

    def _inject(self, state: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The core's input from the state and the prelude output [B, T, d]."""
        if self.adapter is not None:
            return self.adapter(torch.cat((state, e), dim=-1))
        return state + e

    def _iterate(self, state: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = self._inject(state, e)
        for block in self.core:
            x = block(x, self.rotary)
        return x

    def _readout(self, state: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] from the state [B, T, d]; with `positions` (int64 [N], indices into
        the flattened B*T tokens) logits [N, V] at those tokens only. The coda's attention
        reads every token, but what follows it works token by token, so the last MLP, the
        final norm and the head, most of a readout's FLOPs, run on the N tokens alone."""
        x = self.loop_norm(state)
        if positions is None:  # whole blocks, so that compiled blocks (training) stay compiled
            for block in self.coda:
                x = block(x, self.rotary)
            return self.head(self.final_norm(x))  # [B, T, V]
        for block in self.coda[:-1]:
            x = block(x, self.rotary)
        if self.coda:
            x = self.coda[-1].attend(x, self.rotary)
        x = x.flatten(0, 1)[positions]  # [N, d]
        if self.coda:
            x = self.coda[-1].feed_forward(x)
        return self.head(self.final_norm(x))  # [N, V]

    def _states(self, input_ids: torch.Tensor, depth: int) -> Iterable[tuple[int, torch.Tensor]]:
        """Yield (k, s_k) for k = 1..depth. Truncated backprop runs the first
        depth - backprop_depth iterations without autograd, as Huginn does."""
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise InputError(f"depth must be a positive integer, got {depth!r}")
        e = self._prelude(input_ids)
        state = self._initial_state(e)
        no_grad_until = depth - self.config.backprop_depth if self.config.backprop_depth else 0
        for k in range(1, depth + 1):
            if k <= no_grad_until:
                with torch.no_grad():
                    state = self._iterate(state, e)
            else:
                state = self._iterate(state, e)
            yield k, state

    def forward(self, input_ids: torch.Tensor, depth: int) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] after `depth` core iterations."""
        for _, state in self._states(input_ids, depth):  # noqa: B007 (the last state is the one read out)
            pass
        return self._readout(state)

    def logits_by_depth(
        self, input_ids: torch.Tensor, depths: Sequence[int], positions: torch.Tensor | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (s, logits [B, T, V]) for each s in sorted(set(depths)) from one pass
        of max(depths) iterations, reading out after each requested iteration; with
        `positions` (int64 [N] into the flattened B*T tokens) logits [N, V] at those only."""
        for k, _, logits in self.readouts_by_depth(input_ids, depths, positions):
            yield k, logits

    def readouts_by_depth(
        self, input_ids: torch.Tensor, depths: Sequence[int], positions: torch.Tensor | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """`logits_by_depth` with the recurrent state: yield (s, s_s [B, T, d], logits [B, T, V]),
        or with `positions` the state [N, d] and logits [N, V] at those tokens only."""
        wanted = sorted({int(s) for s in depths})
        if not wanted:
            raise InputError("depths must not be empty")
        for k, state in self._states(input_ids, wanted[-1]):
            if k in wanted:
                read = state if positions is None else state.flatten(0, 1)[positions]
                yield k, read, self._readout(state, positions)

    def forward_with_exit(
        self,
        input_ids: torch.Tensor,
        max_depth: int,
        exits: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token early exit, as adaptive-compute generation runs it: (logits [B, T, V],
        exit depth int64 [B, T]).

        After iteration k every token still running is read out and `exits(k, state [B, T, d],
        logits [B, T, V])` returns bool [B, T], the tokens that stop there (at max_depth all
        stop). A stopped token's state is frozen, and so are the inputs of every core block at
        its last iteration: later iterations of the other tokens attend to the keys and values
        it had when it stopped (a key-value cache that keeps each token's newest entry). The
        logits are the readout of the frozen states. With every token stopping at max_depth
        this is `forward(input_ids, max_depth)` to the bit, with every token stopping at 1 it
        is `forward(input_ids, 1)`. Every token is still computed at every iteration (the
        frozen ones' results discarded): this measures what exiting does to the predictions,
        not its speed."""
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < 1:
            raise InputError(f"max_depth must be a positive integer, got {max_depth!r}")
        e = self._prelude(input_ids)  # [B, T, d]
        state = self._initial_state(e)
        B, T, _ = e.shape
        exit_depth = torch.full((B, T), max_depth, dtype=torch.int64, device=e.device)
        running = torch.ones(B, T, 1, dtype=torch.bool, device=e.device)
        frozen_inputs: list[torch.Tensor | None] = [None] * len(self.core)  # each core block's input
        for k in range(1, max_depth + 1):
            x = self._inject(state, e)
            for i, block in enumerate(self.core):
                if frozen_inputs[i] is not None:
                    x = torch.where(running, x, frozen_inputs[i])
                frozen_inputs[i] = x
                x = block(x, self.rotary)
            state = torch.where(running, x, state)
            if k == max_depth:
                break
            stops = exits(k, state, self._readout(state)) & running.squeeze(-1)  # [B, T]
            exit_depth[stops] = k
            running = running & ~stops.unsqueeze(-1)
            if not bool(running.any()):
                break
        return self._readout(state), exit_depth

    def nll_by_depth(self, input_ids: torch.Tensor, targets: torch.Tensor, depths: Sequence[int]) -> torch.Tensor:
        """Mean token NLL at every depth in `depths` from one pass of max(depths)
        iterations; returns Tensor[len(depths)] (float32) in the order given.
        Targets equal to IGNORE_INDEX are skipped, and when some are, only the counted
        tokens are read out (`_readout`): the same NLL up to float rounding."""
        targets = targets.flatten()  # [B*T]
        counted = targets != IGNORE_INDEX
        positions = None if bool(counted.all()) else counted.nonzero().squeeze(1)
        if positions is not None:
            targets = targets[positions]  # [N]
        nll = {
            s: F.cross_entropy(logits.flatten(0, -2).float(), targets)  # every target here is counted
            for s, logits in self.logits_by_depth(input_ids, depths, positions)
        }
        return torch.stack([nll[int(s)] for s in depths])

    def compile_blocks(self) -> None:
        """torch.compile each block in place (state_dict keys unchanged). The depth loop stays
        in Python, so one graph serves every depth and every block of the same shape."""
        for block in (*self.prelude, *self.core, *self.coda):
            block.compile(dynamic=False)

    # --- bookkeeping ------------------------------------------------------------------------

    def parameter_groups(self) -> dict[str, int]:
        """Parameter counts by role: embedding, prelude, adapter, core, coda, norms, head.
        The head is counted separately even when tied."""
        counts = {
            "embedding": self.embed.weight.numel(),
            "prelude": sum(p.numel() for p in self.prelude.parameters()),
            "adapter": self.adapter.weight.numel() if self.adapter is not None else 0,
            "core": sum(p.numel() for p in self.core.parameters()),
            "coda": sum(p.numel() for p in self.coda.parameters()),
            "norms": self.loop_norm.weight.numel() + self.final_norm.weight.numel(),
            "head": self.head.weight.numel(),
        }
        return counts
