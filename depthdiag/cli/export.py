"""`depthdiag export`."""

from __future__ import annotations

from pathlib import Path

import click

from depthdiag.cli.app import reports_errors

# The choices are spelled here rather than imported from trainer.export.model_folder, so that --help imports no torch.
FORMATS = ("safetensors", "hf")


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder to write the export to (new, or empty).",
)
@click.option(
    "--format",
    "export_format",
    type=click.Choice(FORMATS),
    default="safetensors",
    show_default=True,
    help="safetensors: model.safetensors + config.json, loaded by plain PyTorch. hf: a Hugging Face folder "
    "with the model's code, loaded by AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True) "
    "(needs the hf extra).",
)
@click.option(
    "--num-steps",
    type=click.IntRange(min=1),
    default=None,
    help="--format hf: the serving depth when the caller gives none [default: the deepest depth of the "
    "run's training schedule].",
)
@click.option(
    "--tokenizer",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="--format hf: a Hugging Face tokenizers file to ship instead of the run's own (a 'bin' run's data "
    "folder names its own; 'text' and bioS runs have none).",
)
@click.option("--force", is_flag=True, help="Overwrite an earlier export in --out (never a folder with other files).")
@reports_errors
def export_model(
    checkpoint: Path, out: Path, export_format: str, num_steps: int | None, tokenizer: Path | None, force: bool
) -> None:
    """Write the model of CHECKPOINT (a checkpoint or a snapshot) to the folder OUT.

    \b
    --format safetensors: OUT/model.safetensors (its state_dict) and OUT/config.json (its
    ModelConfig, with the source file's sha256 and the run config for provenance), which load
    back with a few lines of plain PyTorch and no pickle (docs/api.md).
    --format hf: a Hugging Face folder (config, weights, the model's code, the run's tokenizer
    when it has one) for transformers and lm-eval's hf model:
      depthdiag export runs/x/checkpoints/latest.pt --out exported/x-hf --format hf
      lm_eval --model hf --model_args pretrained=exported/x-hf,trust_remote_code=True,num_steps=8 ...
    """
    from trainer.export.hf import TOKENIZER_FILES
    from trainer.export.model_folder import export_checkpoint

    written = export_checkpoint(
        checkpoint, out, force=force, format=export_format, num_steps=num_steps, tokenizer=tokenizer
    )
    click.echo(f"wrote {written}")
    if export_format == "hf" and not (written / TOKENIZER_FILES[0]).exists():
        click.echo("no tokenizer written: the run's text is UTF-8 bytes ('text' data) or has no text form (bioS)")
