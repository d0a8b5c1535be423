#!/usr/bin/env bash
# The whole GPU path checked in ONE call of a lent GPU machine, in at most 9 minutes: stages the
# pack (prepare.sh's .gpu/stack.tar.xz), then runs benchmarks/gpu_call.py's steps -- the main job,
# the HSTU, CUDA graphs through validation, UVM caching, equivalence, then alone the loader into the
# GPU, a profile of 20 steady steps and the throughput rows -- each with its own time limit, a JSON
# line per step as it ends. Everything lands in one folder, packed on exit (a timeout too) into ONE
# archive, $OUT/gpu_call.tar.gz, beside $OUT/steps.jsonl (the device tool returns at most 8 files).
#
#   device run: command "bash scripts/gpu_stage/check.sh", carry [".gpu"], timeout_s 600
#   bash scripts/gpu_stage/check.sh --on_cpu     # here: every step's command line, quick, on CPU
#
# GPU_STAGE_PACK: the pack to stage (default .gpu/stack.tar.xz; empty: the environment already has
# the stack). GPU_CALL_BUDGET_S: seconds for it all (default 540). OUT: where the archive goes
# (default outputs/gpu_call). GPU_CALL_DIR: the folder the steps write into (default a new one).
set -uo pipefail  # not -e: a step that fails is recorded, and the next one runs
cd "$(dirname "$0")/../.."
budget=${GPU_CALL_BUDGET_S:-540}
out=${OUT:-outputs/gpu_call}
work=${GPU_CALL_DIR:-$(mktemp -d)/gpu_call}
pack=${GPU_STAGE_PACK-.gpu/stack.tar.xz}
root=${STAGE_ROOT:-/tmp}
mkdir -p "$out" "$work"
# The archive must come back whole (16 MiB a file): checkpoints stay out, and the profile's trace
# too where it would not fit.
archive() {
  cp "$work/steps.jsonl" "$out/" 2>/dev/null
  tar czf "$out/gpu_call.tar.gz" -C "$(dirname "$work")" --exclude=ckpt "$(basename "$work")"
  if [ "$(stat -c %s "$out/gpu_call.tar.gz")" -gt 15000000 ]; then
    tar czf "$out/gpu_call.tar.gz" -C "$(dirname "$work")" --exclude=ckpt --exclude=trace.json "$(basename "$work")"
  fi
  echo "check.sh: $out/gpu_call.tar.gz ($(du -h "$out/gpu_call.tar.gz" | cut -f1)) holds $work"
}
trap archive EXIT
record() {  # STEP EXIT_STATUS SECONDS SUMMARY: one JSON line, as gpu_call.py writes its steps'
  python3 -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "ok": sys.argv[2] == "0", "rc": int(sys.argv[2]),
    "seconds": int(sys.argv[3]), "summary": sys.argv[4]}))' "$@" | tee -a "$work/steps.jsonl"
}
staged=0
if [ -n "$pack" ]; then
  timeout 120 bash scripts/gpu_stage/stage.sh "$pack" > "$work/stage.log" 2>&1
  staged=$?
  record stage "$staged" "$SECONDS" "$(tail -n 1 "$work/stage.log")"
  [ -f "$root/gpu_env.sh" ] && . "$root/gpu_env.sh"
fi
nvidia-smi > "$work/nvidia-smi.txt" 2>&1
left=$((budget - SECONDS))
timeout $((left + 10)) python3 -m benchmarks.gpu_call --out "$work" --budget_s "$left" "$@"
status=$?
# 0 only when the stack staged and every step was ok.
[ "$staged" = 0 ] && exit "$status"
exit 1
