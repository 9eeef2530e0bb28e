# call.sh — what a lab device call's script shares, sourced as `. lab/scripts/call.sh NAME`: the call's folder
# $OUT/NAME ($W) and summary ($S), the GPU's line, the project installed; then the steps below.
#   note TEXT         a timed line into the summary (and stdout)
#   runr TAG CTX      `run` 3B fp16 with a CTX-token prompt (5 repeats, 3 at 8192), its TTFT line noted
#   val TAG FMT       `validate` 3B FMT on the prefill path against /tmp/truth-3b (made on the first call), noted
#   pairs PATCH       runr with and without PATCH (applied on entry) in pairs, 2048's first: C A C A, PATCH off after
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=$OUT/$1; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
runr() {
  local n=$([ $2 = 8192 ] && echo 3 || echo 5)
  timeout -k 5 100 atomflow-bench run llama-3.2-3b --weights fp16 --ctx $2 --tokens 64 --repeats $n --json $W/$1.json \
    >$W/$1.log 2>&1; note "run $1: rc=$? $(grep -E 'TTFT' $W/$1.log | tr -s ' ')"; }
val() {
  timeout -k 5 120 atomflow-bench validate llama-3.2-3b --weights $2 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
    --json $W/validate-$1.json >$W/validate-$1.log 2>&1
  note "validate $1: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-$1.log | tr -s ' ' | head -3 | tr '\n' ' ')"; }
pairs() {
  runr C-2048 2048; git apply -R $1; runr A-2048 2048
  git apply $1; runr C-8192 8192; git apply -R $1; runr A-8192 8192; }
