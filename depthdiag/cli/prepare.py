"""`depthdiag prepare`."""

from __future__ import annotations

from pathlib import Path

import click

from common.choices import (
    DOCUMENT_CHOICES,
)
from depthdiag.cli.app import reports_errors
from depthdiag.cli.options import (
    no_progress_option,
)


@click.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Output folder: train.bin, val.bin, tokenizer.json, meta.json (data.source = 'bin', data.path = it).",
)
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="Train a byte-level BPE tokenizer of this many tokens on the training documents.",
)
@click.option(
    "--tokenizer",
    "tokenizer_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Encode with this tokenizer.json instead (exactly one of --vocab-size and --tokenizer).",
)
@click.option(
    "--text-field", default="text", show_default=True, help="The field of a .jsonl line that holds its document."
)
@click.option(
    "--val-fraction",
    type=float,
    default=0.01,
    show_default=True,
    help="Expected fraction of documents held out in val.bin (a hash of each document's text decides).",
)
@click.option(
    "--document",
    type=click.Choice(DOCUMENT_CHOICES),
    default="paragraph",
    show_default=True,
    help="A document of a plain-text file: a blank-line separated paragraph, or the whole file.",
)
@click.option(
    "--eot", default="<|endoftext|>", show_default=True, help="The end-of-text token that follows every document."
)
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
@no_progress_option
@reports_errors
def prepare(
    inputs: tuple[str, ...],
    out: Path,
    vocab_size: int | None,
    tokenizer_file: Path | None,
    text_field: str,
    val_fraction: float,
    document: str,
    eot: str,
    force: bool,
    no_progress: bool,
) -> None:
    """Tokenize a text corpus into nanoGPT-style train.bin / val.bin for data.source = "bin".

    INPUT: files, folders (every non-hidden file below, in sorted order; symbolic links
    followed, a loop or a broken one refused) or glob patterns; plain UTF-8 text, or JSON
    lines (.jsonl) with the document in --text-field. The train/val split is by document,
    decided by a hash of its text; where that leaves a split empty (a small corpus), by
    pieces of the documents cut at line ends, and the output says so. Two runs on the same
    input write byte-identical files.

    \b
    Example:
      depthdiag prepare books/ --out data/books --vocab-size 8192
      # then in the run config: [data] source = "bin", path = "../data/books"
    """
    from trainer.data.prepare import PrepareConfig
    from trainer.data.prepare import prepare as prepare_corpus

    config = PrepareConfig(
        inputs=inputs,
        out=out,
        vocab_size=vocab_size,
        tokenizer=tokenizer_file,
        text_field=text_field,
        val_fraction=val_fraction,
        document=document,
        eot=eot,
        force=force,
    )
    meta = prepare_corpus(config, progress=not no_progress).meta
    asked = (meta["tokenizer_training"] or {}).get("vocab_size_asked")
    short = f" (asked for {asked:,}: no more pairs occur twice)" if asked and asked > meta["vocab_size"] else ""
    click.echo(
        f"wrote {out}: vocabulary {meta['vocab_size']:,}{short}, {meta['dtype']}; "
        f"train {meta['tokens']['train']:,} tokens ({meta['documents']['train']:,} documents), "
        f"val {meta['tokens']['val']:,} tokens ({meta['documents']['val']:,} documents)"
    )
    fallback = meta["split"].get("fallback")
    if fallback:
        click.echo(
            f"split: {fallback['because']}, so they were cut at line ends into {fallback['pieces']:,} "
            f"pieces of at most {fallback['piece_chars']:,} characters, split by their hashes (the "
            "documents counted above are these pieces; meta.json's split has the rule)"
        )
