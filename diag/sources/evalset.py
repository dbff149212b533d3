"""Which evaluation set a diagnostic scores, for `depthdiag diagnose` (diag/driver/run.py) and the
in-training monitor (diag/in_training/monitor.py) alike.

'snapshot': the run's held-out evaluation set (every target counted); 'attributes' (bioS
runs): the evaluation presentations with only the attribute-value targets counted
(`BiosSource.attribute_eval`), the paper's bioS evaluation; 'auto': 'attributes' for bioS
runs, 'snapshot' for others.
"""

from __future__ import annotations

import torch

from common.errors import InputError
from trainer.config import RunConfig
from trainer.data.sources import TokenSource, build_source


def resolve_eval_set(choice: str, config: RunConfig, origin: object) -> str:
    """'snapshot' or 'attributes' for `choice` on a run of `config`; `origin` (a file, a config)
    names the run in the error for 'attributes' on a run that is not bioS."""
    bios = config.data.source == "bios"
    if choice == "auto":
        return "attributes" if bios else "snapshot"
    if choice == "attributes" and not bios:
        raise InputError(
            f"{origin}: --eval-set attributes needs a bioS run, this one reads data.source={config.data.source!r}"
        )
    return choice


def evaluation_set(
    eval_set: str,
    config: RunConfig,
    eval_tokens: torch.Tensor | None = None,
    *,
    rows: int | None = None,
    source: TokenSource | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(eval_tokens int64 [E, T+1], eval_mask bool [E, T] or None) of the resolved `eval_set`
    for a run of `config`, E = `rows` (default: data.eval_sequences). 'snapshot' uses the
    given `eval_tokens` (what a snapshot carries) or draws the run's set from the source;
    `source` saves building the run's data source again."""
    rows = config.data.eval_sequences if rows is None else rows
    if eval_set == "snapshot" and eval_tokens is not None:
        return eval_tokens, None
    source = source if source is not None else build_source(config.data)
    if eval_set == "snapshot":
        return source.eval_tokens(rows, config.train.seq_len), None
    return source.attribute_eval(rows, config.train.seq_len)
