#!/usr/bin/env bash
# llama.cpp measured on this GPU (device machine, no network): build, convert, quantize, llama-bench, baselines.
#   scripts/peer_llama_cpp.sh [stage ...]     stages: info build convert bench server table
#                                             (default: info build convert bench table; `all` adds server)
# Env (defaults):
#   LLAMA_TARBALL  .carry/llama.cpp/llama.cpp-*.tar.xz   (scripts/llama_cpp_source.py makes it; SOURCE.json beside it)
#   MODELS         "llama-3.2-1b llama-3.2-3b llama-3.1-8b"     catalog names (synthetic weights via atomflow-bench fetch)
#   QUANTS         "F16 Q8_0"      CONTEXTS "128 2048" (llama-bench -d: decode after N tokens of context)
#   NGEN 128  NPROMPT 512  REPS 5  JOBS 16  CUDA_ARCH (default: nvidia-smi compute_cap, e.g. 90)
#   WORK           /tmp/llama-cpp-work   persistent between calls on a warm machine: src/, build/, gguf/, results/
#   DROP_HF 1      delete a model's synthetic HF dir once its F16 GGUF exists (disk: 8B is 16 GB per copy)
#   DROP_GGUF 1    delete a GGUF once its bench is recorded (the server's stays; the record keeps its size)
#   BUILD_BG 1     the build runs in the background while `convert` makes the F16 GGUFs (which need no build)
#   SERVER_MODEL llama-3.2-3b  SERVER_QUANT Q8_0  SERVER_PORT 8090
#   STAGE_TIMEOUT 540  (s; a stage cut short is resumed by the next call: ninja is incremental, GGUFs are written
#                       to .part and renamed, a finished bench is skipped)
# Results: $WORK/results (kept across calls); each call ends by packing them into $OUT/llama_cpp_results.tar.gz and
# $OUT/summary.txt, and prints the table of baseline records last.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
OUT=${OUT:-/tmp/llama-cpp-out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/llama-cpp-work}
RES=$WORK/results; mkdir -p "$RES/logs" "$RES/bench" "$RES/records" "$WORK/gguf"
export PYTHONUNBUFFERED=1 ATOMFLOW_HOME=${ATOMFLOW_HOME:-/tmp/atomflow-home}
[ -d .carry/wheels ] && export ATOMFLOW_WHEELHOUSE=$PWD/.carry/wheels
MODELS=${MODELS:-"llama-3.2-1b llama-3.2-3b llama-3.1-8b"}
QUANTS=${QUANTS:-"F16 Q8_0"}
CONTEXTS=${CONTEXTS:-"128 2048"}
NGEN=${NGEN:-128}; NPROMPT=${NPROMPT:-512}; REPS=${REPS:-5}; JOBS=${JOBS:-16}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-540}; DROP_HF=${DROP_HF:-1}; DROP_GGUF=${DROP_GGUF:-1}; BUILD_BG=${BUILD_BG:-1}
SERVER_MODEL=${SERVER_MODEL:-llama-3.2-3b}; SERVER_QUANT=${SERVER_QUANT:-Q8_0}; SERVER_PORT=${SERVER_PORT:-8090}
T0=$(date +%s)
stages=${*:-info build convert bench table}
[ "$stages" = all ] && stages="info build convert bench server table"

