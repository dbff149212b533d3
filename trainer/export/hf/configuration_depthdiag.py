"""The Hugging Face configuration of a depthdiag looped transformer.

`depthdiag export --format hf` copies this file into the exported folder, where
`AutoConfig.from_pretrained(DIR, trust_remote_code=True)` finds it through config.json's
auto_map. It may import only relatively: the folder is all it has.
"""

from dataclasses import fields

from transformers import PretrainedConfig

from .looped_transformer import ModelConfig

MODEL_TYPE = "depthdiag_looped"
"""config.json's "model_type"."""

MODEL_FIELDS = {field.name: field.default for field in fields(ModelConfig)}
"""The ModelConfig fields and their defaults: the config holds each under its own name."""


class DepthdiagConfig(PretrainedConfig):
    """Every ModelConfig field, and `num_steps`, the depth the model serves at when its forward is
    given none (`from_pretrained(DIR, num_steps=K)` changes it).

    Two fields are stored under transformers' standard names, which transformers and lm-eval
    read (attribute_map makes the ModelConfig names read and write the same values):
    `max_seq_len` as `max_position_embeddings` (lm-eval's context length) and `tie_embeddings`
    as `tie_word_embeddings` (whether transformers ties the head to the embedding). Any other
    keyword (transformers' own, the export's `provenance`) becomes an attribute, as usual.
    """

    model_type = MODEL_TYPE
    attribute_map = {"max_seq_len": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings"}

    def __init__(self, num_steps: int = 8, **kwargs):
        for name, default in MODEL_FIELDS.items():
            stored = self.attribute_map.get(name, name)
            # Either name may be given (config.json has the stored one); the stored one wins.
            setattr(self, stored, kwargs.pop(stored, kwargs.pop(name, default)))
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        self.num_steps = num_steps
        super().__init__(**kwargs)
        self.model_config()  # a bad field fails here, naming it, not at the first forward

    def to_diff_dict(self) -> dict:
        """What save_pretrained writes: transformers leaves out the values equal to the defaults;
        the model's fields stay, so that config.json alone says what the model is."""
        fields = {self.attribute_map.get(name, name): getattr(self, name) for name in MODEL_FIELDS}
        return {**super().to_diff_dict(), **fields, "num_steps": self.num_steps}

    def model_config(self) -> ModelConfig:
        """The ModelConfig the looped transformer is built from."""
        return ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS})
