"""The model code the templates beside this file import relatively (`from .looped_transformer
import ...`). In an exported folder this file is trainer/model.py itself (with its one project
import replaced by a local InputError, trainer/export/hf/writer.py); in the package it re-exports
trainer/model.py, so that the templates import and run here exactly as they do there."""

from trainer.model import LoopedTransformer, ModelConfig, Rotary

__all__ = ["LoopedTransformer", "ModelConfig", "Rotary"]
