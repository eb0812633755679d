#!/usr/bin/env bash
# The GPU leg, in one call on the device machine (H200: torch 2.11, triton 3.6, transformers 5.17,
# 16 AMX cores, no internet). Installs what it lacks from carried wheels (.whl: transformers 5.24
# for the reference, the project itself for its entry points), then runs the requested steps.
# Everything lands under $OUT (at most 8 files come back).
#   matrix       the `gpu` legs of ci/matrix.yaml through ci/run_matrix.py --gpu: cuda (unit,
#                conformance, encode with graphs on/off, dense/device), metax EMULATED on the GPU,
#                cpu_amx on the host's AMX cores. Writes matrix.txt (the table) and
#                matrix_junit.tar.gz (per-leg JUnit XML + logs). `conformance` is an alias.
#   bench profile attn            bench vision, its per-kernel profile, the attention bench
#   layers sweep tests (not in "all")  layer-op bench, attention config sweep, CUDA unit tests
# Set FDX_COMMIT=<sha> (the tree has no .git there) so info.txt records the commit that ran.
#   preprocess amx (not in "all")  `bench preprocess` (1 and 16 workers vs both transformers
#                processors); `bench vision --device cpu_amx` bf16 + fp32 and `bench gemm` on the
#                host CPU (AMX_PIN_CHECK=1 adds a run pinned with OMP_PLACES/OMP_PROC_BIND)
# The fa3 extra: carry the fa3-fwd wheel in .whl (pip download fa3-fwd==0.0.3 --no-deps -d .whl);
# the default plan on cuda_sm90 then picks fa3_varlen (info.txt says whether it imported).
#   generate (not in "all")  `bench generate --load-format dummy` bf16: page1 (TTFT, batch-1 decode),
#                pages64, lines256 vs transformers generate (its own random init: speed, not tokens)
#                (GENERATE_ARGS narrows it, e.g. "--workloads page1,pages64 --ref-batch 16")
#   harden (not in "all")  the hardening checks on the dummy 0.9B in bf16: ci/engine_fault_check.py
#                (the sampler's finite check on CUDA; the killer values while 16 streams run in the
#                engine) and ci/fuzz_server.py against a real server (FUZZ_REQUESTS, 2000, with
#                images at 16 in flight, then the killers while 16 streams run)
#   detect (not in "all")  `bench detect --load-format dummy` bf16 at full size (800x800, batch 1/8/32:
#                ours with its bucket graphs vs transformers, same weights and pixels) and
#                ci/detector_bf16_check.py (bf16 vs the fp32 reference with its top-k reused: cosine >= 0.999)
#   deepseek_moe (not in "all")  DeepSeek-OCR-2's MoE grouped GEMM and MHA paged decode: the CUDA tests of
#                tests/test_triton_moe.py + test_triton_moe_routing.py + test_triton_paged_attention.py, then `python3 -m
#                fastdeploy_ext.bench.moe` (bf16, 1/64/128/4096 tokens: ours vs aten_moe vs transformers)
#   deepseek (not in "all")  the conformance suite on DeepSeek-OCR-2 (--fdx-family deepseek_ocr2) on cuda,
#                metax EMULATED on the GPU and cpu_amx (the matrix's 600 s holds no room for them yet;
#                DEEPSEEK_BACKENDS narrows the list, e.g. "cuda")
#   deepseek_kernels (not in "all")  DeepSeek-OCR-2's Triton attention kernels: tests/test_deepseek_attention_kernels.py
#                on CUDA and `python3 -m fastdeploy_ext.bench.deepseek_attention` (ours vs ATen, bf16, the real shapes)
#   deepseek_decode (not in "all")  DeepSeek-OCR-2's decode step at batch 64 with ~2k context: ci/step_profile.py
#                (step times, then the profiled kernels of those steps against their wall time)
#   gemm_gelu (not in "all")  the GEMM with the erf GELU in its epilogue (SAM's fc1): tests/test_gemm_gelu.py on
#                CUDA, then `python3 -m fastdeploy_ext.bench.gemm_gelu` (ATen linear + gelu vs ours, a tile sweep)
#   deepseek_preprocess (not in "all")  DeepSeek-OCR-2's views cut on the GPU: the CUDA tests of tests/test_resample.py,
#                test_deepseek_ocr2_device_views.py and the engine's host-vs-device test, then
#                `python3 -m fastdeploy_ext.bench.deepseek_preprocess --device cuda` (transformers vs ours host vs ours on the GPU)
#   deepseek_graphs (not in "all")  DeepSeek-OCR-2's dual-path encoder graphs: tests/test_deepseek_ocr2_graphs.py
#                on CUDA (replay == eager bitwise per path, side by side == one after the other) and bench
#                vision eager vs graphed (the paths one after the other, and side by side)
#   usage: [FDX_COMMIT=sha] ci/gpu_leg.sh [all|matrix|bench|profile|attn|layers|sweep|tests|preprocess|amx|generate|detect|deepseek|deepseek_kernels|deepseek_moe|deepseek_decode|deepseek_preprocess|deepseek_graphs|gemm_gelu]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fdx_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The project itself travels as a wheel built here (pip wheel --no-deps -w .whl .): an editable
# install there would need network for setuptools' build isolation. Its entry points (backends,
# pytest plugin) come from the wheel's metadata; the code imported is the tree's (cwd first).
FDX="python3 -m fastdeploy_ext.entrypoints.cli"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/info.txt"
python3 -c "from fastdeploy_ext.ops.attention.fa3 import load_fa3; print('fa3:', load_fa3()[1])" | tee -a "$OUT/info.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv >> "$OUT/info.txt" 2>&1
echo "commit: ${FDX_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" >> "$OUT/info.txt"
steps=${*:-all}
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
rc=0
if want matrix || want conformance; then
  { for d in cuda cpu_amx; do echo "### $FDX info --device $d"; $FDX info --device $d; done; } >> "$OUT/info.txt" 2>&1 || rc=1
  # --deadline-s: legs stop in time for the table and the archive to be written within the call
  python3 ci/run_matrix.py --gpu --require cuda,cpu_amx --deadline-s ${MATRIX_DEADLINE:-500} ${MATRIX_ARGS:-} \
    --junit-dir /tmp/fdx_matrix --archive "$OUT/matrix_junit.tar.gz" > "$OUT/matrix.txt" 2>&1 || rc=1
  sed -n '/^leg /,$p' "$OUT/matrix.txt"
