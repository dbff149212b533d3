"""The monitor's cost through the transformers.Trainer callback: its checks as a fraction of the
training time of a Trainer run of the config's model with the config's [monitor] setting
(the same contract as `depthdiag train`'s monitor, docs/performance.md: at most 15%).

    python bench/bench_monitor_callback.py [--config configs/tiny-monitor.toml]

The config's model, exported with `--format hf`, trains under transformers.Trainer at the run's
own depth mix (ScheduledDepthCallback, the run's schedule spread over the timed updates) with
DepthMonitorCallback checking every `interleave` updates, so updates and checks alternate in one
run and drifting load falls on both; timing callbacks around it split each step into the
update and the check. The run's overhead is then

    checks per run x seconds per check / (updates per run x seconds per update)

with the checks a full run of the config makes (every `monitor.every` updates and the switch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from diag.arithmetic.families import DEPTHDIAG
from diag.in_training.hf_callbacks import DepthMonitorCallback, ScheduledDepthCallback
from diag.in_training.monitor import monitor_batch_seed
from diag.sources.evalset import evaluation_set, resolve_eval_set
from trainer.checkpoint import save_checkpoint
from trainer.config import load_config
from trainer.data.sources import build_source
from trainer.export.model_folder import export_checkpoint
from trainer.model import LoopedTransformer
from trainer.optim import build_optimizer
from trainer.schedules import parse_schedule


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class StepTimes(transformers.TrainerCallback):
    """Wall time of each update (step begin to the end of the Trainer's step) and of each check
    (the monitor callback's on_step_end, between this callback's two halves)."""

    def __init__(self):
        self.updates, self.checks = [], []
        self._began = self._update_done = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._update_done = time.perf_counter()
        self.updates.append(self._update_done - self._began)


class CheckTimes(transformers.TrainerCallback):
    def __init__(self, steps: StepTimes, monitor: DepthMonitorCallback):
        self.steps, self.monitor = steps, monitor

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor.monitor.due(state.global_step):
            self.steps.checks.append(time.perf_counter() - self.steps._update_done)


def run(config_path: str, *, rounds: int = 4, interleave: int = 8) -> dict:
    config = load_config(config_path)
    tc, mc = config.train, config.monitor
    timed = rounds * interleave
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = LoopedTransformer(config.model)
        source = build_source(config.data)
        checkpoint = save_checkpoint(
            tmp / "model.pt",
            config=config,
            step=0,
            uniform_updates=0,
            model=model,
            optimizer=build_optimizer(model, config.optim),
            lr=config.optim.lr,
            eval_tokens=source.eval_tokens(config.data.eval_sequences, tc.seq_len),
            progress={},
        )
        folder = export_checkpoint(checkpoint, tmp / "hf", format="hf")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        rows = torch.cat([source.batch(tc.seed, step, tc.batch_size, tc.seq_len - 1) for step in range(timed + 1)])
        eval_tokens, eval_mask = evaluation_set(
            resolve_eval_set(mc.eval_set, config, "monitor.eval_set"), config, rows=mc.eval_sequences, source=source
        )
        schedule = parse_schedule(tc.schedule, seed=tc.seed, total_updates=tc.updates)
        # The run's depth mix over the timed updates: its schedule compressed onto them.
        mix = [schedule.depth_at(round(i * (tc.updates - 1) / max(timed - 1, 1))) for i in range(timed)]
        monitor = DepthMonitorCallback(
            batches=lambda step, i: source.batch(monitor_batch_seed(tc.seed, step), i, tc.batch_size, tc.seq_len),
            eval_tokens=eval_tokens,
            eval_mask=eval_mask,
            every=interleave,
            batches_per_check=mc.batches,
            update_depths=mc.update_depths,
            serving_depths=mc.serving_depths,
            family=DEPTHDIAG,
            precision="bf16" if tc.precision == "bf16" else "fp32",
        )
        steps = StepTimes()
        args = transformers.TrainingArguments(
            output_dir=str(tmp / "out"),
            max_steps=timed,
            per_device_train_batch_size=tc.batch_size,
            learning_rate=config.optim.lr,
            weight_decay=config.optim.weight_decay,
            max_grad_norm=config.optim.grad_clip,
            bf16=tc.precision == "bf16",
            use_cpu=not torch.cuda.is_available(),
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_drop_last=True,
        )
        depth = ScheduledDepthCallback(lambda step: mix[min(step, timed - 1)])
        callbacks = [depth, steps, monitor, CheckTimes(steps, monitor)]
        transformers.Trainer(model=hf_model, args=args, train_dataset=Rows(rows), callbacks=callbacks).train()
    checks = len([s for s in range(1, tc.updates + 1) if s % mc.every == 0 or s == schedule.switch_step])
    updates = [t for i, t in enumerate(steps.updates) if i >= 1]  # the first carries one-time set-up
    per_update, per_check = statistics.mean(updates), statistics.mean(steps.checks)
    return {
        "config": config_path,
        "route": "transformers.Trainer + DepthMonitorCallback",
        "monitor": {"every": mc.every, "batches": mc.batches, "eval_sequences": mc.eval_sequences},
        "updates_per_run": tc.updates,
        "checks_per_run": checks,
        "timed_updates": len(updates),
        "timed_checks": len(steps.checks),
        "seconds_per_update": per_update,
        "seconds_per_check": per_check,
        "check_in_updates": per_check / per_update,
        "fraction": checks * per_check / (tc.updates * per_update),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-monitor.toml")
    parser.add_argument("--rounds", type=int, default=4, help="Checks timed (each after `interleave` updates).")
    parser.add_argument("--interleave", type=int, default=8, help="Timed updates between two checks.")
    args = parser.parse_args()
    print(json.dumps(run(args.config, rounds=args.rounds, interleave=args.interleave), indent=2))


if __name__ == "__main__":
    main()
