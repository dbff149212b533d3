"""tests/huginn_convention.py's model as a Hugging Face remote-code folder, as a Huginn-convention
checkpoint is published: config.json with model_type 'huginn_raven' and an auto_map, the
modeling code beside the weights. `write_folder` writes one; its code is this file's classes
after huginn_convention.py's, in one file (a model folder may hold only relative imports)."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from huginn_convention import HuginnConvention
from transformers import PretrainedConfig, PreTrainedModel

MODULE = "modeling_huginn_convention"


class HuginnConventionConfig(PretrainedConfig):
    model_type = "huginn_raven"

    def __init__(self, vocab_size: int = 48, d_model: int = 24, **kwargs):
        self.vocab_size = vocab_size
        self.d_model = d_model
        super().__init__(**kwargs)


class HuginnConventionForCausalLM(PreTrainedModel):
    config_class = HuginnConventionConfig
    base_model_prefix = "loop"

    def __init__(self, config: HuginnConventionConfig):
        super().__init__(config)
        self.loop = HuginnConvention(config.vocab_size, config.d_model)
        self.post_init()

    def _init_weights(self, module):
        pass  # every weight comes from the folder

    def forward(self, input_ids, num_steps=None, labels=None, **kwargs):
        return self.loop(input_ids, num_steps=num_steps)


def write_folder(folder: Path, model: HuginnConventionForCausalLM) -> Path:
    """`model` as a remote-code folder: config.json, model.safetensors, the modeling file."""
    folder.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    core = (here / "huginn_convention.py").read_text()
    wrapper = Path(__file__).read_text()
    for line in ("from __future__ import annotations\n", "from huginn_convention import HuginnConvention\n"):
        wrapper = wrapper.replace(line, "")
    wrapper = wrapper.split("\n\ndef write_folder", 1)[0] + "\n"
    (folder / f"{MODULE}.py").write_text(core + "\n\n" + wrapper.split('"""', 2)[2])
    document = model.config.to_dict()
    document["auto_map"] = {
        "AutoConfig": f"{MODULE}.HuginnConventionConfig",
        "AutoModelForCausalLM": f"{MODULE}.HuginnConventionForCausalLM",
    }
    document["architectures"] = ["HuginnConventionForCausalLM"]
    (folder / "config.json").write_text(json.dumps(document, indent=1))
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    safetensors.torch.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def new_model(seed: int = 0, vocab_size: int = 48) -> HuginnConventionForCausalLM:
    torch.manual_seed(seed)
    return HuginnConventionForCausalLM(HuginnConventionConfig(vocab_size=vocab_size))
