#!/usr/bin/env bash
# One call on the GPU machine (device tool): GPU tests, then the benchmarks, logs under $OUT.
# Packages missing on that image travel as wheels in .whl/ (omegaconf, diffusers, peft and this
# project's own wheel: `pip wheel --no-deps --no-build-isolation -w .whl .`).
#   bash benchmarks/gpu_session.sh [tests] [attention] [rl] [e2e] [ddp]
set -uo pipefail
OUT=${OUT:-/tmp/vsa2_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests attention rl e2e ddp)
for part in "${parts[@]}"; do
  case $part in
    tests)  # -P: the repo's vsa2_rl/ must not shadow the installed package (kernels live there)
      timeout 90 python3 -P -m pytest -q -m gpu --continue-on-collection-errors tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    attention)
      timeout 160 python3 benchmarks/bench_attention.py --shapes 720p --kv-blocks 16,64 \
        --out "$OUT/attention.md" 2>&1 | tail -60 ;;
    rl)
      timeout 200 python3 benchmarks/bench_rl_step.py --steps 8 --train-steps 4 --out "$OUT/rl_step.md" 2>&1 | tail -12 ;;
    e2e)
      timeout 80 python3 benchmarks/bench_e2e.py --grids 720p --compile off --forward-only --reps 2 \
        --warmup 1 --only "VSA2 0.95 kv64" \
        --out "$OUT/e2e.md" 2>&1 | tail -20 ;;
    ddp)  # the trainer on 2 GPUs (DDP, NCCL) vs 1 GPU, same global batch and seeds (toy model)
      toy="--config /tmp/toy_gpu.yaml model.path=$PWD/assets/toy train.num_steps=3
        grpo.prompts_per_step=2 grpo.group_size=4 sampler.num_steps=8 train.checkpoint_every=0
        logging.progress=false"
      # image_quality needs no OpenCV (absent on that image); YAML file: the value has spaces
      printf 'rewards:\n  functions:\n    - name: image_quality\n' > /tmp/toy_gpu.yaml
      # PYTHONSAFEPATH: same reason as -P above, for accelerate's child processes too
      PYTHONSAFEPATH=1 timeout 80 accelerate launch --config_file configs/accelerate/ddp_2gpu.yaml \
        train_rl.py $toy out_dir=/tmp/ddp2 > "$OUT/ddp2.log" 2>&1; tail -5 "$OUT/ddp2.log"
      PYTHONSAFEPATH=1 CUDA_VISIBLE_DEVICES=0 timeout 60 python3 train_rl.py $toy out_dir=/tmp/gpu1 \
        2>&1 | tail -3
      cp /tmp/ddp2/metrics.jsonl "$OUT/ddp2_metrics.jsonl"; cp /tmp/gpu1/metrics.jsonl "$OUT/gpu1_metrics.jsonl" ;;
  esac
done
