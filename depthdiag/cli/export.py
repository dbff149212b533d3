"""`depthdiag export`."""

from __future__ import annotations

from pathlib import Path

import click

from depthdiag.cli.app import reports_errors


@click.command("export")
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Folder to write model.safetensors and config.json to (new, or empty).",
)
@click.option("--force", is_flag=True, help="Overwrite an earlier export in --out (never a folder with other files).")
@reports_errors
def export_model(checkpoint: Path, out: Path, force: bool) -> None:
    """Write the model of CHECKPOINT (a checkpoint or a snapshot) as OUT/model.safetensors
    (its state_dict) and OUT/config.json (its ModelConfig, with the source file's sha256 and
    the run config for provenance), which load back with a few lines of plain PyTorch and
    no pickle (docs/api.md)."""
    from trainer.export import export_checkpoint

    click.echo(f"wrote {export_checkpoint(checkpoint, out, force=force)}")