fi
if want bench; then
  json=(--json-out "$OUT/bench_vision.json"); [[ -n "${NO_BENCH_JSON:-}" ]] && json=()
  timeout ${BENCH_TIMEOUT:-220} $FDX bench vision --device cuda "${json[@]}" ${BENCH_ARGS:-} > "$OUT/bench_vision.txt" 2>&1 || rc=1
  tail -12 "$OUT/bench_vision.txt"
fi
if want profile; then   # per-kernel device time of the default plan and the graphed plan
  timeout ${PROFILE_TIMEOUT:-150} $FDX bench vision --device cuda --no-reference --iters 3 --warmup 1 --profile 25 \
    --variants ${PROFILE_VARIANTS:-strided/host/fused,strided/host/graph+fused} > "$OUT/profile.txt" 2>&1 || rc=1
  grep -E "^\s+(page|blocks16|block8x40|small64)" "$OUT/profile.txt" | tail -8
fi
if want attn; then
  # OUT unset for this one: its JSON would exceed the 8 files that come back
  OUT= timeout 90 python3 -m fastdeploy_ext.bench.attention --quick > "$OUT/attn_bench.txt" 2>&1 || rc=1
  tail -40 "$OUT/attn_bench.txt"
fi
if [[ " $steps " == *" tests "* ]]; then
  timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/test_fused_layers.py tests/test_triton_attention.py tests/test_fa3_backend.py tests/test_rotary.py} \
    > "$OUT/cuda_tests.txt" 2>&1 || rc=1
  tail -3 "$OUT/cuda_tests.txt"
