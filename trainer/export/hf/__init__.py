"""`depthdiag export --format hf`: a checkpoint's model as a Hugging Face folder that
`transformers.AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` loads.

    DIR/config.json                 DepthdiagConfig (configuration_depthdiag.py): the ModelConfig
                                    fields, num_steps (the serving depth), auto_map, provenance
    DIR/model.safetensors           the state_dict of DepthdiagForCausalLM (the model under "model.")
    DIR/looped_transformer.py       trainer/model.py, its one project import replaced by a local InputError
    DIR/configuration_depthdiag.py  the config class (this package's file, copied)
    DIR/modeling_depthdiag.py       the model class (this package's file, copied)
    DIR/tokenizer.json, DIR/tokenizer_config.json
                                    the run's tokenizer file as a PreTrainedTokenizerFast, when the run
                                    has one (data.source = 'bin', or --tokenizer)

configuration_depthdiag.py and modeling_depthdiag.py are real modules of this package, linted
and tested as such; the folder holds them verbatim. They import only relatively
(`from .looped_transformer import ...`), which in the package reaches looped_transformer.py
here (a re-export of trainer/model.py) and in the folder the copy of trainer/model.py itself.

Nothing here imports transformers at import time: it is the optional `hf` extra, imported by
`trainer/export/hf/writer.py` only when an hf export is written.
"""

MODEL_TYPE = "depthdiag_looped"
"""config.json's "model_type" (configuration_depthdiag.MODEL_TYPE; a test checks the two agree)."""

MODEL_SOURCE = "looped_transformer.py"
CONFIG_SOURCE = "configuration_depthdiag.py"
MODELING_SOURCE = "modeling_depthdiag.py"
TEMPLATES = (CONFIG_SOURCE, MODELING_SOURCE)
"""The files of this package that an export copies verbatim."""

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What `PreTrainedTokenizerFast.save_pretrained` writes (the writer checks it wrote nothing else)."""
HF_EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, MODEL_SOURCE, *TEMPLATES, *TOKENIZER_FILES)
"""Every name an hf export may hold."""
