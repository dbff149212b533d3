#!/usr/bin/env bash
# The GPU path in one short run: bf16 training of a mid-size model on CUDA for a
# few hundred updates (fixed-first, with snapshots at the switch and 16 uniform
# updates later), tokens/s and achieved FLOP/s of the compiled paper-200m-shaped
# model against the measured bf16 matmul peak, a resume check, evaluation, the
# diagnostic on CUDA, and FSDP2 at one GPU (bench/gpu_fsdp_check.py: sharded bf16
# training, the sharded diagnostic against the unsharded). Prints what it measures;
# exits non-zero on the first failure.
#
#   bash bench/gpu_check.sh [OUT_DIR]
#   DEVICE=cpu UPDATES=24 D_MODEL=64 bash bench/gpu_check.sh   # the same steps, small, on the CPU
#   PRECISION=fp32 ...   # on a CPU without bf16 units, where bf16 is emulated and far slower
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
UPDATES=${UPDATES:-300}
D_MODEL=${D_MODEL:-512}
PRECISION=${PRECISION:-bf16}
OUT=${1:-/tmp/depthdiag-gpu-check}
DEPTHDIAG=${DEPTHDIAG:-.venv/bin/depthdiag}
PY=${PY:-.venv/bin/python}

rm -rf "$OUT"
mkdir -p "$OUT"
"$PY" - <<EOF
import torch
print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())
if "$DEVICE" == "cuda":
    print("device:", torch.cuda.get_device_name(0), "bf16 supported:", torch.cuda.is_bf16_supported())
EOF

SETTINGS=(
  --set model.d_model="$D_MODEL" --set model.n_heads=8 --set model.n_prelude=2 --set model.n_core=4
  --set model.n_coda=2 --set model.max_seq_len=128 --set train.seq_len=128 --set train.batch_size=64
  --set train.updates="$UPDATES" --set train.precision="$PRECISION" --set train.device="$DEVICE"
  --set 'train.schedule="fixed-first:k0=4,switch=0.5,finish=uniform:1-16"'
  --set 'train.snapshot_uniform_updates=[0, 4]' --set train.snapshot_batches=4
  --set train.checkpoint_every=$((UPDATES / 2)) --set optim.warmup=$((UPDATES / 10))
  --set data.bios_people=2000
)

echo "== train: $UPDATES $PRECISION updates on $DEVICE"
time "$DEPTHDIAG" train configs/tiny.toml --out "$OUT/run" --no-progress "${SETTINGS[@]}"
"$PY" - "$OUT/run/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[0], rows[-1]
print(f"loss {first['loss']:.3f} -> {last['loss']:.3f}; {last['flops'] / last['wall_time'] / 1e12:.2f} modeled TFLOP/s")
assert last["loss"] < first["loss"], "training did not reduce the loss"
EOF

echo "== throughput: the compiled paper-200m-shaped model in $PRECISION (tiny on the CPU), bioS tokens"
if [ "$DEVICE" = cuda ]; then
  THROUGHPUT=(--config configs/paper-200m.toml --set 'data.source="bios"' --set train.batch_size=16
              --set train.seq_len=2048 --updates 10)
else
  THROUGHPUT=(--config configs/tiny.toml --set train.batch_size=8 --updates 4)
fi
"$PY" bench/bench_train.py --achieved-only "${THROUGHPUT[@]}" --set train.compile=true \
  --set train.precision="$PRECISION" --set train.device="$DEVICE"

echo "== resume: the second half again from the middle checkpoint"
mkdir -p "$OUT/resumed/checkpoints"
cp "$OUT/run/config.json" "$OUT/resumed/"
cp "$OUT/run/checkpoints/step_$(printf %06d $((UPDATES / 2))).pt" "$OUT/resumed/checkpoints/"
"$DEPTHDIAG" train configs/tiny.toml --resume "$OUT/resumed" --no-progress "${SETTINGS[@]}"
"$PY" - "$OUT" "$UPDATES" <<'EOF'
import sys, torch
out, updates = sys.argv[1], int(sys.argv[2])
name = f"step_{updates:06d}.pt"
a = torch.load(f"{out}/run/checkpoints/{name}", weights_only=True)["model"]
b = torch.load(f"{out}/resumed/checkpoints/{name}", weights_only=True)["model"]
worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"resumed vs straight final weights: max |difference| {worst:.3g} (bit-exact is promised on CPU only)")
EOF

echo "== eval on $DEVICE"
"$DEPTHDIAG" eval "$OUT/run/checkpoints/step_$(printf %06d "$UPDATES").pt" --serving 1-4,8,16 \
  --device "$DEVICE" --no-progress

echo "== diagnose on $DEVICE"
time "$DEPTHDIAG" diagnose "$OUT"/run/snapshots/*.pt --out "$OUT/results.h5" --batches 4 \
  --device "$DEVICE" --no-progress
"$DEPTHDIAG" summarize "$OUT/results.h5"
echo "== FSDP2 at one $DEVICE: sharded $PRECISION training, then the sharded diagnostic against the unsharded"
"$PY" bench/gpu_fsdp_check.py --device "$DEVICE" --updates "$((UPDATES < 200 ? UPDATES : 200))" --d-model "$D_MODEL" --precision "$PRECISION"

echo "gpu check: all steps ran"