fi
if [[ " $steps " == *" generate "* ]]; then
  timeout ${GENERATE_TIMEOUT:-540} $FDX bench generate --load-format dummy --device cuda --dtype bfloat16 \
    --json-out "$OUT/bench_generate.json" ${GENERATE_ARGS:-} > "$OUT/bench_generate.txt" 2>&1 || rc=1
  grep -E "page1|pages64|lines256|Traceback|Error" "$OUT/bench_generate.txt" | tail -12
fi
if [[ " $steps " == *" detect "* ]]; then
  timeout ${DETECT_TIMEOUT:-300} $FDX bench detect --load-format dummy --device cuda --dtype bfloat16 \
    --batch-sizes ${DETECT_BATCHES:-1,8,32} --json-out "$OUT/bench_detect.json" ${DETECT_ARGS:-} \
    > "$OUT/bench_detect.txt" 2>&1 || rc=1
  tail -6 "$OUT/bench_detect.txt"
  timeout ${DETECT_CHECK_TIMEOUT:-150} python3 ci/detector_bf16_check.py --device cuda \
    --json-out "$OUT/detector_bf16_check.json" > "$OUT/detector_bf16_check.txt" 2>&1 || rc=1
  tail -12 "$OUT/detector_bf16_check.txt"
fi
if [[ " $steps " == *" deepseek "* ]]; then
  for b in ${DEEPSEEK_BACKENDS:-cuda metax cpu_amx}; do
    # the metax backend runs EMULATED on the GPU (the suite's plugin enters its emulation)
    timeout ${DEEPSEEK_TIMEOUT:-400} python3 -m pytest -q \
      --pyargs fastdeploy_ext.conformance --fdx-backend $b --fdx-family deepseek_ocr2 -p no:cacheprovider \
      > "$OUT/deepseek_conformance_$b.txt" 2>&1 || rc=1
    tail -3 "$OUT/deepseek_conformance_$b.txt"
  done
