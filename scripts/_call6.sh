# session 9 call 6: 3B W8A16 prefetch size, interleaved (budget: ~4 device minutes)
timeout 60 python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
E=GEMV_EVICT_FIRST=1,GEMV_NEXT_L2=1,GEMV_NEXT_L2_TAIL
KNOBS="default $E=6 $E=4 $E=8 default $E=6" timeout 150 bash scripts/gpu_check.sh knobs
