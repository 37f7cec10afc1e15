#!/usr/bin/env bash
# The CPU demo, from a fresh clone: install, build the tiny built-in default (no network), train
# it with one process (02), with DDP (03) and with FSDP (04) on 2 CPU ranks, and compare.
# Every run uses the same global batch of 16 rows (8 per pass: 2 micro-batches on one process, 1
# on each of 2 ranks), so the three loss curves should coincide.
# Arguments are passed to all three runs, e.g. `./demo.sh --report_to tensorboard`.
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh
python=.venv/bin/python
runs=runs/demo
steps=${DEMO_STEPS:-150}
train=(--max_steps "$steps" --eval_every 50 --learning_rate 3e-3 --max_seq_length 128 --overwrite
  --total_batch_size 16 --batch_size_per_device 8 "$@")

$python 01_download/download.py --demo --out demo

echo "== 02_singlegpu: 1 process, 8 rows x 2 micro-batches =="
$python 02_singlegpu/train.py --output_dir "$runs/02_singlegpu" "${train[@]}"

echo "== 03_ddp: 2 ranks x 8 rows =="
$python -m launch.torchrun --standalone --nproc-per-node 2 03_ddp/train.py --output_dir "$runs/03_ddp" "${train[@]}"

echo "== 04_fsdp: 2 ranks x 8 rows =="
$python -m launch.torchrun --standalone --nproc-per-node 2 04_fsdp/train.py --output_dir "$runs/04_fsdp" "${train[@]}"

$python benchmark/compare_runs.py "$runs/02_singlegpu" "$runs/03_ddp" "$runs/04_fsdp"
echo "(tokens/s and memory vary with the machine and its load, the losses slightly with the CPU and torch build;"
echo " the three runs should agree with each other: the lines above give their largest per-step difference)"
