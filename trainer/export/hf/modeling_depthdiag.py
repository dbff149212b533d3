"""A depthdiag looped transformer as a Hugging Face causal language model.

`depthdiag export --format hf` copies this file into the exported folder, where
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` finds it through
config.json's auto_map. It may import only relatively: the folder is all it has.

    model(input_ids, num_steps=K)          logits [B, T, V] after K core iterations
                                           (num_steps=None: config.num_steps)
    model(input_ids, labels=input_ids)     also .loss, the mean next-token cross-entropy
    model.generate(input_ids, ...)         every new token from a forward over the whole window
    model.nll_by_depth(ids, targets, [1, 4, 16])   the mean NLL at each depth from one pass
    model.forward_with_exit(ids, 16, exits)        per-token early exit: (logits, exit depth [B, T])

The looped transformer keeps no key-value cache, so generation recomputes the window (the
last max_seq_len tokens) for every token, whatever `use_cache` says.
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_depthdiag import DepthdiagConfig
from .looped_transformer import LoopedTransformer, Rotary

LABEL_IGNORE_INDEX = -100
"""A label the loss skips: transformers' convention (depthdiag's own training loss skips -1)."""


class DepthdiagForCausalLM(PreTrainedModel, GenerationMixin):
    """LoopedTransformer under `self.model`, so its state_dict keys are the looped transformer's
    with "model." in front."""

    config_class = DepthdiagConfig
    _no_split_modules = ["Block"]
    # Read only when config.tie_word_embeddings is true: the head is the embedding matrix, one
    # parameter, as LoopedTransformer ties them (transformers 5's {target: source} form).
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}

    def __init__(self, config: DepthdiagConfig):
        super().__init__(config)
        self.model = LoopedTransformer(config.model_config())
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # No key-value cache: generate must not make one, nor feed the last token alone.
        return False

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Recompute the rotary tables. from_pretrained builds the model on the meta device and
        refills the buffers that are not in the weights file (the tables, derived from the config)
        with uninitialised memory, then calls this for every module it did not load. The weights
        themselves are either loaded or initialised by LoopedTransformer, so nothing else is touched."""
        if isinstance(module, Rotary):
            with torch.device("cpu"):
                fresh = Rotary(module.cos.shape[-1], module.cos.shape[0])
            module.cos.copy_(fresh.cos)
            module.sin.copy_(fresh.sin)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_steps: int | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutput | tuple:
        """input_ids [B, T] -> logits [B, T, V] after `num_steps` core iterations (config.num_steps
        when None). `attention_mask` may mark left or right padding (one run of ones per row): each
        row is then computed on its own tokens alone and its padding positions get zero logits.
        `labels` [B, T] gives `loss`, the mean cross-entropy of labels[:, 1:] from logits[:, :-1]
        over the labels that are not -100. `use_cache` and any other keyword are accepted and
        ignored (there is no cache)."""
        if inputs_embeds is not None:
            raise ValueError("this model takes input_ids, not inputs_embeds")
        depth = self.config.num_steps if num_steps is None else num_steps
        logits = self._logits(input_ids, attention_mask, depth)
        loss = None
        if labels is not None:
            targets = labels[:, 1:].to(logits.device).flatten()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets, ignore_index=LABEL_IGNORE_INDEX)
        output = CausalLMOutput(loss=loss, logits=logits)
        return output if return_dict is not False else output.to_tuple()

    def _logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, depth: int) -> torch.Tensor:
        if attention_mask is None or bool(attention_mask.all()):
            return self.model(input_ids, depth=depth)
        # The looped transformer's attention is causal over every position it is given, with
        # positions counted from the first: padding must not be among them.
        rows = []
        for ids, mask in zip(input_ids, attention_mask.bool()):
            kept = mask.nonzero().squeeze(1)
            if len(kept) == 0 or int(kept[-1] - kept[0]) + 1 != len(kept):
                raise ValueError("attention_mask: every row must be one run of ones (left or right padding)")
            row = self.model(ids[kept][None], depth=depth)[0]  # [n, V]
            rows.append(row.new_zeros((len(ids), row.shape[-1])).index_copy(0, kept, row))
        return torch.stack(rows)

    def nll_by_depth(self, input_ids: torch.Tensor, targets: torch.Tensor, depths) -> torch.Tensor:
        """Mean token NLL of `targets` [B, T] (-1 skipped, depthdiag's convention) at every depth
        in `depths` from ONE pass of max(depths) iterations (LoopedTransformer.nll_by_depth),
        float32 [len(depths)]: how depthdiag's diagnostic and monitor score this model at many
        serving depths for the price of the deepest."""
        return self.model.nll_by_depth(input_ids, targets, depths)

    def forward_with_exit(self, input_ids: torch.Tensor, max_depth: int, exits) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token early exit as adaptive-compute generation runs it (LoopedTransformer.forward_with_exit):
        after iteration k, `exits(k, state [B, T, d], logits [B, T, V])` returns bool [B, T], the
        tokens that stop there; a stopped token's state and its keys and values stay those of its
        last iteration for the tokens still running. Returns (logits [B, T, V], exit depth int64
        [B, T]). `depthdiag exits --real-exit` and `depthdiag lm-eval --exit` serve this model with it."""
        return self.model.forward_with_exit(input_ids, max_depth, exits)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        num_steps: int | None = None,
        **kwargs,
    ) -> dict:
        """The whole window for every new token: the last max_seq_len tokens (a sliding window, as
        `depthdiag lm-eval` decodes), never the last token alone, and no cache."""
        window = self.config.max_seq_len
        inputs = {"input_ids": input_ids[:, -window:], "num_steps": num_steps}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[:, -window:]
        return inputs
