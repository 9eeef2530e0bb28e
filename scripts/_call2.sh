# session 9 call 2: tests of the GEMV_NEXT_L2 knob, then interleaved runs, then the HBM timelines
export KERNELS_K="rope or qkv"
timeout 200 python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 260 python3 -m pytest -q tests/test_engine_gpu.py -k next_weights -p no:cacheprovider > $OUT/engine-next-l2.log 2>&1; echo "engine next_l2: rc=$? $(tail -1 $OUT/engine-next-l2.log)"
KNOBS="default GEMV_NEXT_L2=1 GEMV_NEXT_L2=2 llama-3.2-1b:fp16@default llama-3.2-1b:fp16@GEMV_NEXT_L2=1 llama-3.2-3b:fp8@default llama-3.2-3b:fp8@GEMV_NEXT_L2=1 llama-3.1-8b:fp8@default llama-3.1-8b:fp8@GEMV_NEXT_L2=1" \
DRAM_SPECS="llama-3.2-3b:fp8@GEMV_NEXT_L2=1" timeout 330 bash scripts/gpu_check.sh info knobs dram
