"""The golden run: a short pipeline whose numbers are committed (tests/golden/golden.json) and
checked by `make test` (tests/test_golden.py), so that an unannounced change of what the code
computes fails a test.

The pipeline is `make figure4`'s at toy length, through the command line: `depthdiag train`
tests/golden/config.toml (16 updates, one snapshot at the switch), `depthdiag diagnose` of
that snapshot (one batch: one unit), `depthdiag summarize --json`. Its numbers are the logged
training losses, the unit's NLLs before and after each update at every serving depth, its
benefit, update RMS, RMS scales and cosine, and the summary's mean benefit.

It runs at two precisions (PRECISIONS). In fp32 the numbers hardly depend on the CPU, so its
tolerances are tight and catch any change of what the code computes. In bf16, as Figure 4
trains, oneDNN's kernels round differently on other CPUs and even 16 updates amplify that to a few
percent, so its tolerances cover the kernel sets measured when the file was written (docs/log.md
keeps the measurements) and catch the larger changes of the bf16 path. A change that is meant
to move the numbers rewrites golden.json in the same commit, with a line in docs/log.md saying why:

    .venv/bin/python tests/golden_run.py            # the numbers here, against golden.json
    .venv/bin/python tests/golden_run.py --write    # rewrite golden.json's numbers (tolerances kept)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "golden" / "config.toml"
GOLDEN = HERE / "golden" / "golden.json"
PRECISIONS = ("fp32", "bf16")
"""The training (and so the diagnostic's gradient) precisions the pipeline runs at."""


def _cli(*args: str) -> str:
    """Run a depthdiag command in this process; its standard output."""
    from click.testing import CliRunner

    from depthdiag.cli import main

    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(f"depthdiag {' '.join(args)} exited with {result.exit_code}: {result.output}")
    return result.stdout


def golden_numbers(workdir: str | Path, precision: str) -> dict:
    """Run the pipeline at `precision` in `workdir` (one torch thread: the thread count changes
    the rounding) and return its numbers, named as golden.json names them."""
    import torch

    from analysis.store import open_results

    torch.set_num_threads(1)
    workdir = Path(workdir)
    run, results = workdir / "run", workdir / "golden.h5"
    _cli("train", str(CONFIG), "--out", str(run), "--set", f"train.precision={precision}", "--no-progress")
    snapshots = sorted(str(path) for path in (run / "snapshots").glob("*.pt"))
    _cli("diagnose", *snapshots, "--out", str(results), "--batches", "1", "--no-progress")
    summary = json.loads(_cli("summarize", str(results), "--json"))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    unit = open_results([results]).isel(snapshot=0, batch=0)
    return {
        "train_loss": [line["loss"] for line in metrics if "loss" in line],
        "nll_before": unit["nll_before"].values.tolist(),
        "nll": unit["nll"].values.tolist(),
        "benefit": unit["benefit"].values.tolist(),
        "update_rms": unit["update_rms"].values.tolist(),
        "rms_scale": unit["rms_scale"].values.tolist(),
        "update_cosine": float(unit["update_cosine"]),
        "summary_mean_benefit": summary["rows"][0]["mean"],
    }


def _flat(value) -> list[float]:
    if isinstance(value, list):
        return [x for item in value for x in _flat(item)]
    return [float(value)]


def deviations(numbers: dict, golden: dict) -> dict[str, float]:
    """The largest absolute difference of each quantity from `golden`'s numbers (one precision's
    entry of golden.json; inf when the shapes differ)."""
    found = {}
    for name, expected in golden["numbers"].items():
        got, want = _flat(numbers[name]), _flat(expected)
        found[name] = max(abs(a - b) for a, b in zip(got, want)) if len(got) == len(want) else math.inf
    return found


def differences(numbers: dict, golden: dict) -> list[str]:
    """One line per quantity that lies outside its tolerance (none: the run reproduces the file)."""
    return [
        f"{name}: differs by up to {deviation:.3g}, tolerance {golden['tolerances'][name]:.3g}"
        for name, deviation in deviations(numbers, golden).items()
        if not deviation <= golden["tolerances"][name]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite golden.json's numbers and machine")
    parser.add_argument("--json", action="store_true", help="print the numbers and deviations as JSON")
    args = parser.parse_args(argv)
    from trainer.machine import machine

    golden = json.loads(GOLDEN.read_text())
    found, failed = {}, False
    for precision in PRECISIONS:
        with tempfile.TemporaryDirectory(prefix="depthdiag-golden-") as workdir:
            numbers = golden_numbers(workdir, precision)
        entry = golden[precision]
        found[precision] = {"numbers": numbers, "deviations": deviations(numbers, entry)}
        failed = failed or bool(differences(numbers, entry))
        if args.write:
            entry["numbers"] = numbers
    if args.json:
        print(json.dumps({"machine": machine(), **found}, indent=1))
    else:
        for precision, result in found.items():
            for name, deviation in result["deviations"].items():
                tolerance = golden[precision]["tolerances"][name]
                print(f"{precision} {name}: largest deviation {deviation:.3g} (tolerance {tolerance:.3g})")
    if args.write:
        golden["machine"] = machine()
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
        return 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
