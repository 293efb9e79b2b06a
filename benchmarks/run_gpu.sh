#!/usr/bin/env bash
# One command on a GPU machine, from anywhere, needing no network: the sections named in FLATOPT_SECTIONS, each
# writing its result JSON and plot (PNG) to $OUT, then one markdown summary of their tables.
#
#   tests     the whole test suite, GPU tests included (JUnit XML)                      about 190 s on an H100
#   capture   bench_capture.py: captured training steps against CUDA graphs, torch.compile  about 210 s
#   step      bench_step.py --variants step --groups 1: step() alone, percent of the floor  200-350 s
#   loop      bench_step.py --variants loop --groups 1,2: zero_grad + gradient landing + step  not yet measured
#   eager     bench_eager.py: eager training steps against torch fused and foreach AdamW,   not yet measured
#             then profile_landing.py (host time per layer of each landing; a fifth of the share, 40 s at most)
#   memory    bench_memory.py: in-backward mode's peak memory on a 1B model                about 40 s
#   fsdp      bench_fsdp.py --ranks 1,2: FSDP2 on one GPU, flatopt against torch fused AdamW  not yet measured
#   convergence  convergence.py: final loss of each precision mode against fp32 AdamW, 3 seeds  not yet measured
#
# A command on the GPU machine may run 600 s and return 8 files, so the sections go in five calls:
#
#   FLATOPT_GIT_COMMIT=$(git rev-parse HEAD) FLATOPT_SECTIONS="loop eager" benchmarks/run_gpu.sh
#   FLATOPT_GIT_COMMIT=$(git rev-parse HEAD) FLATOPT_SECTIONS="step memory" benchmarks/run_gpu.sh [--no-compile]
#   FLATOPT_GIT_COMMIT=$(git rev-parse HEAD) benchmarks/run_gpu.sh                     # "tests capture"
#   FLATOPT_GIT_COMMIT=$(git rev-parse HEAD) FLATOPT_SECTIONS=convergence benchmarks/run_gpu.sh
#   FLATOPT_GIT_COMMIT=$(git rev-parse HEAD) FLATOPT_SECTIONS=fsdp benchmarks/run_gpu.sh
#   FLATOPT_DRY_RUN=1 FLATOPT_SECTIONS="tests step loop eager memory fsdp capture convergence" benchmarks/run_gpu.sh  # CPU
#
# Extra arguments go to bench_step.py (the step and loop sections). FLATOPT_DRY_RUN=1 runs every section as a CPU
# smoke run (the test section runs tests/test_benchmarks.py only): it checks this script and measures nothing.
#
# First installs the package (pip install --no-deps --no-build-isolation -e .); if that fails, maps
# flatopt.kernels to kernels/ with a sitecustomize.py on PYTHONPATH, as an editable install does.
#
# Time: everything ends within FLATOPT_RUN_BUDGET_S seconds (default 560; the device stops commands at 600).
# Before each section the time left (minus FLATOPT_RESERVE_S, default 25, for the plots and summary) is shared
# among the sections still to run in proportion to their weights, FLATOPT_SHARE_TESTS / _STEP / _LOOP / _EAGER /
# _MEMORY / _FSDP / _CAPTURE / _CONVERGENCE (defaults 220 / 150 / 300 / 220 / 60 / 200 / 250 / 360), so time a
# section does not use goes to the next ones. Each benchmark gets its share as --budget-s (minus 15 s for writing) and
# is stopped by `timeout` at its share; the step section runs with --quick when its share is under 240 s, the loop
# section always.
#
# Writes to $OUT (default: benchmarks/results), every name stamped with the run's UTC time: run-STAMP.log
# (everything printed, nvidia-smi included), junit-STAMP.xml (tests), step-STAMP.json (step), step-loop-STAMP.json
# (loop), eager-STAMP.json, memory-STAMP.json, fsdp-STAMP.json, capture-STAMP.json, convergence-STAMP.json, a PNG
# beside each JSON, profiles/profile-landing-STAMP.json (eager), and summary-STAMP.md (the benchmarks' markdown
# tables). Commit the JSON and PNG files to benchmarks/results/ (with the device in the name, e.g.
# eager-h100-STAMP.json) and run `python3 benchmarks/report.py` to regenerate docs/performance.md.
# Exit status: non-zero when a test failed, a benchmark failed (a flatopt case failed), or a plot failed.
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
START=$SECONDS
DRY=${FLATOPT_DRY_RUN:-0}
BUDGET=${FLATOPT_RUN_BUDGET_S:-560}
RESERVE=${FLATOPT_RESERVE_S:-25}
SECTIONS=${FLATOPT_SECTIONS:-tests capture}
if [ "${FLATOPT_SKIP_TESTS:-0}" = 1 ]; then SECTIONS=${SECTIONS//tests/}; fi
declare -A SHARE=([tests]=${FLATOPT_SHARE_TESTS:-220} [step]=${FLATOPT_SHARE_STEP:-150}
  [loop]=${FLATOPT_SHARE_LOOP:-300} [eager]=${FLATOPT_SHARE_EAGER:-220} [memory]=${FLATOPT_SHARE_MEMORY:-60}
  [fsdp]=${FLATOPT_SHARE_FSDP:-200} [capture]=${FLATOPT_SHARE_CAPTURE:-250}
  [convergence]=${FLATOPT_SHARE_CONVERGENCE:-360})
for s in $SECTIONS; do
  if [ -z "${SHARE[$s]+x}" ]; then
    echo "run_gpu.sh: unknown section '$s' in FLATOPT_SECTIONS; expected some of: tests step loop eager memory fsdp capture convergence" >&2
    exit 2
  fi
done
LOG="$DEST/run-$STAMP.log"
WORK=$(mktemp -d)
exec > >(tee -a "$LOG") 2>&1 # everything below goes to the terminal and to the one log
TEE_PID=$!
finish() { # let tee write the last lines before the command ends
  rm -rf "$WORK"
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null || true
}
trap finish EXIT

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
  echo "DRY RUN (FLATOPT_DRY_RUN=1): smoke runs on the CPU, nothing installed; checks this script, measures nothing"
  PY=${PYTHON:-python3}
  BENCH_DEV=(--device cpu --smoke)
  EAGER_MODELS=(--models small,gpt2,llama,convnet,mlp3000,demo)
  FSDP_RANKS=() # bench_fsdp.py's CPU default: two gloo ranks
  PLOT_SMOKE=(--allow-smoke)
else
  PY=python3
  BENCH_DEV=()
  EAGER_MODELS=()
  FSDP_RANKS=(--ranks 1,2) # one rank, then two sharing the GPU (recorded as not run when NCCL refuses them)
  PLOT_SMOKE=()
  unset TRITON_INTERPRET # the kernels run on the GPU here
fi

# flatopt.kernels is the kernels/ directory (pyproject's package-dir): install the package, editable.
if [ "$DRY" != 1 ]; then
  echo "== install: $PY -m pip install --no-deps --no-build-isolation -e . -q"
  $PY -m pip install --no-deps --no-build-isolation -e . -q || echo "pip install failed; trying the sitecustomize mapping"
fi
if ! $PY -c "import flatopt.kernels" 2>/dev/null; then
  SHIM="$WORK/shim"
  mkdir -p "$SHIM"
  cat >"$SHIM/sitecustomize.py" <<EOF
# Written by benchmarks/run_gpu.sh: maps flatopt.kernels to $REPO/kernels, as an editable install does.
import importlib.abc
import importlib.util
import sys

_KERNELS = "$REPO/kernels"


class _FlatoptKernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "flatopt.kernels":
            return None
        return importlib.util.spec_from_file_location(
            name, _KERNELS + "/__init__.py", submodule_search_locations=[_KERNELS]
        )


sys.meta_path.append(_FlatoptKernelsFinder())
EOF
  export PYTHONPATH="$SHIM:$PYTHONPATH"
  $PY -c "import flatopt.kernels" || {
    echo "run_gpu.sh: cannot import flatopt.kernels, even through $SHIM/sitecustomize.py" >&2
    exit 1
  }
  echo "flatopt is not installed: flatopt.kernels is mapped to $REPO/kernels for this run"
fi

$PY - <<'EOF'
import platform, torch, triton, flatopt.kernels
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, {name}")
print(f"flatopt from {flatopt.kernels.__file__}")
EOF
echo "== nvidia-smi"
nvidia-smi 2>&1 || true
echo "sections: $SECTIONS; budget $BUDGET s (reserve $RESERVE s)"

# share SECTION: seconds for SECTION = time left (minus the reserve) x its weight / weights of the sections left
share() {
  local left=$((BUDGET - (SECONDS - START) - RESERVE)) total=0 s seen=0
  for s in $SECTIONS; do
    if [ "$s" = "$1" ]; then seen=1; fi
    if [ "$seen" = 1 ]; then total=$((total + SHARE[$s])); fi
  done
  if [ "$total" -le 0 ] || [ "$left" -le 0 ]; then
    echo 0
  else
    echo $((left * SHARE[$1] / total))
  fi
}

declare -A RC
# run_section NAME SECONDS CMD...: runs CMD under `timeout SECONDS`, prints the wall time, records the status
run_section() {
  local name=$1 secs=$2 t0=$SECONDS rc
  shift 2
  echo
  echo "== $name (at most $secs s, $((SECONDS - START)) s into the run)"
  if [ "$secs" -lt 20 ]; then
    echo "-- $name: skipped, only $secs s left (FLATOPT_RUN_BUDGET_S=$BUDGET)"
    RC[$name]=skipped
    return
  fi
  timeout --kill-after=5 "$secs" "$@"
  rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "$name: stopped after $secs s"; fi
  echo "-- $name: $((SECONDS - t0)) s, exit status $rc"
  RC[$name]=$rc
}

for s in $SECTIONS; do
  secs=$(share "$s")
  inner=$((secs - 15))
  case $s in
  tests)
    if [ "$DRY" = 1 ]; then
      run_section tests "$secs" env TRITON_INTERPRET=1 $PY -m pytest -q -rfEs tests/test_benchmarks.py \
        --junitxml="$DEST/junit-$STAMP.xml"
    else
      run_section tests "$secs" $PY -m pytest -q -rfEs --durations=25 tests/ --junitxml="$DEST/junit-$STAMP.xml"
    fi
    ;;
  step | loop)
    QUICK=()
    if [ "$secs" -lt 240 ] || [ "$s" = loop ] || [ "$DRY" = 1 ]; then QUICK=(--quick); fi
    if [ "$DRY" = 1 ]; then QUICK+=(--no-compile); fi
    if [ "$s" = step ]; then
      WHAT=(--variants step --groups 1)
      JSON="$DEST/step-$STAMP.json"
    else
      WHAT=(--variants loop --groups 1,2)
      JSON="$DEST/step-loop-$STAMP.json"
    fi
    run_section "$s" "$secs" $PY benchmarks/bench_step.py "${WHAT[@]}" --json "$JSON" --markdown "$WORK/$s.md" \
      --budget-s "$inner" ${BENCH_DEV[@]+"${BENCH_DEV[@]}"} ${QUICK[@]+"${QUICK[@]}"} "$@"
    ;;
  eager)
    prof=$((secs / 5 < 40 ? secs / 5 : 40)) # the landing profile's part of the share
    run_section eager "$((secs - prof))" $PY benchmarks/bench_eager.py --json "$DEST/eager-$STAMP.json" \
      --markdown "$WORK/eager.md" --budget-s "$((inner - prof))" ${BENCH_DEV[@]+"${BENCH_DEV[@]}"} \
      ${EAGER_MODELS[@]+"${EAGER_MODELS[@]}"}
    mkdir -p "$DEST/profiles"
    run_section landing-profile "$prof" $PY benchmarks/profile_landing.py \
      --json "$DEST/profiles/profile-landing-$STAMP.json" --markdown "$WORK/landing-profile.md" \
      ${BENCH_DEV[@]+"${BENCH_DEV[@]}"}
    ;;
  memory)
    run_section memory "$secs" $PY benchmarks/bench_memory.py --json "$DEST/memory-$STAMP.json" \
      --markdown "$WORK/memory.md" --budget-s "$inner" ${BENCH_DEV[@]+"${BENCH_DEV[@]}"}
    ;;
  fsdp)
    run_section fsdp "$secs" $PY benchmarks/bench_fsdp.py --json "$DEST/fsdp-$STAMP.json" \
      --markdown "$WORK/fsdp.md" --budget-s "$inner" ${BENCH_DEV[@]+"${BENCH_DEV[@]}"} ${FSDP_RANKS[@]+"${FSDP_RANKS[@]}"}
    ;;
  capture)
    run_section capture "$secs" $PY benchmarks/bench_capture.py --json "$DEST/capture-$STAMP.json" \
      --markdown "$WORK/capture.md" --budget-s "$inner" ${BENCH_DEV[@]+"${BENCH_DEV[@]}"}
    ;;
  convergence) # seeds that would not fit in --budget-s are skipped, and said so in the JSON
    run_section convergence "$secs" $PY benchmarks/convergence.py --json "$DEST/convergence-$STAMP.json" \
      --markdown "$WORK/convergence.md" --budget-s "$inner" ${BENCH_DEV[@]+"${BENCH_DEV[@]}"}
    ;;
  esac
