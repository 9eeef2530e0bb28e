# session 9 call 3: GEMV_NEXT_L2_GU tests, then interleaved runs, then the HBM timeline
timeout 200 python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m pytest -q tests/test_engine_gpu.py -k "next_weights and GU" -p no:cacheprovider > $OUT/engine-next-l2-gu.log 2>&1; echo "engine next_l2 GU: rc=$? $(tail -1 $OUT/engine-next-l2-gu.log)"
G=GEMV_NEXT_L2=1,GEMV_NEXT_L2_GU
KNOBS="default $G=8 $G=16 $G=24 default $G=8 $G=16 llama-3.2-1b:fp16@default llama-3.2-1b:fp16@$G=8 llama-3.1-8b:fp8@default llama-3.1-8b:fp8@$G=8 llama-3.1-8b:fp8@$G=16" \
DRAM_SPECS="llama-3.2-3b:fp8@$G=16" timeout 380 bash scripts/gpu_check.sh info knobs dram
