#!/usr/bin/env bash
# One call on the GPU machine (device tool): GPU tests, then the benchmarks, logs under $OUT.
# Packages missing on that image travel as wheels in .whl/ (omegaconf, diffusers, peft and this
# project's own wheel: `pip wheel --no-deps --no-build-isolation -w .whl .`).
#   bash benchmarks/gpu_session.sh [tests] [attention] [attention_all] [rl] [e2e] [e2e_all]
#     [e2e_compiled] [rl_compiled] [rl_scale] [rl_growth] [testbed_bases] [testbed_rl_base]
#     [long_toy] [sparse_rollouts] [toy_sweep] [drift] [frontier] [frontier_rl] [rl_720p] [rl_scale_14b] [profile_rl] [ddp]
#     [ab] [host_ab] [profile] [gluon] [bwd_tests] [bwd_ab] [wan] [resume_toy] [gpu1] [engines] [resume]
#     [algorithms] [toy_build] [toy_builds] [toy_ceiling] [toy_rl] [reward_signal] [prefix]
#     [sp_memory] [sp_speed] [sp_train] [wan22_ti2v] [wan22_a14b] [wan22_720p] [claims]
#     [layout] [block_kernels] [vae_decode] [rl_recipe] [rl_fused] [model_families] [nft_guidance]
#     [plan_memory]
# (ab needs the last commit's wheel in .whl_base/; engines and resume need 2 GPUs and
# DeepSpeed's wheels: deepspeed, hjson, pydantic, pydantic_core, annotated_types,
# typing_inspection, typing_extensions)
set -uo pipefail
OUT=${OUT:-/tmp/vsa2_out}
mkdir -p "$OUT"
# installed once per set of wheels: parts may run in parallel calls of this script (one per
# GPU), and a warm machine from an earlier call has the earlier wheels (reinstalled when the
# wheels' checksums differ from those the install recorded)
wheels=$(sha256sum .whl/*.whl)
if [ "$(cat /tmp/site/.installed 2>/dev/null)" != "$wheels" ]; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  echo "$wheels" > /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# the Wan-shaped trainer runs (benchmarks/wan_shaped_rl.yaml, model from the "wan" part)
run="train_rl.py --config benchmarks/wan_shaped_rl.yaml model.path=/tmp/wan1.3b"
# a long-toy build from an earlier machine, carried back as .gpu_state/long_bases.tgz (the
# long_toy part's output, finished or cut builds alike), continues here
if [ -f .gpu_state/long_bases.tgz ] && [ ! -e /tmp/long_base.txt ]; then
  tar -C /tmp -xzf .gpu_state/long_bases.tgz && ln -sfn "$(cat /tmp/long_base.txt)" /tmp/long_base
fi
# a sweep's figures and looks small enough to come back: reports, configs, metrics, logs,
# evaluations and each run's last evaluation grid (no weights, no videos), as $OUT/<sweep>.tgz
sweep_rows() {
  (cd /tmp && find "$1" -path "*/checkpoints" -prune -o \( -name "*.md" -o -name "*.json" \
    -o -name "*.jsonl" -o -name "*.yaml" -o -name "*.log" -o -name "report.png" \
    -o -name "reward_curve.png" -o -path "$1/sweeps/*/eval.png" \) -print
   for run in "$1"/runs/*/; do ls -v "$run"samples/eval_step_*.png 2>/dev/null | tail -1; done) \
    | tar -C /tmp -czf "$OUT/$1.tgz" -T -
}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests attention rl e2e ddp)
for part in "${parts[@]}"; do
  case $part in
    tests)  # -P: the repo's vsa2_rl/ must not shadow the installed package (kernels live there)
      timeout 240 python3 -P -m pytest -q -m gpu --continue-on-collection-errors tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    attention)
      timeout 160 python3 benchmarks/bench_attention.py --shapes 720p --kv-blocks 16,64 \
        --out "$OUT/attention.md" 2>&1 | tail -60 ;;
    layout)  # the tile layout's permutation against index_select (bench_layout.py)
      timeout 90 python3 -P benchmarks/bench_layout.py --out "$OUT/layout.md" 2>&1 | tail -6 ;;
    block_kernels)  # fused norm/modulation/residual/qk-norm+RoPE kernels vs eager and compiled
      # torch, and one Wan block fused vs unfused, Wan-1.3B 480p x 81 (bench_block_kernels.py)
      timeout 150 python3 -P benchmarks/bench_block_kernels.py --out "$OUT/block_kernels.md" 2>&1 | tail -16 ;;
    vae_decode)  # the Wan2.1 VAE (random weights) decoding 480p x 81 and x 33 in float32 and
      # bfloat16 (model.vae_decode_dtype): seconds, PSNR, weight-free rewards (bench_vae_decode.py)
      timeout 150 python3 -P benchmarks/bench_vae_decode.py --out "$OUT/vae_decode.md" 2>&1 | tail -50 ;;
    wan22_ti2v)  # Wan2.2 TI2V-5B RL iteration at 704x1280x121, dense vs VSA2 (bench_wan22.py)
      timeout 190 python3 benchmarks/bench_wan22.py --model ti2v_5b --out "$OUT/wan22_ti2v.md" 2>&1 | tail -8 ;;
    wan22_a14b)  # Wan2.2 A14B I2V RL iteration at 480p x 81, dense vs VSA2 (about 8 minutes)
      timeout 570 python3 benchmarks/bench_wan22.py --model a14b_i2v --resolution 480p \
        --out "$OUT/wan22_a14b_480p.md" 2>&1 | tail -8 ;;
    wan22_720p)  # what one GPU holds: A14B I2V at 720p x 81, VSA2 only, one timed iteration
      timeout 400 python3 benchmarks/bench_wan22.py --model a14b_i2v --resolution 720p \
        --only-sparse --reps 1 --steps 4 --train-steps 2 --out "$OUT/wan22_a14b_720p.md" 2>&1 | tail -8 ;;
    rl)
      timeout 300 python3 benchmarks/bench_rl_step.py --steps 8 --train-steps 4 --out "$OUT/rl_step.md" 2>&1 | tail -12 ;;
    e2e)
      timeout 80 python3 benchmarks/bench_e2e.py --grids 720p --compile off --forward-only --reps 2 \
        --warmup 1 --only "VSA2 0.95 kv64" \
        --out "$OUT/e2e.md" 2>&1 | tail -20 ;;
    attention_all)  # the whole table: both Wan shapes, kv 16/32/64, FlexAttention, FastVideo
      timeout 420 python3 benchmarks/bench_attention.py --out "$OUT/attention_all.md" \
        > "$OUT/attention_all.log" 2>&1; tail -4 "$OUT/attention_all.log" ;;
    e2e_all)  # the DiT table: forward and forward+backward, compiled, 0.875 and 0.95 (GRIDS)
      timeout 500 python3 benchmarks/bench_e2e.py --grids ${GRIDS:-480p 720p} --compile on \
        --reps 2 --warmup 1 --only "VSA2 0.875 kv64" "VSA2 0.95 kv64" \
        --out "$OUT/e2e_all_${GRIDS// /_}.md" > "$OUT/e2e_all.log" 2>&1; tail -8 "$OUT/e2e_all.log" ;;
    e2e_compiled)  # the DiT with torch.compile of the blocks: 720p forward
      timeout 240 python3 benchmarks/bench_e2e.py --grids 720p --compile on --forward-only \
        --reps 2 --warmup 1 --only "VSA2 0.95 kv64" --out "$OUT/e2e_compiled.md" 2>&1 | tail -8 ;;
    testbed_bases)  # claims-recipe bases with truthful captions (docs/results.md) and their gates
      for spec in ${TESTBED_BUILDS:-s025=0.25 s05=0.5 s1=1}; do
        timeout 480 python3 -P -m vsa2_rl.toy.testbed --out "$OUT/testbed_${spec%=*}" --device cuda \
          --attention rebase --mirrored-captions 0 --steps-scale "${spec#*=}" \
          > "$OUT/testbed_${spec%=*}.log" 2>&1 || echo "testbed build ${spec%=*} failed"
        timeout 300 python3 -P -m vsa2_rl.toy.gate --model "$OUT/testbed_${spec%=*}" --device cuda \
          --eval-sparsity ${TESTBED_EVAL_SPARSITY:-0.5} --micro-batch 8 2>&1 | head -1
      done ;;
    testbed_rl_base)  # RL bases for the testbed (--recipe rl) at RL_BASE_SCALES, gated at 0.5
      # in parallel; call again to continue a build cut short (a base built or gated by an
      # earlier call on this machine is kept). Each
      # base's weights come back split under 15 MiB (cat the parts into one tar)
      for scale in ${RL_BASE_SCALES:-1 0.5}; do  # timeout's SIGTERM saves a build's state
        grep -qs '"build_seconds"' "/tmp/rl_base_$scale.log" || timeout 430 python3 -P -m \
          vsa2_rl.toy.testbed --out "/tmp/rl_base_$scale" --device cuda --recipe rl --resume \
          --steps-scale "$scale" >> "/tmp/rl_base_$scale.log" 2>&1 &
      done; wait
      for scale in ${RL_BASE_SCALES:-1 0.5}; do
        base=/tmp/rl_base_$scale  # a build cut short has no closing JSON line: not gated
        grep -q '"build_seconds"' "$base.log" || { echo "$scale: build unfinished"; continue; }
        grep -qs '"direction_before"' "$base/gate.txt" || timeout 130 python3 -P -m vsa2_rl.toy.gate \
          --model "$base" --device cuda --eval-sparsity 0.5 --micro-batch 8 > "$base/gate.txt" 2>&1 &
      done; wait
      for scale in ${RL_BASE_SCALES:-1 0.5}; do
        base=/tmp/rl_base_$scale; cp "$base.log" "$OUT/"; [ -d "$base" ] || continue
        echo "$scale: $(head -2 "$base/gate.txt" 2>/dev/null | tr '\n' ' ')"
        tar -C /tmp -cf - --exclude="*.mp4" "rl_base_$scale" | split -b 15M -d - "$OUT/rl_base_$scale.tar."
      done ;;
    long_toy)  # the long toy (testbed --recipe long: the shipped toy at 32 frames) at each of
      # LONG_STEPS_LIST's stage lengths in parallel; call again to continue a build cut short (a
      # build finished by an earlier call on this machine is kept); pick_rl_base.py names the
      # one whose figures at 0.5 meet the RL-base gates (/tmp/long_base); bases come back in
      # $OUT/long_bases.tgz (weights, a cut build's state and figures, no samples: carry it back
      # as .gpu_state/long_bases.tgz to go on on another machine)
      for steps in ${LONG_STEPS_LIST:-100 200 400}; do  # timeout's SIGTERM saves a build's state
        grep -qs '"build_seconds"' "/tmp/long_$steps.log" || timeout ${LONG_BUILD_S:-300} python3 -P -m \
          vsa2_rl.toy.testbed --out "/tmp/long_$steps" --device cuda --recipe long --resume --from "$PWD/assets/toy" \
          --long-steps "$steps" >> "/tmp/long_$steps.log" 2>&1 &
      done; wait
      for steps in ${LONG_STEPS_LIST:-100 200 400}; do
        cp "/tmp/long_$steps.log" "$OUT/"; grep "samples (eval prompts" "/tmp/long_$steps.log" | tail -1 | cut -c1-400
      done
      PYTHONSAFEPATH=1 python3 benchmarks/pick_rl_base.py --build-sparsity 0.5 /tmp/long_*/ > /tmp/long_base.txt \
        && ln -sfn "$(cat /tmp/long_base.txt)" /tmp/long_base; echo "long base: $(cat /tmp/long_base.txt)"
      touch /tmp/long_base.txt; tar -C /tmp -czf "$OUT/long_bases.tgz" --exclude="*.mp4" long_base.txt long_[0-9]* ;;
    sparse_rollouts)  # RL at rollout sparsities SWEEP_SPARSITIES on an RL base (RL_BASE, else the
      # long toy's, /tmp/long_base); call again until every run is done (finished runs are
      # skipped, cut ones resume); solo step timing once they all are
      sweep=/tmp/sparse_rollouts; base=${RL_BASE:-/tmp/long_base}
      [ -d "$base" ] || { echo "no RL base ($base): run long_toy first"; continue; }
      # PYTHONSAFEPATH: the runs' train_rl.py and `-m vsa2_rl.cli` must not import the repo's
      # vsa2_rl/ (the kernels live in the installed package)
      PYTHONSAFEPATH=1 timeout ${SWEEP_S:-470} python3 benchmarks/sparse_rollouts.py run --base "$(readlink -f $base)" --out $sweep \
        --sparsities ${SWEEP_SPARSITIES:-0 0.5 0.75 0.9} --parallel ${SWEEP_PARALLEL:-19} --warmup-steps ${SWEEP_WARMUP:-0} \
        --seeds ${SWEEP_SEEDS:-0 1 2} \
        >> "$sweep.log" 2>&1 && { [ -f $sweep/seconds_per_step.json ] || PYTHONSAFEPATH=1 timeout ${SWEEP_TIME_S:-150} python3 \
        benchmarks/sparse_rollouts.py time --base "$(readlink -f $base)" --out $sweep --steps 3 \
        --sparsities ${SWEEP_SPARSITIES:-0 0.5 0.75 0.9} > "$OUT/sparse_rollouts_time.log" 2>&1; }
      cp "$sweep.log" "$OUT/sparse_rollouts_run.log"; tail -4 "$sweep.log"
      PYTHONSAFEPATH=1 python3 benchmarks/sparse_rollouts.py report --out $sweep 2>&1 | tail -3
      sweep_rows sparse_rollouts ;;
    toy_sweep)  # the same sweep on the shipped 512-token toy (configs/default.yaml and its
      # control at the toy's GPU settings, float32, reference attention), rollouts at
      # 0-0.75, evaluated dense and at 0.25
      sweep=/tmp/toy_sweep
      gpu="model.dtype=float32 attention.backend=torch rl.prompts_per_step=16 rl.train_batch_size=32
        train.num_steps=40 train.learning_rate=3e-5 nft.timestep_fraction=0.99 rl.kl_beta=0.1
        eval.every=10 sparsity.eval=0 train.checkpoint_every=5 train.sample_every=0"
      PYTHONSAFEPATH=1 timeout ${TOY_SWEEP_S:-400} python3 benchmarks/sparse_rollouts.py run --base "$PWD/assets/toy" \
        --out $sweep --configs configs/default.yaml configs/toy_control.yaml --sparsities 0 0.25 0.5 0.75 \
        --eval-sparsity 0.25 --parallel 16 --set $gpu >> "$sweep.log" 2>&1
      cp "$sweep.log" "$OUT/toy_sweep_run.log"; tail -4 "$sweep.log"
      PYTHONSAFEPATH=1 python3 benchmarks/sparse_rollouts.py report --out $sweep --eval-sparsity 0.25 2>&1 | tail -3
      sweep_rows toy_sweep ;;
    drift)  # remedies for the toy default's and its control's drift (drift_remedies.py): each
      # variant of DRIFT_VARIANTS at seeds DRIFT_SEEDS, DRIFT_PARALLEL runs at once, at the
      # toy_sweep's settings; call again until every run is done (finished runs are skipped,
      # cut ones resume from their last checkpoint, every 5 steps); the report of what is done
      sweep=/tmp/drift
      # benchmarks/ on the path: drift_remedies imports sparse_rollouts (PYTHONSAFEPATH drops it)
      PYTHONPATH=$PYTHONPATH:$PWD/benchmarks PYTHONSAFEPATH=1 timeout ${DRIFT_S:-470} python3 benchmarks/drift_remedies.py run --out $sweep \
        ${DRIFT_VARIANTS:+--variants $DRIFT_VARIANTS} ${DRIFT_SEEDS:+--seeds $DRIFT_SEEDS} \
        --parallel ${DRIFT_PARALLEL:-20} >> "$sweep.log" 2>&1
      cp "$sweep.log" "$OUT/drift_run.log"; tail -4 "$sweep.log"
      PYTHONPATH=$PYTHONPATH:$PWD/benchmarks PYTHONSAFEPATH=1 python3 benchmarks/drift_remedies.py report --out $sweep 2>&1 | tail -8
      sweep_rows drift ;;
    nft_guidance)  # guidance in DiffusionNFT (nft_guidance.py): a toy base with caption
      # dropout 0.1 (built here unless carried back as .gpu_state/guidance_base.tar, which this
      # part writes to $OUT), then GUIDANCE_VARIANTS x GUIDANCE_SEEDS (controls at
      # GUIDANCE_CONTROL_SEEDS, default the same), GUIDANCE_PARALLEL at once;
      # call again until every run and sweep is done; the report of what is done
      sweep=/tmp/guidance
      mkdir -p $sweep
      [ -f .gpu_state/guidance_base.tar ] && [ ! -d $sweep/base ] \
        && tar -C $sweep -xf .gpu_state/guidance_base.tar
      if [ ! -f $sweep/base/toy.safetensors ]; then
        timeout ${GUIDANCE_BUILD_S:-300} python3 -P scripts/build_toy_model.py --device cuda \
          --caption-dropout 0.1 --out $sweep/base > $sweep/base_build.log 2>&1
        echo "guidance base build rc=$?"; grep -v " step " $sweep/base_build.log | grep "^|\|saved" | tail -6
        cp $sweep/base_build.log $sweep/base/ 2>/dev/null
      fi
      tar -C $sweep -cf "$OUT/guidance_base.tar" base
      PYTHONPATH=$PYTHONPATH:$PWD/benchmarks PYTHONSAFEPATH=1 timeout ${GUIDANCE_S:-400} python3 benchmarks/nft_guidance.py run --out $sweep \
        --base $sweep/base ${GUIDANCE_VARIANTS:+--variants $GUIDANCE_VARIANTS} \
        ${GUIDANCE_SEEDS:+--seeds $GUIDANCE_SEEDS} \
        ${GUIDANCE_CONTROL_SEEDS:+--control-seeds $GUIDANCE_CONTROL_SEEDS} --parallel ${GUIDANCE_PARALLEL:-18} >> "$sweep.log" 2>&1
      cp "$sweep.log" "$OUT/guidance_run.log"; tail -4 "$sweep.log"
      PYTHONPATH=$PYTHONPATH:$PWD/benchmarks PYTHONSAFEPATH=1 python3 benchmarks/nft_guidance.py report --out $sweep 2>&1 | tail -8
      sweep_rows guidance ;;
    frontier)  # the router settings' quality-speed frontier: the op at the router claim's densities
      # (its two routers only: kv16 top-p, kv64 top-k), then frontier.py's table and choice
      for router in 16:topp 64:topk; do
        timeout 200 python3 benchmarks/bench_attention.py --shapes 720p --kv-blocks ${router%:*} \
          --router-modes ${router#*:} --sparsities 0.75,0.875,0.9375,0.96875 --no-flex \
          --no-fastvideo --out "$OUT/frontier_kv${router%:*}.md" >> "$OUT/frontier_attention.log" 2>&1
      done
      cat "$OUT"/frontier_kv*.md > "$OUT/frontier_attention.md"
      rl=""; [ -f "$OUT/frontier_rl.md" ] && rl="--rl $OUT/frontier_rl.md"  # frontier_rl ran first
      python3 benchmarks/frontier.py --attention "$OUT/frontier_attention.md" $rl \
        --out "$OUT/frontier.md" ;;
    frontier_rl)  # the same routers' 1.3B RL iteration at 720p x 81, compiled blocks (the recipe
      # candidates: VSA's 0.875 kv64 top-k, kv16 top-p at the densities within its loss spread)
      (cd benchmarks && timeout ${FRONTIER_RL_S:-420} python3 bench_rl_scale.py --grids 720p:81 \
        --compile --sparsities 0 0.875 0.9375 --kv-blocks 16 64 --router-modes topp topk --reps 2 \
        --out "$OUT/frontier_rl.md" > "$OUT/frontier_rl.log" 2>&1; grep "^|" "$OUT/frontier_rl.log" | tail -5) ;;
    rl_recipe)  # the recipes' router (kv64 top-k 0.875) against dense at 480p x 81 and 720p x 81,
      # compiled blocks (the first calls say what compiling costs), and the whole iteration
      # against its sum of parts at 480p x 81 (--check); RL_RECIPE_ARGS adds options
      (cd benchmarks && timeout ${RL_RECIPE_S:-450} python3 bench_rl_scale.py --grids 480p:81 720p:81 \
        --compile --sparsities 0 0.875 --kv-blocks 64 --router-modes topk --reps 2 --check \
        ${RL_RECIPE_ARGS:-} --out "$OUT/rl_recipe.md" > "$OUT/rl_recipe.log" 2>&1
       grep "^|\|^check\|^First" "$OUT/rl_recipe.md" | tail -9) ;;
    rl_fused)  # the recipes' router against dense at 480p x 81, blocks eager (as before fusion)
      # and through the fused kernels: what model.fused_kernels buys an RL iteration
      (cd benchmarks && for blocks in "" --fused; do
         timeout ${RL_FUSED_S:-250} python3 bench_rl_scale.py --grids 480p:81 $blocks \
           --sparsities 0 0.875 --kv-blocks 64 --router-modes topk --reps 2 \
           --out "$OUT/rl_fused${blocks:+_fused}.md" >> "$OUT/rl_fused.log" 2>&1
       done; grep -h "^|" "$OUT"/rl_fused*.md | grep -v "^|--\|^| grid") ;;
    model_families)  # HunyuanVideo-1.5, MiniMax-H3 and LTX-2 at native shapes, random bf16
      # weights: forward and LoRA training pass, dense against VSA2 kv64 top-k 0.875
      timeout ${FAMILIES_S:-540} python3 -P benchmarks/bench_model_families.py --reps 2 ${FAMILIES_ARGS:-} \
        --out "$OUT/model_families.md" > "$OUT/model_families.log" 2>&1
      grep "^|" "$OUT/model_families.md" | tail -4 ;;
    rl_scale)  # the 1.3B recipe's iteration from parts, 480p x 33 and 720p x 81, sparsities 0-0.9
      (cd benchmarks && timeout 560 python3 bench_rl_scale.py --grids 480p:33 720p:81 --full \
        --sparsities 0 0.5 0.75 0.9 --out "$OUT/rl_scale.md" 2>&1 | grep "^|" | tail -9) ;;
    rl_720p)  # the 1.3B shape at 720p x 81, kv_block 64 and 16 at 0.9 and 0.95: LoRA and full
      # fine-tuning uncompiled, then LoRA with compiled blocks (rows kept if the time runs out)
      (cd benchmarks && timeout ${RL_720P_S:-250} python3 bench_rl_scale.py --grids 720p:81 --full \
        --sparsities 0 0.9 0.95 --kv-blocks 64 16 --reps 2 --out "$OUT/rl_720p.md" 2>&1 \
        | grep "^|" | tail -5
       timeout ${RL_720P_COMPILED_S:-330} python3 bench_rl_scale.py --grids 720p:81 --compile \
        --sparsities 0 0.9 0.95 --kv-blocks 64 16 --reps 2 --out "$OUT/rl_720p_compiled.md" \
        > "$OUT/rl_720p_compiled.log" 2>&1; grep "^|" "$OUT/rl_720p_compiled.log" | tail -5
       tail -3 "$OUT/rl_720p_compiled.log") ;;
    rl_scale_14b)  # the 14B shape's iteration from parts at 720p x 81, LoRA, dense and 0.9 (kv64)
      (cd benchmarks && timeout 560 python3 bench_rl_scale.py --model 14b --grids 720p:81 \
        --sparsities 0 0.9 --reps 1 --out "$OUT/rl_scale_14b.md" 2>&1 | grep "^|\|Peak" | tail -4) ;;
    rl_growth)  # the same, LoRA, dense and 0.9 at 33-121 frames (the growth plot's points)
      (cd benchmarks && timeout 300 python3 bench_rl_scale.py --grids 480p:81 720p:33 480p:121 \
        720p:121 --sparsities 0 0.9 --reps 2 --out "$OUT/rl_growth.md" 2>&1 | grep "^|" | tail -9) ;;
    rl_compiled)  # the RL iteration with torch.compile of the blocks: one RL iteration at 480p
      timeout 400 python3 benchmarks/bench_rl_step.py --steps 8 --train-steps 4 --compile \
        --out "$OUT/rl_step_compiled.md" > "$OUT/rl_compiled.log" 2>&1; tail -8 "$OUT/rl_compiled.log" ;;
    ddp)  # the trainer on 2 GPUs (DDP, NCCL) vs 1 GPU, same global batch and seeds (toy model)
      toy="--config /tmp/toy_gpu.yaml model.path=$PWD/assets/toy train.num_steps=3
        rl.prompts_per_step=2 rl.group_size=4 sampler.num_steps=8 train.checkpoint_every=0
        logging.progress=false"
      # image_quality needs no OpenCV (absent on that image); YAML file: the value has spaces
      printf 'rewards:\n  functions:\n    - name: image_quality\n' > /tmp/toy_gpu.yaml
      # PYTHONSAFEPATH: same reason as -P above, for accelerate's child processes too
      PYTHONSAFEPATH=1 timeout 80 accelerate launch --config_file configs/accelerate/ddp_2gpu.yaml \
        train_rl.py $toy out_dir=/tmp/ddp2 > "$OUT/ddp2.log" 2>&1; tail -5 "$OUT/ddp2.log"
      PYTHONSAFEPATH=1 CUDA_VISIBLE_DEVICES=0 timeout 60 python3 train_rl.py $toy out_dir=/tmp/gpu1 \
        2>&1 | tail -3
      cp /tmp/ddp2/metrics.jsonl "$OUT/ddp2_metrics.jsonl"; cp /tmp/gpu1/metrics.jsonl "$OUT/gpu1_metrics.jsonl" ;;
    ab)  # fine stage of this tree vs the wheel in .whl_base/ (the last commit), same GPU, 720p
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site_base .whl_base/*.whl || exit 1
      for tree in base new; do
        site=/tmp/site; [ $tree = base ] && site=/tmp/site_base:/tmp/site
        PYTHONPATH=$site timeout 150 python3 benchmarks/bench_attention.py --shapes 720p \
          --kv-blocks ${KV_BLOCKS:-16,64} --sparsities 0.95 --no-flex --no-fastvideo \
          --router-modes ${ROUTER_MODES:-topk} --out "$OUT/ab_$tree.md" > /dev/null 2>&1
        echo "-- $tree"; grep "ours\|cudnn" "$OUT/ab_$tree.md"
      done ;;
    bwd_tests)  # GPU tests of the fused backward (bf16 against float64, CUDA graphs)
      timeout 240 python3 -P -m pytest -q -m gpu --tb=short -k "fused or cuda_graph" \
        tests/test_block_sparse_attention.py tests/test_vsa2_attention.py > "$OUT/bwd_tests.log" 2>&1
      tail -15 "$OUT/bwd_tests.log" ;;
    bwd_ab)  # fine stage and full op (topp), fwd+bwd, two-pass vs fused backward, 720p
      # s=0.95, kv_block 16 then 64 (BWD_PATHS: --bwd entries, e.g. two_pass,fused,fused:1);
      # per-kernel device times (--profile) in the log
      timeout 290 python3 benchmarks/bench_attention.py --shapes 720p --kv-blocks ${BWD_KV:-16,64} \
        --sparsities 0.95 --no-flex --no-fastvideo --router-modes topp \
        --bwd ${BWD_PATHS:-two_pass,fused} --profile --out "$OUT/bwd_ab.md" > "$OUT/bwd_ab.log" 2>&1
      echo "bwd_ab rc=$?"; grep "^720p" "$OUT/bwd_ab.log"
      grep -A 18 "^-- kernels of" "$OUT/bwd_ab.log" | grep -v "^-\{20\}" | cut -c1-125 ;;
    host_ab)  # wall / host-issue / device time of the full op, last commit vs this tree
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site_base .whl_base/*.whl || exit 1
      for case in ${HOST_CASES:-480p:16 720p:64}; do
        for tree in base new; do
          site=/tmp/site; [ $tree = base ] && site=/tmp/site_base:/tmp/site
          echo "-- $tree $case"
          PYTHONPATH=$site timeout 100 python3 benchmarks/tune_kernels.py --host \
            --shape ${case%:*} --kv-block ${case#*:} --mode topp 2>/dev/null | grep "^|" | tail -2
        done
      done ;;
    profile)  # per-kernel device times of the full op (router, pooling, fusion, fine stage)
      timeout 120 python3 benchmarks/tune_kernels.py --profile --rows 22 > "$OUT/profile.txt" 2>&1
      tail -3 "$OUT/profile.txt" ;;
    profile_rl)  # (after "wan") where one RL iteration of the 1.3B recipe's time goes, by phase
      # and kernel class (profile_rl_iteration.py, its last of 2 steps profiled): 480p x 33,
      # 1 prompt x PROFILE_GROUP videos a step, the recipe's sampler, guidance, KL, LoRA and
      # attention.
      # Rewards: image_quality (the recipe's need weights under /data and OpenCV); the folder's
      # text encoder is a one-layer stand-in. PROFILE_RUNS: dense and/or vsa2; PROFILE_GROUP:
      # videos a step (the same passes per video). At 4 videos and 265 s a run, both runs were
      # cut in the analysis after their steps (H100): give one run a call, or 2 videos
      [ -d /tmp/wan1.3b ] || python3 benchmarks/make_wan_shaped.py /tmp/wan1.3b > /dev/null 2>&1
      for name in ${PROFILE_RUNS:-dense vsa2}; do
        dense=""; [ "$name" = dense ] && dense="sparsity.train=0.0 sparsity.eval=0.0"
        rm -rf /tmp/profile_rl_$name  # a fresh run folder on a warm machine
        PYTHONSAFEPATH=1 timeout ${PROFILE_S:-560} python3 benchmarks/profile_rl_iteration.py \
          --config configs/wan2_1_1.3b_vsa2_grpo.yaml model.path=/tmp/wan1.3b \
          rl.prompts_per_step=1 rl.group_size=${PROFILE_GROUP:-8} \
          "rewards.functions=[{name: image_quality}]" "logging.report_to=[]" logging.progress=false out_dir=/tmp/profile_rl_$name $dense \
          --out "$OUT/profile_rl_$name.md" > "$OUT/profile_rl_$name.log" 2>&1
        echo "profile_rl $name rc=$?"; grep "^| \*\*step\|^| share\|^Profile" "$OUT/profile_rl_$name.md"
      done ;;
    wan)  # a Wan-1.3B-shaped diffusers folder with random weights for the runs below
      python3 benchmarks/make_wan_shaped.py /tmp/wan1.3b > /dev/null 2>&1 || echo "model folder failed" ;;
    plan_memory)  # (after "wan") the 1.3B recipes' plan (vsa2-rl check) against one step's
      # measured peak: each *_vsa2_$alg.yaml, 2 rollouts, rewards swapped for image_quality
      # (PLAN_EXTRA: overrides for both, e.g. model.compile_blocks=false)
      du -sb /tmp/wan1.3b/* > "$OUT/plan_memory_folder_bytes.txt"
      one_step=(model.path=/tmp/wan1.3b rl.group_size=2 rl.prompts_per_step=1 train.num_steps=1
        "rewards.functions=[{name: image_quality}]" eval.every=0 train.sample_every=0
        "logging.report_to=[]" logging.progress=false ${PLAN_EXTRA:-})
      for alg in ${PLAN_ALGORITHMS:-nft grpo}; do
        recipe=configs/wan2_1_1.3b_vsa2_$alg.yaml
        PYTHONSAFEPATH=1 python3 -m vsa2_rl.cli check --config $recipe "${one_step[@]}" \
          > "$OUT/plan_memory_check_$alg.txt" 2>&1
        PYTHONSAFEPATH=1 timeout ${PLAN_RUN_S:-330} python3 train_rl.py --config $recipe \
          "${one_step[@]}" out_dir=/tmp/plan_$alg > "$OUT/plan_memory_run_$alg.log" 2>&1
        echo "$alg rc=$?"; cp /tmp/plan_$alg/metrics.jsonl "$OUT/plan_memory_$alg.jsonl"
        grep "memory" "$OUT/plan_memory_check_$alg.txt"
        grep -o '"perf/[a-z_]*": [0-9.e+-]*' "$OUT/plan_memory_$alg.jsonl"
      done ;;
    gpu1)  # the engines' reference: the short Wan-shaped run on one GPU
      PYTHONSAFEPATH=1 timeout 240 python3 $run out_dir=/tmp/mg/gpu1 > "$OUT/mg_gpu1.log" 2>&1
      tail -2 "$OUT/mg_gpu1.log" ;;
    algorithms)  # (after "wan"): seconds per iteration of Flow-GRPO and DiffusionNFT,
      # same samples per step, at the 1.3B recipe's attention settings; then the table
      recipe="attention.kv_block=16 attention.mode=topp train.num_steps=3 sampler.num_steps=8"
      PYTHONSAFEPATH=1 timeout 200 python3 $run $recipe out_dir=/tmp/alg/flow_grpo \
        > "$OUT/alg_flow_grpo.log" 2>&1; tail -2 "$OUT/alg_flow_grpo.log"
      PYTHONSAFEPATH=1 timeout 200 python3 $run $recipe rl.algorithm=nft sampler.kind=ode \
        out_dir=/tmp/alg/nft > "$OUT/alg_nft.log" 2>&1; tail -2 "$OUT/alg_nft.log"
      python3 benchmarks/compare_runs.py flow_grpo=/tmp/alg/flow_grpo nft=/tmp/alg/nft \
        --keys reward/mean perf/rollout_s perf/train_s perf/peak_mem_gib --out "$OUT/algorithms.md" ;;
    engines)  # the same run on 2 GPUs with DDP, ZeRO-2 and ZeRO-3, then the comparison table
      for engine in ${ENGINES:-ddp_2gpu zero2 zero3}; do
        PYTHONSAFEPATH=1 timeout 200 accelerate launch --config_file configs/accelerate/$engine.yaml \
          $run out_dir=/tmp/mg/$engine > "$OUT/mg_$engine.log" 2>&1; tail -2 "$OUT/mg_$engine.log"
      done
      runs="1gpu=/tmp/mg/gpu1"
      for engine in ${ENGINES:-ddp_2gpu zero2 zero3}; do runs="$runs $engine=/tmp/mg/$engine"; done
      python3 benchmarks/compare_runs.py $runs --out "$OUT/multigpu.md" ;;
    gluon)  # the Gluon kernels: their GPU tests, per-kernel timings against Triton, then the
      # whole op with and without them (GLUON_KV kv_blocks, GLUON_SP sparsities)
      timeout 240 python3 -P -m pytest -q -m gpu --tb=short \
        ${GLUON_TESTS:-tests/test_block_sparse_gluon.py} > "$OUT/gpu_tests.log" 2>&1
      tail -25 "$OUT/gpu_tests.log"
      timeout 200 python3 benchmarks/bench_gluon.py > "$OUT/gluon_bench.log" 2>&1
      tail -25 "$OUT/gluon_bench.log"
      for gluon in 0 1; do
        VSA2_RL_GLUON=$gluon timeout 200 python3 benchmarks/bench_attention.py --shapes 720p \
          --kv-blocks ${GLUON_KV:-16,64} --sparsities ${GLUON_SP:-0.95} --no-flex \
          --no-fastvideo --out "$OUT/gluon_$gluon.md" > /dev/null 2>&1
        echo "-- VSA2_RL_GLUON=$gluon"; grep "ours\|cudnn" "$OUT/gluon_$gluon.md"
      done ;;
    resume_toy)  # on the toy model: a ZeRO-3 (ENGINES) run stopped after step 2 and
      # resumed equals the uninterrupted 3-step run
      toy="--config /tmp/toy_gpu.yaml model.path=$PWD/assets/toy rl.prompts_per_step=2
        rl.group_size=4 sampler.num_steps=8 train.checkpoint_every=1 logging.progress=false"
      printf 'rewards:\n  functions:\n    - name: image_quality\n' > /tmp/toy_gpu.yaml
      for engine in ${ENGINES:-zero3}; do
        for run in full:3 resumed:2 resumed:3; do
          PYTHONSAFEPATH=1 timeout 90 accelerate launch --config_file configs/accelerate/$engine.yaml \
            train_rl.py $toy out_dir=/tmp/rt/${engine}_${run%:*} train.num_steps=${run#*:} \
            >> "$OUT/rt_$engine.log" 2>&1; echo "$engine $run rc=$?"
        done
        python3 benchmarks/compare_runs.py $engine=/tmp/rt/${engine}_full \
          ${engine}_resumed=/tmp/rt/${engine}_resumed --out "$OUT/resume_toy_$engine.md"
      done ;;
    resume)  # a 2-GPU run stopped after step 2 and resumed equals the uninterrupted run
      # (MG_EXTRA: overrides for both, e.g. parallel.sequence_parallel_size=2 with ENGINES=fsdp2)
      [ -d /tmp/wan1.3b ] || python3 benchmarks/make_wan_shaped.py /tmp/wan1.3b > /dev/null 2>&1
      for engine in ${ENGINES:-ddp_2gpu zero2}; do
        [ -d /tmp/mg/$engine ] || PYTHONSAFEPATH=1 timeout 200 accelerate launch --config_file \
          configs/accelerate/$engine.yaml $run out_dir=/tmp/mg/$engine ${MG_EXTRA:-} \
          > "$OUT/mg_$engine.log" 2>&1
        for steps in 2 3; do
          PYTHONSAFEPATH=1 timeout 200 accelerate launch --config_file configs/accelerate/$engine.yaml \
            $run out_dir=/tmp/mg/${engine}_resumed train.num_steps=$steps ${MG_EXTRA:-} \
            >> "$OUT/mg_${engine}_resumed.log" 2>&1; tail -2 "$OUT/mg_${engine}_resumed.log"
        done
      done
      runs=""
      for engine in ${ENGINES:-ddp_2gpu zero2}; do
        runs="$runs $engine=/tmp/mg/$engine ${engine}_resumed=/tmp/mg/${engine}_resumed"
      done
      python3 benchmarks/compare_runs.py $runs --out "$OUT/resume.md" ;;
    claims)  # VSA2's quality claims (benchmarks/sparsity_claims.py), CLAIMS="claim2 ..." (and
      # CLAIMS_ARGS, e.g. "--seeds 0") into runs/claims (kept on a warm machine), with the bases
      # they need, CLAIMS_JOBS runs at once: finished runs are reused and stopped ones saved
      # (60 s grace), so after a timeout the same call goes on. Back in $OUT: claims.md, the
      # log (each run's progress lines and the tracebacks of failed runs), claims_runs.tar in
      # 15 MiB pieces (claims_runs.tar.partNN: each finished run's config.json and sample grids
      # with their prompts, no weights, and the report's plots and sample sheets: the figures
      # to gather with those of other sessions, see sparsity_claims.py) and, for each finished
      # run in CLAIMS_KEEP (e.g. base_dense), its
      # weights in bfloat16 in 15 MiB pieces (RUN.safetensors.partNN: cat them into
      # runs/claims/RUN/toy.safetensors beside its config.json, and carry runs/claims/RUN)
      keep=() stored=
      for run in ${CLAIMS_KEEP:-}; do keep+=(--store-bf16 "$run"); done
      timeout -k 75 ${CLAIMS_S:-480} python3 -P benchmarks/sparsity_claims.py ${CLAIMS:-base} \
        ${CLAIMS_ARGS:-} --device cuda --jobs ${CLAIMS_JOBS:-1} --out runs/claims \
        > "$OUT/claims.log" 2>&1
      echo "claims rc=$?"; grep "^==" "$OUT/claims.log" | tail -12
      for log in $(find runs/claims -name "*.log" | sort); do
        echo "-- $log"; grep " step \|saved to\|stopped\|continuing\|Error" "$log"
        grep -q Traceback "$log" && tail -n 20 "$log"
      done >> "$OUT/claims.log"
      python3 -P benchmarks/sparsity_claims.py report ${CLAIMS_ARGS:-} "${keep[@]}" \
        --out runs/claims > /dev/null 2>> "$OUT/claims.log" && stored=${CLAIMS_KEEP:-}
      cp runs/claims/claims.md "$OUT/" 2>/dev/null
      ( cd runs/claims && ls claims.md ./*.png 2>/dev/null
        for info in $(find . -name config.json -exec grep -l build_device {} +); do
          echo "$info"; ls "${info%config.json}"samples/*.png "${info%config.json}"samples/*.txt
        done 2>/dev/null ) | tar -C runs/claims -cf - -T - \
        | split -b 15M -d - "$OUT/claims_runs.tar.part"
      for run in ${stored:-}; do
        split -b 15M -d runs/claims/$run/toy.safetensors "$OUT/$run.safetensors.part"
      done ;;
    toy_build)  # the toy model (scripts/build_toy_model.py) into $OUT/toy; TOY_RESUME=DIR
      # continues a build whose first stages are done
      timeout ${TOY_BUILD_S:-570} python3 -P scripts/build_toy_model.py --device cuda \
        --out "$OUT/toy" ${TOY_RESUME:+--resume-from $TOY_RESUME} > "$OUT/toy_build.log" 2>&1
      echo "toy_build rc=$?"; grep -v " step " "$OUT/toy_build.log" | grep "^|\|saved" ;;
    toy_builds)  # toy base variants built at once (TOY_BUILDS: "name=arg;arg ..." of
      # scripts/build_toy_model.py), each measured by benchmarks/toy_skill.py; every model folder
      # (weights, config, build log, skill.md) comes back as $OUT/<name>.tar
      mkdir -p /tmp/builds
      for build in ${TOY_BUILDS:-default=}; do
        name=${build%%=*}; args=${build#*=}
        ( timeout ${TOY_BUILD_S:-480} python3 -P scripts/build_toy_model.py --device cuda \
            --out /tmp/builds/$name ${args//;/ } > /tmp/builds/$name.log 2>&1
          timeout ${TOY_SKILL_S:-100} python3 -P benchmarks/toy_skill.py --model /tmp/builds/$name \
            --device cuda --out /tmp/builds/$name/skill.md > /dev/null 2>&1
          cp /tmp/builds/$name.log /tmp/builds/$name/; tar -C /tmp/builds -cf "$OUT/$name.tar" $name
        ) &
      done
      wait
      for build in ${TOY_BUILDS:-default=}; do
        name=${build%%=*}; echo "== $name"; grep "^|" /tmp/builds/$name.log | grep -v "^|---"
        cat /tmp/builds/$name/skill.md
      done ;;
    reward_signal)  # gradient signal-to-noise of the default run's settings (SIGNAL_SETTINGS:
      # "label=override;..." each), benchmarks/reward_signal.py, into $OUT/reward_signal.md
      for setting in ${SIGNAL_SETTINGS:-default=}; do
        overrides=${setting#*=}
        PYTHONSAFEPATH=1 timeout ${SIGNAL_S:-300} python3 benchmarks/reward_signal.py \
          --prompts ${SIGNAL_PROMPTS:-128} --label ${setting%%=*} --out "$OUT/reward_signal.md" \
          device=cuda model.dtype=float32 attention.backend=torch \
          model.path=${TOY_PATH:-$OUT/toy} ${overrides//;/ } 2>&1 | grep -v "^|" | tail -3
      done ;;
    toy_ceiling)  # what filtered fine-tuning of the model in TOY_PATH reaches (toy_ceiling.py)
      PYTHONSAFEPATH=1 timeout ${TOY_CEILING_S:-300} python3 benchmarks/toy_ceiling.py \
        --model ${TOY_PATH:-$OUT/toy} --device cuda ${TOY_CEILING_ARGS:-} \
        --out "$OUT/toy_ceiling.md" > "$OUT/toy_ceiling.log" 2>&1; tail -12 "$OUT/toy_ceiling.log" ;;
    toy_rl)  # the embedded default on the GPU (float32, torch attention as on the CPU) with the
      # model in $OUT/toy, all runs at once: each variant of TOY_VARIANTS ("name=override;..."
      # with the default's reward; default: the default and its random-reward control), seeds
      # TOY_SEEDS, every run with the overrides TOY_COMMON (a variant named control or
      # control_X runs the control config, with X's overrides); then the table
      mkdir -p /tmp/toy_rl
      for variant in ${TOY_VARIANTS:-default= control=}; do
        name=${variant%%=*}; overrides=${variant#*=}
        config=configs/default.yaml; [ ${name%%_*} = control ] && config=configs/toy_control.yaml
        for seed in ${TOY_SEEDS:-0 1}; do
          PYTHONSAFEPATH=1 timeout ${TOY_RL_S:-400} python3 train_rl.py --config $config \
            model.path=${TOY_PATH:-$OUT/toy} device=cuda model.dtype=float32 attention.backend=torch \
            seed=$seed out_dir=/tmp/toy_rl/${name}_$seed train.checkpoint_every=0 \
            train.sample_every=0 logging.progress=false ${TOY_COMMON:-} ${overrides//;/ } \
            > /tmp/toy_rl/${name}_$seed.log 2>&1 &
        done
      done
      wait
      for variant in ${TOY_VARIANTS:-default= control=}; do
        dirs=$(ls -d /tmp/toy_rl/${variant%%=*}_[0-9]*/ | paste -sd,); echo "${variant%%=*}=$dirs"
      done > /tmp/toy_rl/groups
      python3 benchmarks/efficacy_table.py $(cat /tmp/toy_rl/groups) --out "$OUT/toy_rl.md" ;;
    prefix)  # rollout time with the ODE prefix shared per group, Wan-1.3B shape (after
      # "wan"): moving SDE window of 2 in [0, 8) of 16 steps, one noise per group or not, VSA2
      # at the 1.3B recipe's attention settings; the table from the runs' metrics
      for shared in false true; do
        PYTHONSAFEPATH=1 timeout 300 python3 $run out_dir=/tmp/prefix_$shared sampler.num_steps=16 \
          sampler.sde_window_size=2 "sampler.sde_window_range=[0,8]" \
          sampler.same_noise_per_group=$shared rl.group_size=4 rl.prompts_per_step=1 \
          train.num_steps=4 attention.kv_block=16 attention.mode=topp > "$OUT/prefix_$shared.log" 2>&1
        tail -2 "$OUT/prefix_$shared.log"
        cp /tmp/prefix_$shared/metrics.jsonl "$OUT/prefix_${shared}_metrics.jsonl"  # kept if cut short
      done
      python3 benchmarks/compare_runs.py independent=/tmp/prefix_false shared=/tmp/prefix_true \
        --keys perf/rollout_s perf/rollout_evals | tee "$OUT/prefix.md" ;;
    sp_speed)  # (2+ GPUs) a Wan-14B-shaped forward at 720p x 81 on 1 GPU, then with
      # sequence parallelism over SP_GPUS (default 2); rows in $OUT/sp_speed.md
      for gpus in 1 ${SP_GPUS:-2}; do
        PYTHONSAFEPATH=1 timeout 400 torchrun --nproc_per_node $gpus benchmarks/bench_sp.py \
          --model 14b --layers ${SP_LAYERS:-8} --out "$OUT/sp_speed.md" > "$OUT/sp_speed_$gpus.log" 2>&1
        tail -1 "$OUT/sp_speed_$gpus.log"
      done ;;
    sp_train)  # (2 GPUs, after "wan") the Wan-shaped run at the 1.3B recipe's attention
      # settings on one GPU, and with sequence parallelism 2 under DDP and FSDP2 (the same
      # global batch: one data-parallel rank); then the table
      recipe="attention.kv_block=16 attention.mode=topp"
      PYTHONSAFEPATH=1 CUDA_VISIBLE_DEVICES=0 timeout 300 python3 $run $recipe \
        out_dir=/tmp/mg/sp1 > "$OUT/mg_sp1.log" 2>&1; tail -2 "$OUT/mg_sp1.log"
      for engine in ddp_2gpu fsdp2; do
        PYTHONSAFEPATH=1 timeout 300 accelerate launch --config_file configs/accelerate/$engine.yaml \
          $run $recipe out_dir=/tmp/mg/sp2_$engine parallel.sequence_parallel_size=2 \
          > "$OUT/mg_sp2_$engine.log" 2>&1; tail -2 "$OUT/mg_sp2_$engine.log"
      done
      python3 benchmarks/compare_runs.py 1gpu=/tmp/mg/sp1 sp2_ddp=/tmp/mg/sp2_ddp_2gpu \
        sp2_fsdp2=/tmp/mg/sp2_fsdp2 --out "$OUT/sp_train.md" ;;
    sp_memory)  # per-GPU memory of Wan-14B-shaped blocks at 720p x 81 frames, P = 1-8
      timeout 400 python3 benchmarks/sp_memory.py --out "$OUT/sp_memory.md" 2>&1 | tail -40 ;;
  esac
done
