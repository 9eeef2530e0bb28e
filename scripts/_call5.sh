# session 9 call 5: GEMV_EVICT_FIRST + GEMV_NEXT_L2_TAIL confirmed per shape, interleaved
timeout 200 python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
E=GEMV_EVICT_FIRST=1,GEMV_NEXT_L2=1,GEMV_NEXT_L2_TAIL
B=llama-3.2-1b:fp16; G=llama-3.1-8b:fp8; F=llama-3.2-3b:fp16; K=llama-3.2-3b:fp8
KNOBS="$B@default $B@$E=8 $B@$E=12 $G@default $G@$E=16 $G@$E=24 $F@default $F@$E=12 $K@default $K@$E=6 $B@default $B@$E=8 $G@default $G@$E=16" \
timeout 380 bash scripts/gpu_check.sh info knobs