done

echo
echo "== plot and summary"
t0=$SECONDS
plot_rc=0
SUMMARY="$DEST/summary-$STAMP.md"
{
  echo "# flatopt GPU run $STAMP"
  echo
  for s in $SECTIONS; do echo "- $s: exit status ${RC[$s]:-not run}"; done
  if [ -n "${RC[landing-profile]+x}" ]; then echo "- landing-profile: exit status ${RC[landing-profile]}"; fi
} >"$SUMMARY"
for json in "$DEST"/*-"$STAMP".json; do
  [ -f "$json" ] || continue
  timeout 60 $PY benchmarks/plot.py "$json" --png "${json%.json}.png" ${PLOT_SMOKE[@]+"${PLOT_SMOKE[@]}"} || plot_rc=$?
done
if [ "$plot_rc" != 0 ]; then RC[plot]=$plot_rc; fi
for part in step loop eager landing-profile memory fsdp capture convergence; do
  if [ -f "$WORK/$part.md" ]; then
    printf '\n## %s\n\n' "$part" >>"$SUMMARY"
    cat "$WORK/$part.md" >>"$SUMMARY"
  fi
done
rm -f "$DEST"/*-"$STAMP".json.tmp
echo "-- plot and summary: $((SECONDS - t0)) s"

status=0
summary=""
for k in "${!RC[@]}"; do
  summary+=" $k=${RC[$k]}"
  if [ "${RC[$k]}" != 0 ] && [ "${RC[$k]}" != skipped ]; then status=1; fi
done
echo "== done in $((SECONDS - START)) s:$summary; files in $DEST:"
find "$DEST" -maxdepth 2 -type f -name "*$STAMP*" | sed "s|^$DEST/||" | sort
n_files=$(find "$DEST" -maxdepth 2 -type f -name "*$STAMP*" | wc -l)
echo "($n_files files)"
if [ "$n_files" -gt 8 ]; then echo "run_gpu.sh: $n_files files; the GPU machine returns 8: run fewer sections per call"; fi
exit $status
