"""`depthdiag lm-eval`."""

from __future__ import annotations

from pathlib import Path

import click

from depthdiag.cli.app import reports_errors
from depthdiag.cli.options import (
    device_option,
    eval_batch_size_option,
    hf_input_options,
    max_depth_option,
    no_progress_option,
    serving_option,
)


@click.command("lm-eval")
@click.argument("checkpoint", required=False, type=click.Path(path_type=Path))
@click.option(
    "--tasks",
    required=True,
    help="lm-evaluation-harness task, group or tag names separated by commas, e.g. hellaswag,piqa,arc_easy.",
)
@serving_option
@max_depth_option
@click.option(
    "--include-path",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="A folder of task YAML files to use besides lm-eval's own (its --include_path).",
)
@click.option(
    "--limit",
    type=float,
    default=None,
    help="Evaluate only the first N documents of each task (or a fraction of each, below 1) [default: all].",
)
@click.option(
    "--num-fewshot",
    type=click.IntRange(min=0),
    default=None,
    help="Few-shot examples per prompt [default: each task's own, 0 for hellaswag, piqa, arc_easy].",
)
@click.option(
    "--tokenizer",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A Hugging Face tokenizers file to use instead of the checkpoint's own (bytes for 'text' data, "
    "the data folder's meta.json tokenizer for 'bin').",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The results file (xarray/HDF5): every metric over task x serving depth.",
)
@click.option(
    "--exit",
    "exits",
    multiple=True,
    metavar="CRITERION:THRESHOLD",
    help="Also score every task with real per-token exit (repeatable), e.g. kl:5e-4: each token served at the "
    "first iteration where the criterion (kl, l2, entropy, maxprob or MODULE:NAME, as `depthdiag exits`) fires, "
    "at most the deepest --serving depth; log-likelihood tasks only. depthdiag's own models.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing --out file.")
@eval_batch_size_option("--batch-size")
@device_option
@no_progress_option
@reports_errors
@hf_input_options(tokens=False)
def lm_eval_run(
    checkpoint: Path | None,
    tasks: str,
    serving: str,
    max_depth: int,
    include_path: Path | None,
    limit: float | None,
    num_fewshot: int | None,
    tokenizer: Path | None,
    out: Path,
    exits: tuple[str, ...],
    force: bool,
    batch_size: int,
    device: str,
    no_progress: bool,
    hf,
) -> None:
    """Downstream accuracy of CHECKPOINT (a checkpoint or snapshot), or of a Hugging Face model
    folder (--hf DIR, served at each depth as its model family serves, with the folder's
    tokenizer.json), on lm-evaluation-harness tasks at every --serving depth, into one file
    (draw it with `plot --figure 3-downstream`). Needs the eval extra: pip install -e .[eval].

    \b
    Every request is scored at all serving depths from one pass of the deepest, so depths
    1-16 cost about one evaluation at depth 16 (generation tasks decode once per depth);
    each --exit rule adds one forward per request batch.
    Example (the paper's Figure 3, bottom row):
      depthdiag lm-eval runs/x/checkpoints/latest.pt --tasks hellaswag,piqa,arc_easy \\
        --serving 1-16 --out results/x-downstream.h5
    """
    from analysis.downstream import format_downstream
    from analysis.store import RESULTS_FILE, write_dataset
    from common.depths import parse_serving_depths
    from common.lock import claimed_outputs
    from common.outputs import check_output
    from depthdiag.downstream import DownstreamConfig, evaluate_downstream, parse_tasks, require_harness

    require_harness()
    config = DownstreamConfig(
        checkpoint=checkpoint,
        hf=hf,
        tasks=parse_tasks(tasks),
        serving_depths=parse_serving_depths(serving, limit=max_depth),
        exits=exits,
        include_path=include_path,
        limit=limit,
        num_fewshot=num_fewshot,
        tokenizer=tokenizer,
        batch_size=batch_size,
        device=device,
        progress=not no_progress,
    )
    source = checkpoint if hf is None else hf.folder
    check_output(out, kind=RESULTS_FILE, inputs=[source], force=force)
    # The lock is held over the whole evaluation: a second writer of --out is refused at once,
    # not after hours of evaluating.
    with claimed_outputs([out], kind=RESULTS_FILE, inputs=[source], force=force):
        ds = evaluate_downstream(config)
        click.echo(format_downstream(ds))
        write_dataset(ds, out)
    click.echo(f"wrote {out}")
