# session 9 call 4: GEMV_EVICT_FIRST / GEMV_NEXT_L2_TAIL tests, interleaved runs, one HBM timeline
timeout 200 python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m pytest -q tests/test_engine_gpu.py -k "next_weights and (TAIL or EVICT)" -p no:cacheprovider > $OUT/engine-evict.log 2>&1; echo "engine evict/tail: rc=$? $(tail -1 $OUT/engine-evict.log)"
E=GEMV_EVICT_FIRST=1; T=GEMV_NEXT_L2=1,GEMV_NEXT_L2_TAIL
KNOBS="default $E $E,$T=12 $E,$T=20 $T=12 default $E $E,$T=12 llama-3.2-1b:fp16@default llama-3.2-1b:fp16@$E llama-3.2-1b:fp16@$E,$T=8 llama-3.1-8b:fp8@default llama-3.1-8b:fp8@$E,$T=16" \
DRAM_SPECS="llama-3.2-3b:fp8@$E,$T=12" timeout 400 bash scripts/gpu_check.sh info knobs dram
