#!/usr/bin/env bash
# The GPU benchmarks of lmforge, one part per area. From the repository root on a CUDA machine:
#
#   bash benchmarks/h200_session.sh PART [PART ...]
#
#   tests      every GPU test (pytest -m gpu), one step per part (longer than one device call)
#   kernels    benchmarks/kernels.py: attention, RMSNorm, fused linear + CE, SwiGLU/RoPE, packed
#              RoPE, AdamW, each against its peer (torch, cuDNN, Liger when its wheel is in .whl/)
#   train      benchmarks/train.py: the shipped configuration vs the nanoGPT-style peer; then a
#              3-minute real-data run when token shards are in .carry/gutenberg (the two
#              together take most of one 10-minute device call)
#   parallel   benchmarks/parallel.py on 1 GPU, then on every GPU (torchrun) when there are two+
#   serve      benchmarks/serve.py --only check,prefill,throughput,gemv,decode --profile, then
#              --only server: the user's `lmforge serve` against Engine(model) and the compiled
#              peer, issue 33's targets (fastapi/uvicorn/openai wheels in .whl/)   (issues 22, 33;
#              openai < 3: 3.x imports httpx2, which the device lacks; fastapi 0.165 needs
#              opentelemetry-api, starlette, pydantic(-core), annotated-types, typing-inspection)
#   moe        benchmarks/moe.py --train --profile   (issue 25)
#   scaling    benchmarks/scaling*.py         (issue 24)
#   posttrain  benchmarks/weight_sync.py, benchmarks/posttrain_rl.py and benchmarks/rollout.py
#              (issue 23)
#   smol       the SmolLM2 runs: benchmarks/posttrain_gsm8k.py
#              (issue 23, evidence 2; stages GSM8K_STAGES, default sft,grpo; GRPO_ITERATIONS,
#              default 20), then benchmarks/speculative.py (issue 22, benchmark 4). Needs the GGUF
#              at .carry/smol.gguf or /tmp/smol/smol.gguf: the 93.8 MiB file is over one call's
#              64 MiB carry, so split it here (split -n 2 -d FILE .carry/smol/part.), carry one
#              half per call on the same warm machine (copy the first to /tmp/smol/), join them
#              there (cat /tmp/smol/part.00 .carry/smol/part.01 > /tmp/smol/smol.gguf; sha256
#              b179c952...db53); also .carry/gsm8k/{train,test}.jsonl, .carry/ggufwhl (the gguf
#              wheel) and .carry/specdata (speculative.py --shared)
#   grpo-step  issue 34: benchmarks/posttrain_grpo_step.py, one GRPO iteration's training step on
#              GSM8K, the Trainer (fast AdamW) against the old hand loop (.carry/old/src: git
#              archive 3eb7509^ src); the GGUF in halves as for smol, joined at /tmp/smol/smol.gguf;
#              .carry/gsm8k/train.jsonl; .carry/ggufwhl (the gguf wheel)
#   recipe-prep  (on the CPU machine with ../shared, not the GPU) the GPU tier's data + tokenizer
#              (lmforge recipe run configs/recipes/h200.toml --until tokenizer), the benchmark
#              files into .carry/recipe-eval.tar.gz and the pack for pretraining in .carry/recipe-a
#   recipe-a   device call A (carry .carry/recipe-a, .carry/recipe-eval.tar.gz): pretraining,
#              SFT, the pretrained model's eval row; the pack for RL comes back in $OUT/recipe-b
#   recipe-b   device call B (carry .carry/recipe-b, .carry/recipe-eval.tar.gz; put the files of
#              call A's $OUT/recipe-b in .carry/recipe-b): GRPO on GSM8K, eval of the SFT and RL
#              models, the report card without the anchor; everything small in $OUT/recipe-card
#   layers     issue 35, call 1: GPU tests of the linear-attention kernels, hybrid serving and
#              HF hybrids; serve_hybrid.py A and GGGA, graphs vs eager
#   layers-b   issue 35, call 2: benchmarks/linear_attention.py (vs FLA, SDPA; carry .whl) and
#              serve_hybrid.py for MMMA, LLLA, WWWA, GMWA, SSSA
#   linattn    issue 35: benchmarks/linear_attention.py alone (the layers-b kernels part, vs FLA
#              and SDPA, then --profile 8192: kernel tables of our GDN forward and FLA's; carry
#              .whl), then the sliding-window GPU tests (serve decode/prefill kernels with the
#              window, the windowed training kernel) and the GDN bf16 GPU tests
#   layers-long  issue 35: serving at long context, benchmarks/serve_hybrid.py: full attention
#              (A) vs 3:1 GDN (GGGA), 32k prompt + 512 new at batch 1 and 32; decode steps
#              timed apart from prefill; memory per sequence
#   layers-long-b  the same for 3:1 GDN with a sliding-window layer (GGGW: every paged layer
#              windowed, so its blocks behind the window go back) and 3:1 sliding window :
#              global (WWWA: the W layers in per-sequence rings)
#   window-attn  issue 35: benchmarks/window_attention.py, the W layers' training kernel
#              (windowed FlashAttention-2, f+b) against SDPA with the window mask and SDPA
#              causal, T 4k-16k, windows 512-4096 (~3 minutes: fits beside a short part)
#   hybrid-quality  issue 35: benchmarks/hybrid_quality.py --family hybrids (full attention, 3:1
#              GDN / Mamba-2 / SWA hybrids, all-linear: validation curves at equal parameters and
#              tokens; carry .carry/mq)
#   dsa-quality  issue 35: benchmarks/hybrid_quality.py --family dsa (DSA warm start at top-k T/8
#              against the dense continuation; carry .carry/mq)
#   mla        issue 36: mla_engine.py --kinds GQA-4,MLA (engine decode at batch 64 x 16k)
#   mla-cla    issue 36: mla_engine.py --kinds MLA+CLA-2, benchmarks/mla.py (latent paged
#              kernel), the MLA GPU tests
#   mla-quality  issue 36: benchmarks/attention_quality.py (MHA/GQA/MLA/MLA+CLA validation curves;
#              carry .carry/mq, the Gutenberg shards made as benchmarks/mtp.py's docstring says)
#   mtp        issue 36: benchmarks/mtp.py (MTP training vs none; MTP self-speculative decoding;
#              carry .carry/mq)
#   quant      issue 37: benchmarks/quant.py --part speed --tune --profile: the GEMV launch sweep
#              (with torch's tinygemm int4 kernel per shape as the peer), then bf16, int4, int8,
#              fp8 and the peers (int4-tinygemm, int4-torch-ref, the compiled bf16 decoder) in one
#              run (engines built side by side, timed one at a time)
#   quant-more issue 37: benchmarks/quant.py --part gemv (the int4/int8/fp8 GEMV launches swept on
#              TinyLlama's shapes: the winners go into lmforge/quant/_gemv_triton.py's TABLE
#              before the next `quant`), then benchmarks/kv_quant.py (the quantized KV cache)
#   vision     issue 38: benchmarks/vlm_serve.py, TTFT with one image (carry .whl)
#   vision-train  issue 38: benchmarks/vision.py (VLM training step, CLIP vs SigLIP)
#   recipe-gpu  calls A and B as one device call (carry .carry/recipe-a, .carry/recipe-eval.tar.gz):
#              every GPU stage and the card without the anchor; $OUT/recipe-card as recipe-b's
#   recipe-anchor  (on the CPU machine, any time after recipe-prep: start it in the background
#              at once, it needs CPU-hours on a busy 2-core machine) the SmolLM2 anchor's eval
#              row on the CPU into runs/h200/evals/, the cache the card reads
#   recipe-card  (on the CPU machine, after recipe-b; put call B's $OUT/recipe-card files in
#              .carry/recipe-card) the SmolLM2 anchor row on the CPU (its GGUF does not travel;
#              skipped when already scored) and the full card: runs/h200/report.md
#              RECIPE_OVERRIDES (words) are added to every recipe command: the CPU rehearsal of
#              all four (tests/test_recipe_handoff.py) shrinks every stage with them; run the
#              four parts from one commit (stage keys hash the configs and examples they read)
#   all        every part above but smol and recipe-*, in this order (longer than one 10-minute
#              device call)
#
# A part whose script is not in the tree yet prints one line and is skipped. With OUT set, each
# command's output is also written to $OUT/<name>.log and result tables to $OUT/RESULTS-*.md
# (copied into benchmarks/RESULTS.md by hand after review); without it, output goes to the
# terminal only. Each command has its own time limit (timeout); the exit status is 1 when any
# command failed or timed out, after the others have run.
#
#   OUT=runs/h200 bash benchmarks/h200_session.sh kernels train
#   bash benchmarks/h200_session.sh parallel
#
# The GPU tests one part per device call (each part fits one ~8-minute call; tests/conftest.py's
# GPU_PARTS says which files each holds; PART:I/N runs the I-th of N slices of a part):
#
#   bash benchmarks/h200_session.sh gpu-tests kernels     # also: serve, train, other
#   bash benchmarks/h200_session.sh gpu-tests kernels:1/2
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
PARTS=(tests kernels train parallel serve moe scaling posttrain)
EXTRA_PARTS=(smol grpo-step recipe-prep recipe-anchor recipe-a recipe-b recipe-gpu recipe-card
             layers layers-b linattn layers-long layers-long-b window-attn hybrid-quality dsa-quality mla mla-cla mla-quality mtp quant quant-more vision
             vision-train)