note() { printf '%s\n' "$1" | tee -a "$RES/summary.txt"; }
left() { local l=$(( STAGE_TIMEOUT - ($(date +%s) - T0) )); [ $l -gt 1 ] && echo $l || echo 1; }  # s left this call
finish() {
  tar -czf "$OUT/llama_cpp_results.tar.gz" -C "$WORK" results 2>/dev/null
  cp "$RES/summary.txt" "$OUT/summary.txt" 2>/dev/null
  echo "================ llama.cpp baselines ================"
  python3 -m atomflow_bench.measure.llama_cpp table "$RES"/records/*.json 2>/dev/null
}
trap finish EXIT

# ---- source and tools ----------------------------------------------------------------------------
TARBALL=${LLAMA_TARBALL:-$(ls .carry/llama.cpp/llama.cpp-*.tar.xz 2>/dev/null | head -1)}
[ -f "$TARBALL" ] || { note "no llama.cpp tarball (LLAMA_TARBALL or .carry/llama.cpp/*.tar.xz): carry .carry/llama.cpp"; exit 1; }
SRCJSON=$(dirname "$TARBALL")/SOURCE.json
TOP=$(basename "$TARBALL" .tar.xz)
SRC=$WORK/src/$TOP; BUILD=$WORK/build; BIN=$BUILD/bin
COMMIT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("llama_cpp_commit") or "unknown")' "$SRCJSON" 2>/dev/null || echo unknown)
SDIST=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["sdist"])' "$SRCJSON" 2>/dev/null || echo "?")
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  mkdir -p "$WORK/src" && tar -xJf "$TARBALL" -C "$WORK/src" || { note "extract $TARBALL failed"; exit 1; }
fi
command -v atomflow-bench >/dev/null ||
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$RES/logs/install.log" 2>&1 || { note "pip install -e . failed"; exit 1; }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
CUDA_ARCH=${CUDA_ARCH:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')}
CMAKE_FLAGS="-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} \
-DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
-DLLAMA_BUILD_COMMIT=$COMMIT -DLLAMA_BUILD_NUMBER=0"
BUILD_CMD="cmake -S $SRC -B $BUILD $CMAKE_FLAGS && cmake --build $BUILD --target llama-bench llama-quantize llama-server -j$JOBS"
do_build() {
      if built && [ -f "$BUILD/.done" ]; then note "build: done earlier ($(cat "$BUILD/.done"))"; return 0; fi
      t=$(date +%s)
      [ -f "$BUILD/build.ninja" ] || cmake -S "$SRC" -B "$BUILD" $CMAKE_FLAGS >"$RES/logs/configure.log" 2>&1 ||
        { note "build: configure failed (logs/configure.log): $(tail -3 "$RES/logs/configure.log" | tr '\n' ' ')"; return 1; }
      timeout "$(left)" cmake --build "$BUILD" --target llama-bench llama-quantize llama-server -j"$JOBS" \
        >>"$RES/logs/build.log" 2>&1; rc=$?
      dt=$(( $(date +%s) - t )); echo "$dt" >>"$BUILD/.seconds"
      total=$(awk '{s+=$1} END {print s}' "$BUILD/.seconds")
      if [ $rc -eq 0 ] && built; then
        echo "${total}s of build over $(wc -l <"$BUILD/.seconds") call(s), sm_$CUDA_ARCH, -j$JOBS" >"$BUILD/.done"
        "$BIN/llama-bench" --help >"$RES/logs/llama-bench-help.txt" 2>&1
        note "build: ok in ${dt}s (total $(cat "$BUILD/.done"))"
      else
        note "build: rc=$rc after ${dt}s ($(grep -c 'Building' "$RES/logs/build.log") steps logged; 124 = cut short: call again)"
        [ $rc -eq 124 ] && return 0 || return 1
      fi
}
BUILD_PID=
wait_build() { [ -n "$BUILD_PID" ] && { wait "$BUILD_PID"; BUILD_PID=; }; built; }
# whether a GGUF is still needed: its bench is not recorded, or it is the server's and the server is not recorded
needs_gguf() {
  [[ " $QUANTS " == *" $2 "* ]] || return 1
  [ -f "$RES/bench/$1-$(q_lower "$2").recorded" ] || return 0
  [ "$1/$2" = "$SERVER_MODEL/$SERVER_QUANT" ] && [[ " $stages " == *" server "* ]] && [ ! -f "$RES/server.recorded" ]
}
built() { [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-quantize" ] && [ -x "$BIN/llama-server" ]; }

q_lower() { echo "$1" | tr 'A-Z' 'a-z'; }
gguf_of() { echo "$WORK/gguf/$1-$(q_lower "$2").gguf"; }   # gguf_of MODEL QUANT
cmds_of() { cat "$WORK/gguf/$1.commands" 2>/dev/null; }    # how a model's GGUFs were made
hf_dir() {  # the model's store directory when it is there (no fetch), else nothing
  python3 -c 'import sys; from atomflow_bench.store.fetch import resolve_model
try: print(resolve_model(sys.argv[1], fetch_if_missing=False))
except Exception: pass' "$1" 2>/dev/null; }

note "=== $(date -u +%FT%TZ) stages: $stages (WORK=$WORK)"
for st in $stages; do
  case $st in
    info)
      { nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm,clocks.max.mem --format=csv
        nvcc --version | tail -2; cmake --version | head -1; ninja --version
        python3 -c 'import torch, transformers, safetensors, numpy, sentencepiece; print("torch", torch.__version__, "transformers", transformers.__version__, "sentencepiece", sentencepiece.__version__)'
        df -h /tmp | tail -1; cat "$SRCJSON" | head -20; } >"$RES/logs/info.txt" 2>&1
      note "info: $GPU driver $DRIVER sm_$CUDA_ARCH; $(grep -m1 '^torch' "$RES/logs/info.txt"); src $TOP ($SDIST, llama.cpp $COMMIT)" ;;
    build)
      if [ "$BUILD_BG" = 1 ]; then do_build & BUILD_PID=$!; note "build: started in the background (pid $BUILD_PID)"
      else do_build || exit $?; fi ;;
    convert)   # F16 for every model first (needs no build: it overlaps a background build), then Q8_0
      for m in $MODELS; do
        f16=$(gguf_of "$m" F16)
        if [ -f "$f16" ]; then note "convert $m F16: done earlier"; continue; fi
        # a GGUF dropped once benched (DROP_GGUF) is made again only for a bench or the server still to come
        if ! needs_gguf "$m" F16 && { ! needs_gguf "$m" Q8_0 || [ -f "$(gguf_of "$m" Q8_0)" ]; }; then
          note "convert $m F16: done earlier (its benches are recorded)"; continue
        fi
        [ "$(left)" -gt 60 ] || { note "convert $m: no time left in this call: call again"; exit 0; }
        log=$RES/logs/convert-$m.log
        hf=$(hf_dir "$m")
        if [ ! -f "$hf/config.json" ]; then
          timeout "$(left)" atomflow-bench fetch "$m" >"$log" 2>&1 || { note "convert $m: fetch rc=$? (logs/convert-$m.log)"; exit 1; }
          hf=$(hf_dir "$m")
        fi
        trim=$WORK/hf-trimmed/$m
        python3 -m atomflow_bench.measure.llama_cpp trim-model "$hf" "$trim" >"$RES/logs/trim-$m.json" 2>>"$log" ||
          { note "convert $m: tokenizer trim failed"; exit 1; }
        c1="python3 $SRC/convert_hf_to_gguf.py $trim --outtype f16 --outfile $f16"
        timeout "$(left)" python3 "$SRC/convert_hf_to_gguf.py" "$trim" --outtype f16 --outfile "$f16.part" >>"$log" 2>&1 &&
          mv "$f16.part" "$f16" || { note "convert $m: convert_hf_to_gguf rc=$? (logs/convert-$m.log; call again if 124)"; rm -f "$f16.part"; exit 1; }
        printf 'atomflow-bench fetch %s (synthetic); python3 -m atomflow_bench.measure.llama_cpp trim-model HF TRIM (%s); %s\n' \
          "$m" "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["note"])' "$RES/logs/trim-$m.json")" "$c1" >"$WORK/gguf/$m.commands"
        rm -rf "$trim"
        [ "$DROP_HF" = 1 ] && [ -n "$hf" ] && [ -d "$hf" ] && rm -rf "$hf"   # deterministic: fetch remakes it
        note "convert $m F16: $(ls -l "$f16" | awk '{printf "%.2f GB", $5/1e9}') at $(( $(date +%s) - T0 ))s"
      done
      [[ " $QUANTS " == *" Q8_0 "* ]] || continue
      wait_build || { note "convert: llama-quantize not built (stage build)"; exit 1; }
      for m in $MODELS; do
        f16=$(gguf_of "$m" F16); q8=$(gguf_of "$m" Q8_0)
        [ -f "$q8" ] && { note "quantize $m: done earlier"; continue; }
        needs_gguf "$m" Q8_0 || { note "quantize $m: done earlier (its bench is recorded)"; continue; }
        [ "$(left)" -gt 45 ] || { note "quantize $m: no time left in this call: call again"; exit 0; }
        timeout "$(left)" "$BIN/llama-quantize" "$f16" "$q8.part" Q8_0 >>"$RES/logs/convert-$m.log" 2>&1 && mv "$q8.part" "$q8" ||
          { note "quantize $m: llama-quantize rc=$?"; rm -f "$q8.part"; exit 1; }
        printf '%s/llama-quantize %s %s Q8_0\n' "$BIN" "$f16" "$q8" >>"$WORK/gguf/$m.commands"
        note "quantize $m Q8_0: $(ls -l "$q8" | awk '{printf "%.2f GB", $5/1e9}') at $(( $(date +%s) - T0 ))s"
      done ;;
    bench)
      wait_build || { note "bench: not built yet"; exit 1; }
      depths=$(echo $CONTEXTS | tr ' ' ',')
      for m in $MODELS; do for q in $QUANTS; do
        g=$(gguf_of "$m" "$q"); tag=$m-$(q_lower "$q")
        [ -f "$g" ] || { note "bench $tag: no GGUF (stage convert)"; continue; }
        if [ -f "$RES/bench/$tag.recorded" ]; then note "bench $tag: done earlier"; continue; fi
        [ "$(left)" -gt 45 ] || { note "bench $tag: no time left in this call: call again"; exit 0; }
        bcmd="$BIN/llama-bench -m $g -ngl 99 -fa on -p $NPROMPT -n $NGEN -d $depths -r $REPS -o json"
        timeout "$(left)" $bcmd >"$RES/bench/$tag.json.part" 2>"$RES/logs/bench-$tag.log"; rc=$?
        [ $rc -eq 0 ] && mv "$RES/bench/$tag.json.part" "$RES/bench/$tag.json" || { note "bench $tag: rc=$rc (logs/bench-$tag.log)"; continue; }
        python3 -m atomflow_bench.measure.llama_cpp "$RES/bench/$tag.json" --gguf "$g" --model "$m" --gpu "$GPU" \
          --driver "$DRIVER" --source-json "$SRCJSON" --build-flags "$BUILD_CMD" \
          --commands "$(cmds_of "$m" | sed 's/$/; /' | tr -d '\n')$bcmd" \
          --extra "build=$(cat "$BUILD/.done" 2>/dev/null)" --extra "cuda_arch=sm_$CUDA_ARCH" \
          --extra "nvcc=$(nvcc --version | tail -1)" --out "$RES/records" >"$RES/logs/record-$tag.log" 2>&1 &&
          touch "$RES/bench/$tag.recorded"
        note "bench $tag: rc=$? $(grep -o 'ctx [0-9]* TPOT [0-9.]* ms' "$RES/logs/record-$tag.log" | tr '\n' ' ')"
        # disk: the next models' GGUFs need the room; the record keeps the size (the server's GGUF stays)
        [ "$DROP_GGUF" = 1 ] && [ -f "$RES/bench/$tag.recorded" ] && [ "$m/$q" != "$SERVER_MODEL/$SERVER_QUANT" ] && rm -f "$g"
      done; done ;;
    server)
      wait_build || { note "server: not built yet"; exit 1; }
      g=$(gguf_of "$SERVER_MODEL" "$SERVER_QUANT")
      [ -f "$g" ] || { note "server: no $g (stage convert)"; continue; }
      [ -f "$RES/server.recorded" ] && { note "server: done earlier"; continue; }
      scmd="$BIN/llama-server -m $g --host 127.0.0.1 --port $SERVER_PORT -ngl 99 -fa on -c 4096 -np 1 --alias $SERVER_MODEL"
      $scmd >"$RES/logs/server.log" 2>&1 & spid=$!
      for i in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$SERVER_PORT/health" >/dev/null 2>&1 && break
        python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$SERVER_PORT/health', timeout=2)" 2>/dev/null && break
        kill -0 $spid 2>/dev/null || break; sleep 1
      done
      out=$RES/records/llama.cpp-server-$(echo "$GPU" | tr -c 'A-Za-z0-9.\n' '-' | tr 'A-Z' 'a-z')-$SERVER_MODEL-$(q_lower "$SERVER_QUANT")-prompt128.json
      wb=$(python3 -m atomflow_bench.measure.llama_cpp weight-bytes "$g" --model "$SERVER_MODEL" 2>/dev/null)
      wbargs=(); [ -n "$wb" ] && wbargs=(--weight-bytes "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["weight_bytes"])' "$wb")" \
        --weight-bytes-basis "$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["basis"])' "$wb")")
      timeout "$(left)" atomflow-bench baseline record --openai-url "http://127.0.0.1:$SERVER_PORT" --model "$SERVER_MODEL" \
        --catalog-model "$SERVER_MODEL" --gpu "$GPU" --precision "$SERVER_QUANT" --engine llama.cpp-server \
        --engine-version "$COMMIT ($SDIST)" --flags "$scmd" --prompt-tokens 128 --max-tokens 128 --requests 5 \
        ${wbargs[@]+"${wbargs[@]}"} --out "$out" >"$RES/logs/server-record.log" 2>&1 && touch "$RES/server.recorded"
      note "server $SERVER_MODEL $SERVER_QUANT: rc=$? $(grep -m1 'TPOT median' "$RES/logs/server-record.log")"
      kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null ;;
    table) ;;   # printed on exit, always
    *) note "unknown stage $st" ;;
  esac
done
