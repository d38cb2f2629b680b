#!/usr/bin/env bash
# Every GPU check and benchmark of lmforge, in the parts one lease can hold (≤ 10 min each).
# Run from the repository root on a CUDA machine:  bash benchmarks/h200_session.sh PART
#   PART = kernels  : GPU tests (-m gpu) + benchmarks/kernels.py
#          train    : benchmarks/train.py (throughput vs a nanoGPT-style peer)
#          parallel : benchmarks/parallel.py on 1 and 2 GPUs (torchrun)
#          round2   : GPU tests of train/RMSNorm/CE, train.py (sdpa and flash+triton+fused), RMSNorm/CE kernels
#          realdata : a timed GPT-2-small run on token shards in .carry/gutenberg + bench model
#          round3   : GPU tests of trainer/kernels/custom ops, train.py (sdpa: reference and fused
#                     loss, vs peer; fused-projections A/B)
#          round3b  : GPU tests; RMSNorm/CE kernel tables; train.py {reference,triton} norm ×
#                     {reference,fused} loss vs peer; flash+triton+fused
#          sweeps   : benchmarks/rmsnorm_sweep.py and benchmarks/ce_sweep.py
#          round4   : GPU tests of the CUDA-graph and sync-free steps; train.py reference loss with
#                     train.cuda_graph off/on vs peer; fused-CE kernel table
#          round6   : rope_bench.py; train.py reference loss with a kernel profile vs peer; the
#                     previous RoPE formulation (A/B)
#          round7   : train.py reference loss vs peer, in both orders
#          round11  : GPU tests of CE/RoPE kernels and model backends (rope='triton'); rope_bench.py;
#                     ce_sweep.py (fused CE variants, Liger, torch, kernel profiles); kernels.py ce
#          round15  : GPU tests (Triton AdamW, CUDA graph, model backends); train.py fused loss,
#                     RoPE auto, train.adamw compiled vs triton, peer measured first
#          round16  : adamw_bench.py; train.py residual autocast, train.adamw compiled vs triton, profile
#          round20  : GPU tests (Triton AdamW launches, trainer); adamw_bench.py launch sweep;
#                     train.py separate vs fused projections with profile (idle gaps, GEMM shapes)
#          round21  : GPU tests (CUDA graph × compiled/Triton AdamW, AdamW launches); train.py with
#                     the Triton AdamW, CUDA graph off/on, profile, peer measured first
#          round22  : train.py CUDA graph on, Inductor combo kernels off/on × BLAS default/cublaslt,
#                     profile (no peer)
#          round23  : GPU tests (packed SwiGLU gate, compiled model backends); train.py
#                     model.swiglu reference vs auto, profile, peer measured first
#          round24  : train.py swiglu auto, loss chunk 8192/16384/32768 vs peer (measured first);
#                     then CUDA graph on (chunk 8192)
#          round41  : GPU tests of the tuned GEMM; gemm_algos.py --wide, then a full grid (634
#                     tiles × 8 custom options × 7 clusters: too many; timed out after 11 GEMMs)
#          round42  : GPU tests of the tuned GEMM; gemm_algos.py --wide on the LM head; train.py
#                     as configs/gpt2-small-train.toml runs it, tuned GEMMs from the heuristic
#                     list vs the wide search (two stages), peer first
#          round43  : GPU tests of the wide search; train.py as configs/gpt2-small-train.toml
#                     runs it with the wide search (tile × custom option, then clusters), peer first
#          round44  : every tuned-GEMM GPU test; train.py heuristic vs wide search, peer first
#          round40  : (historical) the loss's logits GEMM + chunk kernel in 256/384-row
#                     sub-chunks vs whole chunks, peer first; the switch is gone
#          round39  : every GPU test (-m gpu)
#          round38  : GPU tests of the tuned GEMM; train.py as configs/gpt2-small-train.toml
#                     runs it (CUDA graph, tuned GEMMs), loss chunks 8192 and 16384, peer first
#          round37  : GPU tests (CUDA-graph trainer steps, model backends); rope_packed_bench.py;
#                     train.py shipped settings with the CUDA graph on, train.matmul torch vs
#                     tuned, profile, peer measured first
#          round36  : GPU tests of the tuned GEMM (tests/test_matmul.py); train.py (shipped
#                     settings) train.matmul torch vs tuned, peer measured first; then tuned with
#                     the CUDA graph on
#          round35  : rope_packed_bench.py (per-row vs
#                     token×head launches); gemm_algos.py (cuBLASLt candidates vs torch.mm)
#          round34  : GPU tests of the model's auto backends and a compiled bf16 training run
#          round33  : GPU tests of the CUDA-graph and master-weight trainer runs; gemm_rope.py
#                     with the TMA-descriptor GEMMs
#          round32  : gemm_rope.py (the q‖k GEMM with RoPE in a Triton epilogue vs cuBLAS + the
#                     packed RoPE kernel)
#          round31  : GPU tests of the CE kernels (persistent row launch); ce_sweep.py chunk kernel
#                     alone at 8192×50304 and 512×128256; train.py CE kernel one program a row vs
#                     2 and 3 persistent programs per SM, peer measured first
#          round30  : (the whole-row CE kernel, removed since: see RESULTS.md)
#          round29  : every GPU test (-m gpu); then train.py as configs/gpt2-small-train.toml runs
#                     it (rope packed, master weights on) with a profile, peer measured first
#          round28  : train.py (rope packed, master weights on) with Inductor's coordinate-descent
#                     tuning and aggressive fusion, peer first; then cuBLAS without bf16 split-K
#                     reductions (no peer)
#          round27  : GPU tests (packed RoPE kernel, model backends, trainer); train.py rope
#                     triton vs packed (master weights on), peer measured first
#          round26  : GPU tests (master weights in the trainer and the Triton AdamW); train.py
#                     swiglu auto with train.master_weights off/on, peer measured first
#          round25  : train.py swiglu auto with Inductor's PDL launches and mix-order-reduction
#                     split 64 (each, both), peer measured first
#          round19  : GPU tests (Triton AdamW); train.py residual autocast, train.adamw compiled
#                     vs triton (address tables from a pinned ring), peer first; adamw_bench.py
#          round17  : real-data GPT-2-small runs (1500 steps each), residual param vs autocast
#          round18  : GPU tests (Triton AdamW); adamw_bench.py; train.py residual autocast,
#                     train.adamw compiled vs triton, CUDA graph off/on, peer measured first
#          round14  : GPU tests of the CE kernels; ce_sweep.py --launches at 16384×2048→128256;
#                     kernels.py ce (the final chunk kernel against Liger)
#          round13  : GPU tests (CE/RoPE kernels, model backends); train.py fused loss (8192-row
#                     chunks), RoPE reference vs auto, peer measured first
#          round12  : rope_bench.py (incl. the Triton kernel's launches); train.py fused loss
#                     (8192-row chunks), RoPE reference vs triton (fastest launch), profile, peer
#          round10  : GPU tests of the CE chunk kernel (every launch); ce_sweep.py
#                     --launches (each schedule alone, inside the op, the whole op; Liger)
#          round9   : GPU tests of the CE kernels; ce_sweep.py (chunk-kernel launch configs incl.
#                     persistent programs, fused CE variants, Liger, torch)
#          round8   : GPU tests of RoPE/CE kernels and of attention='cudnn'; rope_bench.py (row-wise
#                     Triton RoPE); CE kernel table (dW written by the first chunk); train.py with
#                     SDPA default vs cuDNN-first, lmforge and peer
#          round5   : train.py reference loss, compile mode default / max-autotune-no-cudagraphs,
#                     for lmforge and the peer
# Logs and result tables go to $OUT (default: runs/h200); RESULTS-*.md there are appended to
# benchmarks/RESULTS.md by hand after review.
set -u
OUT="${OUT:-runs/h200}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0), 'gpus', torch.cuda.device_count())" | tee "$OUT/env.txt"
case "${1:-kernels}" in
    kernels)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
        timeout 330 python3 benchmarks/kernels.py --results "$OUT/RESULTS-kernels.md" 2>&1 | tee "$OUT/kernels.log"
        ;;
    train)
        timeout 300 python3 benchmarks/train.py --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log"
        timeout 270 python3 benchmarks/train.py --real-data .carry/gutenberg --minutes 3.3 --real-steps 2500 \
            --attention sdpa --norm reference --loss reference --out "$OUT/gutenberg" \
            --results "$OUT/RESULTS-realdata.md" 2>&1 | tee "$OUT/realdata.log" | grep -v "it/s\]$" | tail -40
        cp "$OUT"/gutenberg/loss_curve.png "$OUT/" 2>/dev/null
        cp "$OUT"/gutenberg/metrics.jsonl "$OUT/realdata-metrics.jsonl" 2>/dev/null
        rm -rf "$OUT/gutenberg"
        ;;
    parallel)
        timeout 170 torchrun --nproc_per_node 1 benchmarks/parallel.py --results "$OUT/RESULTS-parallel1.md" 2>&1 | tee "$OUT/parallel1.log"
        timeout 300 torchrun --nproc_per_node 2 benchmarks/parallel.py --results "$OUT/RESULTS-parallel2.md" 2>&1 | tee "$OUT/parallel2.log"
        ;;
    round2)
        timeout 140 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            tests/test_kernels_gpu.py -k "rms or entropy or train" 2>&1 | tee "$OUT/gpu-tests2.log" | tail -8
        timeout 260 python3 benchmarks/train.py --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | tail -12
        timeout 100 python3 benchmarks/train.py --attention flash --norm triton --loss fused --no-peer \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train-fused.log" | tail -8
        timeout 90 python3 benchmarks/kernels.py --only rmsnorm,ce --results "$OUT/RESULTS-kernels.md" 2>&1 | tee "$OUT/kernels.log" | tail -30
        ;;
    round3)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            tests/test_kernels_gpu.py tests/test_kernels_compile.py -k "rms or entropy or train or compile or sync" \
            2>&1 | tee "$OUT/gpu-tests3.log" | tail -6
        timeout 240 python3 benchmarks/train.py --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | tail -9
        timeout 100 python3 benchmarks/train.py --loss reference --fused-projections --no-peer \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train-fusedproj.log" | tail -5
        ;;
    round3b)
        timeout 90 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            tests/test_kernels_gpu.py -k "rms or sync or trains" 2>&1 | tee "$OUT/gpu-tests3b.log" | tail -4
        timeout 90 python3 benchmarks/kernels.py --only rmsnorm,ce --results "$OUT/RESULTS-kernels.md" 2>&1 | tee "$OUT/kernels.log" | tail -16
        timeout 300 python3 benchmarks/train.py --norm reference,triton --loss reference,fused \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | tail -9
        timeout 95 python3 benchmarks/train.py --attention flash --norm triton --loss fused --no-peer \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train-fused.log" | tail -4
        ;;
    sweeps)
        timeout 210 python3 benchmarks/rmsnorm_sweep.py --jobs 15 --results "$OUT/RESULTS-rmsnorm.md" > "$OUT/rmsnorm_sweep.log" 2>&1
        timeout 150 python3 benchmarks/ce_sweep.py --results "$OUT/RESULTS-ce.md" > "$OUT/ce.log" 2>&1
        tail -30 "$OUT/rmsnorm_sweep.log"; tail -40 "$OUT/ce.log"
        ;;
    realdata)
        timeout 400 python3 benchmarks/train.py --real-data .carry/gutenberg --minutes 5 --out "$OUT/gutenberg" --results "$OUT/RESULTS-realdata.md" 2>&1 | tee "$OUT/realdata.log"
        cp "$OUT"/gutenberg/loss_curve.png "$OUT/" 2>/dev/null
        timeout 150 python3 -m lmforge bench model --preset gpt2-small 2>&1 | tee "$OUT/bench-model.log"
        ;;
    round4)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            -k "graph or sync" 2>&1 | tee "$OUT/gpu-tests4.log" | tail -6
        timeout 300 python3 benchmarks/train.py --loss reference --graph off,on \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | tail -9
        timeout 100 python3 benchmarks/kernels.py --only ce --results "$OUT/RESULTS-kernels.md" \
            2>&1 | tee "$OUT/kernels.log" | tail -12
        ;;
    round5)
        timeout 580 python3 benchmarks/train.py --loss reference \
            --compile-mode default,max-autotune-no-cudagraphs \
            --peer-compile-mode default,max-autotune-no-cudagraphs \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -14
        ;;
    round6)
        timeout 100 python3 benchmarks/rope_bench.py --results "$OUT/RESULTS-rope.md" 2>&1 | tee "$OUT/rope.log" | tail -9
        timeout 260 python3 benchmarks/train.py --loss reference --profile 30 \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -5
        timeout 140 python3 benchmarks/train.py --loss reference --no-peer --previous-rope \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train-prev.log" | grep -v Warning | tail -4
        ;;
    round7)
        timeout 200 python3 benchmarks/train.py --loss reference \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -5
        timeout 200 python3 benchmarks/train.py --loss reference --peer-first \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train2.log" | grep -v Warning | tail -5
        ;;
    round11)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            tests/test_model.py -k "entropy or rope or kernel_backends or compile_with" 2>&1 \
            | tee "$OUT/gpu-tests11.log" | tail -4
        timeout 100 python3 benchmarks/rope_bench.py --results "$OUT/RESULTS-rope.md" 2>&1 \
            | tee "$OUT/rope.log" | tail -10
        timeout 200 python3 benchmarks/ce_sweep.py --kernel-shapes "" --iters 10 \
            --results "$OUT/RESULTS-ce.md" 2>&1 | tee "$OUT/ce.log" | grep "^|" | tail -20
        timeout 100 python3 benchmarks/kernels.py --only ce --results "$OUT/RESULTS-kernels.md" \
            2>&1 | tee "$OUT/kernels.log" | tail -8
        ;;
    round15)
        timeout 170 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            tests/test_model.py -k "adamw or graph or kernel_backends or compile_with" 2>&1 \
            | tee "$OUT/gpu-tests15.log" | tail -4
        timeout 400 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --adamw compiled,triton --peer-first --results "$OUT/RESULTS-train.md" \
            2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -12
        ;;
    round16)
        timeout 120 python3 benchmarks/adamw_bench.py --results "$OUT/RESULTS-adamw.md" 2>&1 \
            | tee "$OUT/adamw.log" | tail -12
        timeout 420 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --adamw compiled,triton --residual autocast --profile 45 --no-peer \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning \
            | tail -150
        ;;
    round18)
        timeout 120 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            -k "adamw" 2>&1 | tee "$OUT/gpu-tests18.log" | tail -4
        timeout 100 python3 benchmarks/adamw_bench.py --results "$OUT/RESULTS-adamw.md" 2>&1 \
            | tee "$OUT/adamw.log" | tail -12
        timeout 360 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --adamw compiled,triton --residual autocast --graph off,on --peer-first \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning \
            | tail -14
        ;;
    round20)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            -k "adamw" 2>&1 | tee "$OUT/gpu-tests20.log" | tail -4
        timeout 120 python3 benchmarks/adamw_bench.py --kinds "lmforge triton,torch fused" \
            --launches 4096x8x1,2048x8x1,2048x8x4,2048x8x8,1024x4x1,1024x4x8 \
            --results "$OUT/RESULTS-adamw.md" 2>&1 | tee "$OUT/adamw.log" | tail -14
        timeout 300 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --projections separate,fused --no-peer --steps 15 --warmup 4 \
            --profile 45 --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" \
            | grep -v Warning | tail -5
        ;;
    round21)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            -k "cuda_graph or adamw_kernel" 2>&1 | tee "$OUT/gpu-tests21.log" | tail -4
        timeout 370 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --graph off,on --peer-first --steps 15 --warmup 4 --profile 30 \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning \
            | tail -7
        ;;
    round22)
        timeout 560 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --graph on --combo off,on --blas default,cublaslt --no-peer \
            --steps 15 --warmup 4 --profile 12 --results "$OUT/RESULTS-train.md" 2>&1 \
            | tee "$OUT/train.log" | grep -v Warning | tail -8
        ;;
    round23)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            tests/test_model.py -k "swiglu or kernel_backends" 2>&1 | tee "$OUT/gpu-tests23.log" \
            | tail -4
        timeout 400 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu reference,auto --peer-first --steps 15 --warmup 4 \
            --profile 30 --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" \
            | grep -v Warning | tail -7
        ;;
    round24)
        timeout 380 python3 benchmarks/train.py --loss fused --loss-chunk 8192,16384,32768 \
            --rope auto --residual autocast --swiglu auto --peer-first --steps 20 --warmup 4 \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning \
            | tail -8
        timeout 150 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --graph on --no-peer --steps 20 --warmup 4 \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train-graph.log" \
            | grep -v Warning | tail -4
        ;;
    round41)
        timeout 100 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_matmul.py \
            2>&1 | tee "$OUT/gpu-tests41.log" | tail -3
        timeout 420 python3 benchmarks/gemm_algos.py --wide --iters 20 \
            --results "$OUT/RESULTS-algos.md" > "$OUT/algos.log" 2>&1
        grep -v Warning "$OUT/algos.log" | grep "searched\|^Per step" | tail -24
        ;;
    round42)
        timeout 100 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_matmul.py \
            2>&1 | tee "$OUT/gpu-tests42.log" | tail -3
        timeout 100 python3 benchmarks/gemm_algos.py --wide --only "LM head" --iters 20 \
            --results "$OUT/RESULTS-algos.md" > "$OUT/algos.log" 2>&1
        grep -v Warning "$OUT/algos.log" | grep "^| LM\|^Per step" | cut -c1-200
        timeout 330 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --graph on --matmul auto:heuristic,auto:wide \
            --peer-first --steps 20 --warmup 4 --results "$OUT/RESULTS-train.md" \
            > "$OUT/train.log" 2>&1
        grep -v Warning "$OUT/train.log" | grep -v "^  [0-9]" | tail -8
        ;;
    round44)
        timeout 110 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_matmul.py \
            2>&1 | tee "$OUT/gpu-tests44.log" | tail -3
        timeout 330 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --graph on --matmul auto:heuristic,auto:wide \
            --peer-first --steps 20 --warmup 4 --results "$OUT/RESULTS-train.md" \
            > "$OUT/train.log" 2>&1
        grep -v Warning "$OUT/train.log" | grep -v "^  [0-9]" | tail -7
        ;;
    round43)
        timeout 100 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_matmul.py \
            -k "wide or float64" 2>&1 | tee "$OUT/gpu-tests43.log" | tail -3
        timeout 420 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --graph on --matmul auto:wide \
            --peer-first --steps 20 --warmup 4 --results "$OUT/RESULTS-train.md" \
            > "$OUT/train.log" 2>&1
        grep -v Warning "$OUT/train.log" | grep -v "^  [0-9]" | tail -6
        ;;
    round40)
        # measured (sub-chunks 256/384 rows: 55.1/55.4 vs 54.2 ms whole chunks); the switch
        # (cross_entropy.SUBCHUNK_ROWS, train.py --ce-subchunk) was removed afterwards
        echo "round40 measured cross_entropy.SUBCHUNK_ROWS, since removed" >&2
        exit 2
        ;;
    round39)
        timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
            | tee "$OUT/gpu-tests39.log" | tail -12
        ;;
    round38)
        timeout 120 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_matmul.py \
            2>&1 | tee "$OUT/gpu-tests38.log" | tail -3
        timeout 300 python3 benchmarks/train.py --loss fused --loss-chunk 8192,16384 --rope auto \
            --residual autocast --swiglu auto --graph on --matmul auto --peer-first \
            --steps 20 --warmup 4 --results "$OUT/RESULTS-train.md" > "$OUT/train.log" 2>&1
        grep -v Warning "$OUT/train.log" | grep -v "^  [0-9]" | tail -9
        ;;
    round37)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            tests/test_model.py -k "cuda_graph or backends" 2>&1 | tee "$OUT/gpu-tests37.log" \
            | tail -3
        timeout 60 python3 benchmarks/rope_packed_bench.py --results "$OUT/RESULTS-rope.md" \
            > "$OUT/rope.log" 2>&1; tail -9 "$OUT/rope.log"
        timeout 330 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --graph on --matmul torch,tuned --peer-first \
            --steps 15 --warmup 4 --profile 25 --results "$OUT/RESULTS-train.md" \
            > "$OUT/train.log" 2>&1
        grep -v Warning "$OUT/train.log" | grep -v "^  [0-9]" | tail -12
        ;;
    round36)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_matmul.py \
            2>&1 | tee "$OUT/gpu-tests36.log" | tail -3
        timeout 270 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --matmul torch,tuned --peer-first --steps 15 \
            --warmup 4 --results "$OUT/RESULTS-train.md" > "$OUT/train.log" 2>&1
        grep -v Warning "$OUT/train.log" | tail -30
        timeout 120 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --matmul tuned --graph on --no-peer --steps 15 \
            --warmup 4 --results "$OUT/RESULTS-train.md" > "$OUT/train-graph.log" 2>&1
        grep -v Warning "$OUT/train-graph.log" | tail -8
        ;;
    round35)
        timeout 90 python3 benchmarks/rope_packed_bench.py --results "$OUT/RESULTS-rope.md" \
            > "$OUT/rope.log" 2>&1; tail -14 "$OUT/rope.log"
        timeout 300 python3 benchmarks/gemm_algos.py --results "$OUT/RESULTS-algos.md" \
            > "$OUT/algos.log" 2>&1; tail -30 "$OUT/algos.log"
        ;;
    round34)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_model.py \
            tests/test_train_gpu.py -k "backends or trains_on" 2>&1 | tee "$OUT/gpu-tests34.log" \
            | tail -3
        ;;
    round33)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            -k "cuda_graph or master" 2>&1 | tee "$OUT/gpu-tests33.log" | tail -3
        timeout 150 python3 benchmarks/gemm_rope.py --results "$OUT/RESULTS-gemm.md" \
            > "$OUT/gemm.log" 2>&1; tail -30 "$OUT/gemm.log"
        ;;
    round32)
        timeout 240 python3 benchmarks/gemm_rope.py --results "$OUT/RESULTS-gemm.md" \
            > "$OUT/gemm.log" 2>&1; tail -22 "$OUT/gemm.log"
        ;;
    round31)
        timeout 120 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            -k "entropy or chunk" 2>&1 | tee "$OUT/gpu-tests31.log" | tail -3
        timeout 100 python3 benchmarks/ce_sweep.py --shapes "" \
            --kernel-shapes 8192x50304,512x128256 --results "$OUT/RESULTS-ce.md" \
            > "$OUT/ce.log" 2>&1; grep -A12 "Chunk step alone" "$OUT/ce.log" | head -30
        timeout 330 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --ce-programs 0,2,3 --peer-first --steps 15 \
            --warmup 4 --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" \
            | grep -v Warning | tail -8
        ;;
    round29)
        timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
            | tee "$OUT/gpu-tests29.log" | tail -6
        ;;
    round29b)
        timeout 560 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --peer-first --steps 20 --warmup 4 --profile 30 \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning \
            | tail -9
        ;;
    round28)
        timeout 400 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope packed \
            --residual autocast --swiglu auto --peer-first --steps 15 --warmup 4 \
            --inductor "default;coordinate_descent_tuning=1;aggressive_fusion=1" \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -9
        timeout 150 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope packed \
            --residual autocast --swiglu auto --no-peer --steps 15 --warmup 4 --bf16-reduction off \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train2.log" | grep -v Warning | tail -4
        ;;
    round27)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            tests/test_model.py tests/test_train_gpu.py -k "rope or backends or master or trains_on" \
            2>&1 | tee "$OUT/gpu-tests27.log" | tail -4
        timeout 390 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope triton,packed \
            --residual autocast --swiglu auto --peer-first --steps 20 --warmup 4 \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -8
        ;;
    round26)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            -k "master or adamw or trains_on" 2>&1 | tee "$OUT/gpu-tests26.log" | tail -4
        timeout 390 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --master-weights off,on --peer-first --steps 20 \
            --warmup 4 --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" \
            | grep -v Warning | tail -8
        ;;
    round25)
        timeout 480 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --residual autocast --swiglu auto --peer-first --steps 20 --warmup 4 \
            --inductor "default;triton.enable_pdl=1;triton.mix_order_reduction_split_size=64;triton.enable_pdl=1+triton.mix_order_reduction_split_size=64" \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning \
            | tail -9
        ;;
    round19)
        timeout 120 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_train_gpu.py \
            -k "adamw" 2>&1 | tee "$OUT/gpu-tests19.log" | tail -4
        timeout 250 python3 benchmarks/train.py --loss fused --loss-chunk 8192 --rope auto \
            --adamw compiled,triton --residual autocast --peer-first \
            --results "$OUT/RESULTS-train.md" 2>&1 | tee "$OUT/train.log" | grep -v Warning \
            | tail -12
        timeout 100 python3 benchmarks/adamw_bench.py --kinds "lmforge triton,torch fused" \
            --results "$OUT/RESULTS-adamw.md" 2>&1 | tee "$OUT/adamw.log" | tail -12
        ;;
    round17)
        for r in param autocast; do
            timeout 280 python3 benchmarks/train.py --real-data .carry/gutenberg --minutes 20 \
                --real-steps 1500 --loss auto --residual $r --out "$OUT/gutenberg-$r" \
                --results "$OUT/RESULTS-realdata.md" 2>&1 | tee "$OUT/realdata-$r.log" \
                | grep -v "step/s" | tail -8
            cp "$OUT/gutenberg-$r/metrics.jsonl" "$OUT/realdata-$r-metrics.jsonl" 2>/dev/null
            cp "$OUT/gutenberg-$r/loss_curve.png" "$OUT/loss_curve-$r.png" 2>/dev/null
            rm -rf "$OUT/gutenberg-$r"
        done
        ;;
    round14)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            -k "entropy" 2>&1 | tee "$OUT/gpu-tests14.log" | tail -4
        timeout 200 python3 benchmarks/ce_sweep.py --launches --shapes 16384x2048x128256 \
            --iters 10 --results "$OUT/RESULTS-ce.md" 2>&1 | tee "$OUT/ce.log" | grep "^|"
        timeout 100 python3 benchmarks/kernels.py --only ce --results "$OUT/RESULTS-kernels.md" \
            2>&1 | tee "$OUT/kernels.log" | tail -5
        ;;
    round13)
        timeout 200 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            tests/test_model.py -k "entropy or rope or kernel_backends or compile_with" 2>&1 \
            | tee "$OUT/gpu-tests13.log" | tail -4
        timeout 380 python3 benchmarks/train.py --loss fused --loss-chunk 8192 \
            --rope reference,auto --peer-first --results "$OUT/RESULTS-train.md" \
            2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -12
        ;;
    round12)
        timeout 100 python3 benchmarks/rope_bench.py --results "$OUT/RESULTS-rope.md" \
            --best-out "$OUT/rope_best.txt" 2>&1 | tee "$OUT/rope.log" | tail -14
        timeout 480 python3 benchmarks/train.py --loss fused --loss-chunk 8192 \
            --rope reference,triton --rope-kernel-config "$(cat "$OUT/rope_best.txt")" \
            --profile 30 --results "$OUT/RESULTS-train.md" \
            2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -80
        ;;
    round10)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            -k "entropy" 2>&1 | tee "$OUT/gpu-tests10.log" | tail -4
        timeout 420 python3 benchmarks/ce_sweep.py --launches --iters 10 \
            --results "$OUT/RESULTS-ce.md" 2>&1 | tee "$OUT/ce.log" | grep -v "^launch" | tail -60
        ;;
    round9)
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            -k "entropy" 2>&1 | tee "$OUT/gpu-tests9.log" | tail -4
        timeout 150 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_model.py \
            -k "cudnn_backend_runs" 2>&1 | tee "$OUT/gpu-tests9b.log" | tail -4
        timeout 300 python3 benchmarks/ce_sweep.py --iters 10 --results "$OUT/RESULTS-ce.md" \
            2>&1 | tee "$OUT/ce.log" | grep -v "^kernel \|^16384x\|^check" | grep -v "^ \|^---" | tail -100
        ;;
    round8)
        timeout 120 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py \
            -k "rope or entropy" 2>&1 | tee "$OUT/gpu-tests8.log" | tail -4
        timeout 100 python3 benchmarks/rope_bench.py --results "$OUT/RESULTS-rope.md" 2>&1 | tee "$OUT/rope.log" | tail -9
        timeout 100 python3 benchmarks/kernels.py --only ce --results "$OUT/RESULTS-kernels.md" \
            2>&1 | tee "$OUT/kernels.log" | tail -8
        timeout 60 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_model.py \
            -k "cudnn or kernel_backends" 2>&1 | tee "$OUT/gpu-tests8b.log" | tail -4
        timeout 330 python3 benchmarks/train.py --loss reference --attention sdpa,cudnn \
            --peer-attention default,cudnn --results "$OUT/RESULTS-train.md" \
            2>&1 | tee "$OUT/train.log" | grep -v Warning | tail -8
        ;;
    *) echo "unknown part $1"; exit 2 ;;
esac