FAILED=()

usage() {
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

# step NAME SECONDS CMD...: run CMD under a time limit, tee its output to $OUT/NAME.log when OUT
# is set, and remember a failure without stopping the part.
step() {
    local name="$1" limit="$2" rc
    shift 2
    echo "== $name: $*"
    if [ -n "${OUT:-}" ]; then
        timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
        rc=${PIPESTATUS[0]}
    else
        timeout "$limit" "$@"
        rc=$?
    fi
    [ "$rc" -eq 0 ] || { echo "== $name: exit status $rc"; FAILED+=("$name"); }
}

# results NAME: the --results flag for $OUT/RESULTS-NAME.md, or nothing without OUT.
results() {
    [ -n "${OUT:-}" ] && printf -- '--results\n%s\n' "$OUT/RESULTS-$1.md"
}

# have PART FILE...: true when one of the files exists, else one line saying the part is skipped.
have() {
    local part="$1" f
    shift
    for f in "$@"; do [ -f "$f" ] && return 0; done
    echo "== $part: $* not in this tree yet; skipped"
    return 1
}

GPU_TEST_PARTS=(kernels serve train other)

# gpu_tests PART: one part of the GPU tier (pytest -m gpu --gpu-part PART), under 8 minutes.
gpu_tests() {
    step "gpu-tests-${1//[:\/]/-}" 480 "$PY" -m pytest -q -m gpu --gpu-part "$1" -p no:cacheprovider tests
}

part_tests() {
    local p
    for p in "${GPU_TEST_PARTS[@]}"; do gpu_tests "$p"; done
}

part_kernels() {
    local -a res
    mapfile -t res < <(results kernels)
    step kernels 480 "$PY" benchmarks/kernels.py "${res[@]}"
}

part_train() {
    local -a res
    mapfile -t res < <(results train)
    step train 420 "$PY" benchmarks/train.py "${res[@]}"
    if [ -d .carry/gutenberg ]; then
        mapfile -t res < <(results realdata)
        # The run folder (checkpoints of GBs) stays out of $OUT; its curve and metrics go there.
        rm -rf /tmp/lmforge-realdata
        step realdata 300 "$PY" benchmarks/train.py --real-data .carry/gutenberg --minutes 3 \
            --real-steps 2000 --out /tmp/lmforge-realdata "${res[@]}"
        if [ -n "${OUT:-}" ]; then
            cp /tmp/lmforge-realdata/loss_curve.png "$OUT/realdata-loss_curve.png" 2>/dev/null
            cp /tmp/lmforge-realdata/metrics.jsonl "$OUT/realdata-metrics.jsonl" 2>/dev/null
        fi
    else
        echo "== realdata: no token shards in .carry/gutenberg; skipped"
    fi
}

part_parallel() {
    local -a res
    local gpus
    gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
    mapfile -t res < <(results parallel1)
    step parallel1 200 torchrun --nproc_per_node 1 benchmarks/parallel.py "${res[@]}"
    if [ "${gpus:-0}" -ge 2 ]; then
        mapfile -t res < <(results "parallel$gpus")
        step "parallel$gpus" 330 torchrun --nproc_per_node "$gpus" benchmarks/parallel.py "${res[@]}"
    else
        echo "== parallel: one GPU visible; the multi-GPU run is skipped"
    fi
}

part_serve() {
    have serve benchmarks/serve.py || return 0
    # kernels first (prefill, decode GEMV: each checked against float64, timed against its peer),
    # then the benchmark rows they feed; the server under load in its own step
    step serve 420 "$PY" benchmarks/serve.py --only check,prefill,throughput,gemv,decode --profile
    step serve-server 540 "$PY" benchmarks/serve.py --only server
}

part_moe() {
    have moe benchmarks/moe.py && step moe 540 "$PY" benchmarks/moe.py --train --profile
}

part_scaling() {
    local f
    have scaling benchmarks/scaling*.py || return 0
    for f in benchmarks/scaling*.py; do step "$(basename "$f" .py)" 540 "$PY" "$f"; done
}

part_posttrain() {
    local f
    have posttrain benchmarks/weight_sync.py benchmarks/posttrain_rl.py || return 0
    for f in benchmarks/weight_sync.py benchmarks/posttrain_rl.py; do
        [ -f "$f" ] && step "$(basename "$f" .py)" 540 "$PY" "$f"
    done
    [ -f benchmarks/rollout.py ] && step rollout 240 "$PY" benchmarks/rollout.py --profile
}

part_grpo-step() {   # issue 34: one GRPO iteration's step, Trainer vs the old loop, on the GPU
    # the GGUF joined from its halves (call 1 copies .carry/smol/part.00 to /tmp/smol/, call 2
    # carries part.01); the old loop's src in .carry/old/src (git archive 3eb7509^ src)
    if [ ! -f /tmp/smol/smol.gguf ] && [ -f /tmp/smol/part.00 ] && [ -f .carry/smol/part.01 ]; then
        cat /tmp/smol/part.00 .carry/smol/part.01 > /tmp/smol/smol.gguf.tmp &&
            mv /tmp/smol/smol.gguf.tmp /tmp/smol/smol.gguf
    fi
    need grpo-step /tmp/smol/smol.gguf .carry/old/src/lmforge/__init__.py .carry/gsm8k/train.jsonl || return 0
    if ls .carry/ggufwhl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/lmforge-gguf .carry/ggufwhl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/lmforge-gguf"
    fi
    step grpo-step 540 "$PY" benchmarks/posttrain_grpo_step.py --device cuda \
        --model /tmp/smol/smol.gguf --data .carry/gsm8k/train.jsonl --old-src .carry/old/src ${NEW_SRC:+--new-src "$NEW_SRC"} \
        --out "${OUT:-runs/grpo-step}/grpo-step"
}

part_smol() {
    # the GGUF joined from its two carried halves, wherever the calls put it
    [ -f .carry/smol.gguf ] || [ ! -f /tmp/smol/smol.gguf ] || ln -sf /tmp/smol/smol.gguf .carry/smol.gguf
    have smol .carry/smol.gguf || return 0
    # gguf (the GGUF reader) is not on the GPU host: its wheel travels in .carry/ggufwhl
    if ls .carry/ggufwhl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/lmforge-gguf .carry/ggufwhl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/lmforge-gguf"
    fi
    if [ -f .carry/gsm8k/test.jsonl ]; then
        # GSM8K evidence first (issue 23; part posttrain's rollout profile says whether GRPO's
        # sampling is fast)
        step posttrain_gsm8k 540 "$PY" benchmarks/posttrain_gsm8k.py --device cuda --quiet \
            --stages "${GSM8K_STAGES:-sft,grpo}" --grpo-iterations "${GRPO_ITERATIONS:-20}" \
            --model .carry/smol.gguf --data-dir .carry/gsm8k --out runs/posttrain_gsm8k
        [ -n "${OUT:-}" ] && cp runs/posttrain_gsm8k/*.json runs/posttrain_gsm8k/*.png "$OUT/" 2>/dev/null
    else
        echo "== smol: no .carry/gsm8k/test.jsonl; the GSM8K runs are skipped"
    fi
    # benchmark 4 of issue 22 on the GPU; its prompts' data (GSM8K, six Gutenberg books) in
    # .carry/specdata, laid out like ../shared
    step speculative 240 "$PY" benchmarks/speculative.py --device cuda --gguf .carry/smol.gguf \
        --shared .carry/specdata
}

# The evidence of issues 35-38, one device call each (each step with its own limit; carry .whl
# for FLA's wheel in part layers, and runs/hq_data (train.bin, val.bin) for the quality curves).
part_layers() {   # issue 35 (call 1 of 2): GPU tests, hybrid serving: A and GGGA, graphs vs eager
    local o="${OUT:-runs/h200}"
    step layers-gpu-tests 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_kernels_ssd.py tests/test_kernels_gated_delta.py tests/test_hybrid.py \
        tests/test_serve_hybrid.py tests/test_serve_compiled_hybrid.py tests/test_hf_hybrid.py
    have layers benchmarks/serve_hybrid.py && step serve-hybrid-a 300 "$PY" \
        benchmarks/serve_hybrid.py --patterns A,A-eager,GGGA,GGGA-eager --out "$o/serve_hybrid_a"
}

part_layers-b() { # issue 35 (call 2 of 2): kernels vs FLA and SDPA; serving M, L, W, mixed, S
    local o="${OUT:-runs/h200}"
    have layers-b benchmarks/linear_attention.py &&
        step linear-attention 300 "$PY" benchmarks/linear_attention.py --budget 240 --out "$o/linattn"
    have layers-b benchmarks/serve_hybrid.py && step serve-hybrid-b 260 "$PY" \
        benchmarks/serve_hybrid.py --patterns MMMA,LLLA,WWWA,GMWA,SSSA --out "$o/serve_hybrid_b"
}

part_linattn() {  # issue 35: the kernels vs FLA and SDPA alone, then the W layers' GPU tests
    local o="${OUT:-runs/h200}"       # (carry .whl for FLA)
    have linattn benchmarks/linear_attention.py &&
        step linear-attention 330 "$PY" benchmarks/linear_attention.py --budget 250 --profile 8192 \
            --out "$o/linattn"
    step window-gpu-tests 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_serve_attention.py tests/test_kernels_gpu.py -k "window or sliding_window"
    step gdn-bf16-gpu-tests 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_kernels_gated_delta.py -k bf16
}

part_layers-long() {  # issue 35: 32k context + 512 new, batch 1 and 32: A and GGGA
    local o="${OUT:-runs/h200}"
    # two patterns a call: each engine's compile and graph capture plus its check take minutes
    # (four in one call would not fit 10 minutes); GGGW and WWWA in part layers-long-b
    have layers-long benchmarks/serve_hybrid.py && step serve-hybrid-long 560 "$PY" \
        benchmarks/serve_hybrid.py --patterns A,GGGA --batch 1,32 --prompt 32768 \
        --new 512 --repeats 1 --out "$o/serve_hybrid_long"
}

part_layers-long-b() {  # issue 35: the same for GGGW (trimmed W pages) and WWWA (W rings)
    local o="${OUT:-runs/h200}"
    have layers-long benchmarks/serve_hybrid.py && step serve-hybrid-long-b 560 "$PY" \
        benchmarks/serve_hybrid.py --patterns GGGW,WWWA --batch 1,32 --prompt 32768 \
        --new 512 --repeats 1 --out "$o/serve_hybrid_long_b"
}

part_window-attn() {  # issue 35: windowed flash attention (f+b) vs SDPA mask / SDPA causal
    local o="${OUT:-runs/h200}"
    have window-attn benchmarks/window_attention.py && step window-attention 240 "$PY" \
        benchmarks/window_attention.py --out "$o/window_attention"
}

part_hybrid-quality() {  # issue 35: full vs 3:1 GDN, Mamba-2, SWA hybrids vs all-linear curves
    local o="${OUT:-runs/h200}"       # (carry .carry/mq: Gutenberg shards, vocab 8192)
    need hybrid-quality .carry/mq/shards/train.bin || return 0
    step hybrid-quality 560 "$PY" benchmarks/hybrid_quality.py --data .carry/mq/shards \
        --family hybrids --minutes 8 --out "$o/hybrid_quality"
}

part_dsa-quality() {  # issue 35: the DSA warm start (top-k = T/8) against the dense continuation
    local o="${OUT:-runs/h200}"       # (carry .carry/mq)
    need dsa-quality .carry/mq/shards/train.bin || return 0
    step dsa-quality 560 "$PY" benchmarks/hybrid_quality.py --data .carry/mq/shards \
        --family dsa --minutes 8 --out "$o/dsa_quality"
}

part_mla() {      # issue 36: engine decode at batch 64 x 16k, GQA-4 vs MLA (one device call)
    local o="${OUT:-runs/h200}"
    # decode steps timed apart from prefill, each kind's decode kernels profiled. The three
    # engines' compile and graph capture (plus the three checks') ran past a 480 s limit on an
    # H100 on 2026-12-06 after GQA's profile, so MLA + CLA-2 runs in part mla-cla
    have mla benchmarks/mla_engine.py &&
        step mla-engine 560 "$PY" benchmarks/mla_engine.py --profile --kinds GQA-4,MLA \
            --out "$o/mla_engine"
}

part_mla-cla() {  # issue 36: MLA + CLA-2's engine row, the MLA kernel, the MLA GPU tests
    local o="${OUT:-runs/h200}"
    have mla benchmarks/mla_engine.py &&
        step mla-cla-engine 300 "$PY" benchmarks/mla_engine.py --profile --kinds MLA+CLA-2 \
            --out "$o/mla_cla_engine"
    have mla benchmarks/mla.py && step mla-kernel 120 "$PY" benchmarks/mla.py --out "$o/mla"
    step mla-gpu-tests 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_mla.py \
        tests/test_kernels_mla_decode.py tests/test_engine_switches.py tests/test_moe_deepseek.py
}

part_mla-quality() {  # issue 36: MHA/GQA/MLA/MLA+CLA curves at equal parameters and tokens
    local o="${OUT:-runs/h200}"       # (carry .carry/mq: Gutenberg shards, vocab 8192)
    need mla-quality .carry/mq/shards/train.bin || return 0
    # run folders (checkpoints) stay in /tmp; the figure and the numbers come back
    # mla_quarter: MLA with a latent a quarter of GQA-4's cache (the KV target) at this width
    step attention-quality 540 "$PY" benchmarks/attention_quality.py --data .carry/mq/shards \
        --variants mha,gqa4,mla,mla_cla,mla_quarter --out /tmp/aq
    mkdir -p "$o" && cp /tmp/aq/attention_quality.png /tmp/aq/attention_quality.json "$o/" 2>/dev/null
}

part_mtp() {      # issue 36: 1 MTP module vs none (main-head loss), MTP self-speculative decode
    local o="${OUT:-runs/h200}"       # (carry .carry/mq)
    need mtp .carry/mq/shards/train.bin || return 0
    step mtp 540 "$PY" benchmarks/mtp.py --data .carry/mq/shards --out /tmp/mtp
    mkdir -p "$o" && cp /tmp/mtp/mtp_training.png /tmp/mtp/mtp.json "$o/" 2>/dev/null
}

part_quant() {    # issue 37: every format's engine decode speed and the peers in one run
    local o="${OUT:-runs/h200}"
    # each engine's compile warm-up of the 22-layer model takes 2-3 minutes: quant.py builds the
    # formats' engines side by side (one process each), then times them one at a time
    # (--tune: the int4/int8 GEMV launches are swept first, ~1.5 min, and the engines built
    # with the winners; the sweep's TABLE lines go into lmforge/quant/_gemv_triton.py after)
    have quant benchmarks/quant.py && step quant-speed 580 "$PY" benchmarks/quant.py \
        --part speed --tune --profile --out "$o/quant_speed"
}
part_quant-more() {  # issue 37: the int4/int8/fp8 GEMV launch sweep; the quantized KV cache
    local o="${OUT:-runs/h200}"
    have quant benchmarks/quant.py && step quant-gemv 300 "$PY" benchmarks/quant.py \
        --part gemv --out "$o/quant_gemv"
    have quant benchmarks/kv_quant.py &&
        step kv-quant 120 "$PY" benchmarks/kv_quant.py --out "$o/kv_quant"
}
part_vision() {   # issue 38: serving TTFT with one image through `lmforge serve` (carry .whl:
    local o="${OUT:-runs/h200}"   # fastapi/uvicorn); a request past 120 s prints the server's
    # process states and stacks, and the step ends
    have vision benchmarks/vlm_serve.py &&
        step vlm-serve 400 "$PY" benchmarks/vlm_serve.py --request-timeout 120 --out "$o/vlm_serve"
}
part_vision-train() {   # issue 38: the VLM training step and CLIP vs SigLIP at 64 and 1024
    local o="${OUT:-runs/h200}"
    have vision benchmarks/vision.py && step vision 360 "$PY" benchmarks/vision.py --out "$o/vision"
}

# The GPU tier of the recipe in two device calls (configs/recipes/h200.toml's header). Each recipe
# command is one step (its own time limit); the logs of a part go to one $OUT/recipe-*.log, so
# what comes back stays within 8 files (the pack's parts are at most 16 MB).
RECIPE=configs/recipes/h200.toml
RUN_DIR=runs/h200
read -r -a RECIPE_OVR <<< "${RECIPE_OVERRIDES:-}"

# rstep LOG NAME SECONDS ARGS...: `python -m lmforge ARGS` (with RECIPE_OVERRIDES when ARGS name
# the recipe file) under a time limit, its output appended to $OUT/LOG.log when OUT is set.
rstep() {
    local log="$1" name="$2" limit="$3" rc a
    local -a ovr=()
    shift 3
    for a in "$@"; do [ "$a" = "$RECIPE" ] && ovr=("${RECIPE_OVR[@]}"); done
    set -- "$@" "${ovr[@]}"
    echo "== $name: lmforge $*"
    if [ -n "${OUT:-}" ]; then
        echo "== $name: lmforge $*" >> "$OUT/$log.log"
        timeout "$limit" "$PY" -m lmforge "$@" 2>&1 | tee -a "$OUT/$log.log"
        rc=${PIPESTATUS[0]}
    else
        timeout "$limit" "$PY" -m lmforge "$@"
        rc=$?
    fi
    [ "$rc" -eq 0 ] || { echo "== $name: exit status $rc"; FAILED+=("$name"); return 1; }
}

# need PART FILE...: true when every file exists, else one line naming the missing one.
need() {
    local part="$1" f
    shift
    for f in "$@"; do [ -e "$f" ] || { echo "== $part: $f is missing"; FAILED+=("$part"); return 1; }; done
}

part_recipe-prep() {
    local src="${SHARED_DATA:-../shared/data}" e=.carry/recipe-eval
    need recipe-prep "$src/eval/gsm8k/train.jsonl" "$src/eval/mmlu" "$src/eval/arc_challenge" \
        "$src/text/wikitext2/test.txt" || return 0
    # the benchmark files at the paths h200.toml names, here and (from the tarball) there
    rm -rf "$e" && mkdir -p "$e/eval/gsm8k" "$e/text/wikitext2" || return 0
    cp "$src/eval/gsm8k/train.jsonl" "$src/eval/gsm8k/test.jsonl" "$e/eval/gsm8k/"
    cp -r "$src/eval/mmlu" "$src/eval/arc_challenge" "$e/eval/"
    cp "$src/text/wikitext2/test.txt" "$e/text/wikitext2/"
    chmod -R u+w "$e"
    tar -czf .carry/recipe-eval.tar.gz -C "$e" eval text
    rstep recipe-prep recipe-data 900 recipe run "$RECIPE" --until tokenizer || return 0
    rstep recipe-prep recipe-pack-a 300 recipe pack "$RECIPE" --next pretrain --out .carry/recipe-a
}

# recipe_unpack PART PACK: the benchmark files and the pack PACK into runs/h200.
recipe_unpack() {
    need "$1" .carry/recipe-eval.tar.gz "$2/recipe-pack.json" || return 1
    rm -rf .carry/recipe-eval && mkdir -p .carry/recipe-eval &&
        tar -xzf .carry/recipe-eval.tar.gz -C .carry/recipe-eval || { FAILED+=("$1"); return 1; }
    rstep "$1" "$1-unpack" 60 recipe unpack "$2" --into "$RUN_DIR"
}

part_recipe-a() {
    recipe_unpack recipe-a .carry/recipe-a || return 0
    rstep recipe-a recipe-pretrain-sft 420 recipe run "$RECIPE" --until sft || return 0
    rstep recipe-a recipe-eval-pretrain 120 recipe eval "$RECIPE" --row pretrain
    # the SFT model (bf16 weights) and every marker, for call B; 15 MB parts come back in $OUT
    rstep recipe-a recipe-pack-b 60 recipe pack "$RECIPE" --next rl --out "${OUT:-runs}/recipe-b"
}

part_recipe-b() {
    recipe_unpack recipe-b .carry/recipe-b || return 0
    # the anchor's GGUF is not here: its row is scored on the CPU machine (part recipe-card)
    rstep recipe-b recipe-rl-eval-card 480 recipe run "$RECIPE" "--eval.anchors=[]"
    rstep recipe-b recipe-pack-card 60 recipe pack "$RECIPE" --next report \
        --out "${OUT:-runs}/recipe-card"
}

# recipe-gpu: calls A and B as ONE device call (carry .carry/recipe-a, .carry/recipe-eval.tar.gz):
# pretraining, SFT, GRPO, eval rows and the card without the anchor; the card's pack comes back in
# $OUT/recipe-card (or, if a stage ran out of time, the pack for RL in $OUT/recipe-b)
part_recipe-gpu() {
    recipe_unpack recipe-gpu .carry/recipe-a || return 0
    rstep recipe-gpu recipe-all 530 recipe run "$RECIPE" "--eval.anchors=[]"
    rstep recipe-gpu recipe-pack-card 60 recipe pack "$RECIPE" --next report \
        --out "${OUT:-runs}/recipe-card" ||
        rstep recipe-gpu recipe-pack-b 60 recipe pack "$RECIPE" --next rl --out "${OUT:-runs}/recipe-b"
}

part_recipe-anchor() {
    need recipe-anchor .carry/recipe-eval ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf ||
        return 0
    rstep recipe-anchor recipe-anchor 14400 recipe eval "$RECIPE" --row SmolLM2-135M-Instruct \
        --recipe.device=cpu
}

part_recipe-card() {
    need recipe-card .carry/recipe-card/recipe-pack.json .carry/recipe-eval || return 0
    rstep recipe-card recipe-unpack-card 60 recipe unpack .carry/recipe-card --into "$RUN_DIR" ||
        return 0
    # scored already by part recipe-anchor (then this reads its cached row), else now
    rstep recipe-card recipe-anchor 14400 recipe eval "$RECIPE" --row SmolLM2-135M-Instruct \
        --recipe.device=cpu || return 0
    rstep recipe-card recipe-report 600 recipe run "$RECIPE"
}

[ $# -ge 1 ] || { usage; exit 2; }
# gpu-tests PART [PART ...]: parts of the GPU tier only (each its own step), then exit.
if [ "$1" = gpu-tests ]; then
    shift
    [ $# -ge 1 ] || { echo "gpu-tests needs a part: ${GPU_TEST_PARTS[*]} (or PART:I/N)" >&2; exit 2; }
    [ -n "${OUT:-}" ] && mkdir -p "$OUT"
    for p in "$@"; do gpu_tests "$p"; done
    [ ${#FAILED[@]} -eq 0 ] || { echo "== failed: ${FAILED[*]}"; exit 1; }
    exit 0
fi
for arg in "$@"; do
    case "$arg" in
        -h | --help) usage; exit 0 ;;
        all) ;;
        *) [[ " ${PARTS[*]} ${EXTRA_PARTS[*]} " == *" $arg "* ]] || { echo "unknown part '$arg'; parts: ${PARTS[*]} ${EXTRA_PARTS[*]} all" >&2; exit 2; } ;;
    esac
done
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
# Liger-Kernel (a peer of the kernel tables) from wheels carried in .whl/, when there are any.
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/lmforge-site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/lmforge-site"
fi
[[ " $* " == *" recipe-prep "* || " $* " == *" recipe-card "* || " $* " == *" recipe-anchor "* ]] ||
step env 60 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', \
'gpus', torch.cuda.device_count())"
for arg in "$@"; do
    if [ "$arg" = all ]; then
        for p in "${PARTS[@]}"; do "part_$p"; done
    else
        "part_$arg"
    fi
done
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "== failed: ${FAILED[*]}"
    exit 1
fi