fi
if [[ " $steps " == *" deepseek_kernels "* ]]; then
  # DeepSeek-OCR-2's Triton attention kernels: their CUDA tests (bf16/fp16/fp32 vs the ATen
  # backends at the real shapes, the tiny tower, `info` choosing them), then ours vs ATen side by side
  timeout ${DSK_TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rs tests/test_deepseek_attention_kernels.py \
    > "$OUT/deepseek_kernels_tests.txt" 2>&1 || rc=1
  tail -3 "$OUT/deepseek_kernels_tests.txt"
  # the extra columns: other block configs of ours (block_m x block_n x warps x stages), for tuning default_config
  timeout ${DSK_BENCH_TIMEOUT:-240} python3 -m fastdeploy_ext.bench.deepseek_attention \
    ${DSK_BENCH_ARGS:---configs=32,64,4,3;64,32,4,3;64,64,4,2;128,64,8,3;128,32,8,2} \
    > "$OUT/deepseek_attention.txt" 2>&1 || rc=1
  tail -12 "$OUT/deepseek_attention.txt"
fi
if [[ " $steps " == *" deepseek_moe "* ]]; then
  # the MoE grouped GEMM (triton_moe) and the paged kernels at this family's MHA shape: their CUDA
  # tests (bf16 at the released shape, fp32, no host sync, graph replay == eager), then the layer
  # bench (ours vs aten_moe vs transformers' loop and grouped_mm, 1/64/128/4096 tokens, bf16)
  timeout ${MOE_TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_moe.py \
    tests/test_triton_moe_routing.py tests/test_triton_paged_attention.py -k "cuda" > "$OUT/deepseek_moe_tests.txt" 2>&1 || rc=1
  tail -3 "$OUT/deepseek_moe_tests.txt"
  timeout ${MOE_BENCH_TIMEOUT:-240} python3 -m fastdeploy_ext.bench.moe --device cuda --dtype bfloat16 \
    --json-out "$OUT/bench_moe.json" ${MOE_BENCH_ARGS:-} > "$OUT/bench_moe.txt" 2>&1 || rc=1
  tail -12 "$OUT/bench_moe.txt"
fi
if [[ " $steps " == *" deepseek_decode "* ]]; then
  # DeepSeek-OCR-2's decode step at the released size (dummy bf16, graphs as the row sets them):
  # step wall time at batch 64 with ~2k tokens of context each, then a torch.profiler table of
  # those steps (kernels by device time, their sum against the step's wall time)
  timeout ${DSD_TIMEOUT:-240} python3 ci/step_profile.py --device cuda --model-family deepseek_ocr2 \
    ${DSD_ARGS:---batches 64 --tokens 64 --rounds 2 --context 1900 --profile-batch 64 --profile-steps 20} \
    > "$OUT/deepseek_decode.txt" 2>&1 || rc=1
  grep -E "decode step median|a step|prompt tokens|async scheduling|Traceback|Error" "$OUT/deepseek_decode.txt" | tail -8
fi
if [[ " $steps " == *" gemm_gelu "* ]]; then
  timeout ${GG_TESTS_TIMEOUT:-180} python3 -m pytest -q -p no:cacheprovider -rs tests/test_gemm_gelu.py \
    > "$OUT/gemm_gelu_tests.txt" 2>&1 || rc=1
  tail -3 "$OUT/gemm_gelu_tests.txt"
  timeout ${GG_BENCH_TIMEOUT:-180} python3 -m fastdeploy_ext.bench.gemm_gelu ${GG_BENCH_ARGS:-} \
    > "$OUT/gemm_gelu.txt" 2>&1 || rc=1
  tail -16 "$OUT/gemm_gelu.txt"
fi
if [[ " $steps " == *" deepseek_preprocess "* ]]; then
  timeout ${DSP_TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rs tests/test_resample.py \
    tests/test_deepseek_ocr2_device_views.py "tests/test_deepseek_ocr2_engine.py::test_cuda_device_views_generate_what_host_views_do" \
    > "$OUT/deepseek_preprocess_tests.txt" 2>&1 || rc=1
  tail -3 "$OUT/deepseek_preprocess_tests.txt"
  timeout ${DSP_BENCH_TIMEOUT:-180} python3 -m fastdeploy_ext.bench.deepseek_preprocess --device cuda \
    ${DSP_BENCH_ARGS:---pages 16 --workers 1,4,8} > "$OUT/deepseek_preprocess.txt" 2>&1 || rc=1
  tail -12 "$OUT/deepseek_preprocess.txt"
fi
if [[ " $steps " == *" deepseek_graphs "* ]]; then
  timeout ${DSG_TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rs tests/test_deepseek_ocr2_graphs.py \
    > "$OUT/deepseek_graphs_tests.txt" 2>&1 || rc=1
  tail -3 "$OUT/deepseek_graphs_tests.txt"
  # random weights at the released size: transformers has its own random init (speed compares, outputs do not)
  timeout ${DSG_BENCH_TIMEOUT:-330} $FDX bench vision --load-format dummy --model-family deepseek_ocr2 --device cuda \
    --dtype bfloat16 --variants ${DSG_VARIANTS:-strided/host/eager,strided/host/graph,strided/host/graph+overlap} \
    --workloads ${DSG_WORKLOADS:-nocrop,page6,nocrop16,page6x16} --iters 5 \
    --json-out "$OUT/bench_vision_deepseek_graphs.json" > "$OUT/bench_vision_deepseek_graphs.txt" 2>&1 || rc=1
  grep -E "^== |^\s+(nocrop|page6)|Traceback|Error" "$OUT/bench_vision_deepseek_graphs.txt" | tail -14
fi
if [[ " $steps " == *" harden "* ]]; then
  timeout ${FAULT_TIMEOUT:-200} python3 ci/engine_fault_check.py --device cuda --json-out "$OUT/engine_fault_check.json" \
    > "$OUT/engine_fault_check.txt" 2>&1 || rc=1
  grep -E "^(PASS|FAIL)|Traceback|Error" "$OUT/engine_fault_check.txt" | tail -12
  timeout ${FUZZ_TIMEOUT:-330} python3 ci/fuzz_server.py --requests ${FUZZ_REQUESTS:-2000} --concurrency 16 --images \
    --killers --max-seconds ${FUZZ_SECONDS:-300} --model-args "--load-format dummy --device cuda --dtype bfloat16" \
    --json-out "$OUT/fuzz_server.json" > "$OUT/fuzz_server.txt" 2>&1 || rc=1
  tail -30 "$OUT/fuzz_server.txt"
fi
if [[ " $steps " == *" layers "* ]]; then
  OUT= timeout ${LAYERS_TIMEOUT:-90} python3 -m fastdeploy_ext.bench.layer_ops ${LAYERS_ARGS:-} > "$OUT/layer_ops.txt" 2>&1 || rc=1
  tail -30 "$OUT/layer_ops.txt"
fi
if [[ " $steps " == *" sweep "* ]]; then
  OUT= timeout ${SWEEP_TIMEOUT:-120} python3 -m fastdeploy_ext.bench.attention --quick --no-flex --sweep \
    > "$OUT/attn_sweep.txt" 2>&1 || rc=1
  grep "# best" "$OUT/attn_sweep.txt"
fi
if [[ " $steps " == *" preprocess "* ]]; then
  timeout ${PRE_TIMEOUT:-150} $FDX bench preprocess --images 16 --workers ${PRE_WORKERS:-1,16} --iters 2 --warmup 1 \
    --json-out "$OUT/preprocess.json" > "$OUT/preprocess.txt" 2>&1 || rc=1
  tail -14 "$OUT/preprocess.txt"
fi
if [[ " $steps " == *" amx "* ]]; then
  # Threads: one per physical core (backends/cpu_amx/threads.py). Pinning (OMP_PLACES=cores
  # OMP_PROC_BIND=close) must be in the environment before torch starts its OpenMP pool; it is
  # off for the main runs (it binds the Python main thread too) and measured on its own after.
  for dt in ${AMX_DTYPES:-bfloat16 float32}; do
    echo "### bench vision --device cpu_amx --dtype $dt" >> "$OUT/amx.txt"
    timeout ${AMX_TIMEOUT:-150} $FDX bench vision --device cpu_amx --dtype $dt \
      --workloads ${AMX_WORKLOADS:-img1536,block8x40} --variants ${AMX_VARIANTS:-strided/host/eager,dense/device/eager} \
      --iters 3 --warmup 1 >> "$OUT/amx.txt" 2>&1 || rc=1
  done
  echo "### bench gemm --device cpu_amx" >> "$OUT/amx.txt"
  timeout 120 $FDX bench gemm --device cpu_amx --tokens 320,1536 --json-out "$OUT/gemm.json" >> "$OUT/amx.txt" 2>&1 || rc=1
  if [[ -n "${AMX_PIN_CHECK:-}" ]]; then
    echo "### pinned: OMP_PLACES=cores OMP_PROC_BIND=close bench vision --device cpu_amx (bf16, img1536)" >> "$OUT/amx.txt"
    OMP_PLACES=cores OMP_PROC_BIND=close timeout 90 $FDX bench vision --device cpu_amx --workloads img1536 \
      --variants strided/host/eager --no-reference --iters 3 --warmup 1 >> "$OUT/amx.txt" 2>&1 || rc=1
  fi
  grep -E "^\s+(img1536|block8x40)|ceiling|encoder|oneDNN|###|cpu threads" "$OUT/amx.txt" | tail -30
fi
exit $rc
