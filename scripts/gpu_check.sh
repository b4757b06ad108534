#!/usr/bin/env bash
# The whole GPU check in one device call: environment, gpu-marked tests, kernel benchmark, engine benchmarks.
#
#   OUT=/some/dir STAGE=all bash scripts/gpu_check.sh
#
# Environment (all optional):
#   STAGE      tests | bench | serve | all (default all: tests + bench; serve runs only when named)
#   SERVE      for STAGE=serve: semicolon list of `tandem bench --workload serve` argument strings, one
#              server run each (default: llama-3-8b 512 x 256 with 256 in flight + its --sync peer; gpt2
#              1000 x 256 all in flight with 6 API processes and 8 clients, the stream pass, Poisson 400 req/s and
#              the engine's step phases offline and in the server)
#   WORKLOADS  comma list for `tandem bench` (default bs1,seed-async,nano,prefix); each runs in its own process
#   SCALE      --scale for `tandem bench` (default 1.0); PEERS  --peers (default: the CLI's hf,sync,eager)
#   QUANTIZATION  --quantization for `tandem bench` (fp8; with PEERS=bf16 each workload reports fp8 / bf16)
#   KV_CACHE_DTYPE  --kv-cache-dtype for `tandem bench` (fp8: an FP8 KV cache; with PEERS=bf16 the ratio is against
#              bf16 weights and a bf16 cache)
#   QUANTIZE_LM_HEAD  1: --quantize-lm-head for `tandem bench` (with QUANTIZATION=fp8: the lm_head in FP8 too)
#   FP8_SWEEP  1: scripts/bench_fp8_linear.py also sweeps tiles and split-K (with QUANTIZATION=fp8)
#   KERNELS    0: skip scripts/bench_kernels.py (the decode-attention kernel table), bench_gemv.py (the decode GEMV
#              against cuBLAS / the FP8 tile GEMM at 1, 2, 4 rows) and bench_fp8_linear.py
#   MAX_FILES  files this run may leave under $OUT (default 8, the device tool's limit; lower it when several
#              runs share one $OUT): timeline PNGs beyond it go into timelines.tar
#   TP         --tensor-parallel-size for `tandem bench` (default 1); with TP=2 use e.g. PEERS=tp1,sync
#   BUDGET_S   wall seconds for the whole script (default 560, under the device's 600 s per command); every step
#              gets at most what is left minus RESERVE_S (default 25) and is stopped there, so the summary and
#              the files under $OUT always get written. Steps that find no time left are reported SKIPPED.
#   TESTS_S, KERNELS_S, BENCH_S  per-step caps in seconds (defaults 300, 90, 420)
#   TEST_PATHS  what the test step runs (default "tests/gpu tests/kernels"); TEST_K  a pytest -k expression.
#              With the real-weight tests (the SmolLM2 wheel installed, ~100 s each) the whole gpu suite no
#              longer fits one call: run it in parts, e.g. STAGE=tests TEST_PATHS=tests/kernels in one call and
#              STAGE=tests TEST_PATHS=tests/gpu TESTS_S=520 in the next
#
# $OUT receives at most 8 files, no subfolders: gpu-check.log (everything printed), gpu-tests.xml (JUnit),
# kernels.json, gemv.json, bench.json (the workloads merged, as `tandem bench --out` writes them), fp8-report.json (the
# SmolLM2 fp8 vs bf16 agreement from tests/gpu/test_fp8.py), fp8-linear.json (with QUANTIZATION=fp8:
# scripts/bench_fp8_linear.py) and timeline-<w>.png;
# when the PNGs would push the count past 8 they are packed into timelines.tar instead.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
OUT=${OUT:-$REPO/out/gpu-check}
STAGE=${STAGE:-all}
WORKLOADS=${WORKLOADS:-bs1,seed-async,nano,prefix}
SCALE=${SCALE:-1.0}
BUDGET_S=${BUDGET_S:-560}
RESERVE_S=${RESERVE_S:-25}
TESTS_S=${TESTS_S:-300}
KERNELS_S=${KERNELS_S:-90}
BENCH_S=${BENCH_S:-420}
MAX_FILES=${MAX_FILES:-8}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
SUMMARY=()
FAILED=0

case "$STAGE" in
  tests | bench | serve | all) ;;
  *) echo "STAGE must be tests, bench, serve or all, got '$STAGE'" >&2; exit 2 ;;
esac

# run_step NAME CAP_SECONDS CMD...: runs CMD under what is left of the budget; never stops the script.
run_step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET_S - SECONDS - RESERVE_S))
  if ((left < 20)); then
    SUMMARY+=("SKIPPED  $name (budget spent)")
    FAILED=1
    return
  fi
  local limit=$((cap < left ? cap : left))
  echo
  echo "=== $name (limit ${limit}s, t=${SECONDS}s): $*"
  local t0=$SECONDS rc
  # SIGINT first: pytest still writes its JUnit file and summary when interrupted.
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  rc=$?
  local took=$((SECONDS - t0)) status
  if ((rc == 0)); then
    status="ok      "
  elif ((rc == 124 || rc == 137)); then
    status="TIMEOUT "
    FAILED=1
  else
    status="FAILED  "
    FAILED=1
  fi
  SUMMARY+=("$status $name (rc=$rc, ${took}s)")
}

environment() {
  echo "=== environment ($(date -u '+%Y-%m-%d %H:%M:%S UTC'), repo $REPO, STAGE=$STAGE)"
  nvidia-smi -L || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,power.limit --format=csv,noheader || true
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      || echo "wheel install failed (continuing)"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  echo "PYTHONPATH=$PYTHONPATH"
  python3 - <<'EOF' || echo "version probe failed"
import platform, torch
print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
      f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, cc {p.major}.{p.minor}")
for name in ("triton", "transformers", "numpy", "safetensors", "matplotlib", "fastapi", "uvicorn", "pydantic"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:
        print(f"{name} missing ({type(exc).__name__})")
import tandem
print(f"tandem {tandem.__version__} from {tandem.__file__}")
EOF
}

tests_stage() {
  local paths=() select=()
  for p in ${TEST_PATHS:-tests/gpu tests/kernels}; do [ -e "$p" ] && paths+=("$p"); done
  [ -n "${TEST_K:-}" ] && select=(-k "$TEST_K")
  run_step "pytest -m gpu ${paths[*]} ${select[*]}" "$TESTS_S" \
    env TANDEM_FP8_REPORT="$OUT/fp8-report.json" python3 -m pytest -q -m gpu "${paths[@]}" "${select[@]}" \
    -p no:cacheprovider --durations=15 --junitxml="$OUT/gpu-tests.xml"
}

bench_stage() {
  if [ "${KERNELS:-1}" = 0 ]; then
    SUMMARY+=("SKIPPED  bench_kernels (KERNELS=0)")
  elif [ -f scripts/bench_kernels.py ]; then
    run_step "bench_kernels" "$KERNELS_S" python3 scripts/bench_kernels.py --out "$OUT/kernels.json"
  else
    SUMMARY+=("SKIPPED  bench_kernels (scripts/bench_kernels.py not found)")
  fi
  if [ "${KERNELS:-1}" != 0 ]; then
    run_step "bench_gemv" "$KERNELS_S" python3 scripts/bench_gemv.py --workers 1 --out "$OUT/gemv.json"
  fi
  if [ "${QUANTIZATION:-}" = fp8 ] && [ "${KERNELS:-1}" != 0 ]; then
    local sweep=()
    [ "${FP8_SWEEP:-0}" = 1 ] && sweep=(--sweep)
    run_step "bench_fp8_linear" "$KERNELS_S" python3 scripts/bench_fp8_linear.py "${sweep[@]}" --out "$OUT/fp8-linear.json"
  fi
  local peers=()
  [ -n "${PEERS:-}" ] && peers=(--peers "$PEERS")
  [ -n "${QUANTIZATION:-}" ] && peers+=(--quantization "$QUANTIZATION")
  [ -n "${KV_CACHE_DTYPE:-}" ] && peers+=(--kv-cache-dtype "$KV_CACHE_DTYPE")
  [ "${QUANTIZE_LM_HEAD:-0}" = 1 ] && peers+=(--quantize-lm-head)
  [ -n "${TP:-}" ] && peers+=(--tensor-parallel-size "$TP")
  local w
  for w in ${WORKLOADS//,/ }; do
    # One process per workload: a timeout or crash in one keeps the others' results.
    run_step "tandem bench $w" "$BENCH_S" python3 -m tandem.cli bench --workload "$w" --scale "$SCALE" \
      "${peers[@]}" --out "$WORK/bench-$w.json" --plot-dir "$WORK/plots"
  done
  WORKLOADS=$WORKLOADS WORK=$WORK OUT=$OUT python3 - <<'EOF' || echo "merging bench results failed"
import json, os
work, names = os.environ["WORK"], [n for n in os.environ["WORKLOADS"].split(",") if n]
results, missing, commands = [], [], []
for n in names:
    path = os.path.join(work, f"bench-{n}.json")
    if not os.path.exists(path):
        missing.append(n)
        continue
    with open(path) as f:
        data = json.load(f)
    results += data["results"]
    commands.append(data.get("command", ""))
if results or missing:
    with open(os.path.join(os.environ["OUT"], "bench.json"), "w") as f:
        json.dump({"commands": commands, "missing_workloads": missing, "results": results}, f, indent=2)
print(f"bench.json: {len(results)} workload(s)" + (f", missing {missing}" if missing else ""))
EOF
}

SERVE=${SERVE:-"--serve-model llama-3-8b --serve-requests 512 --serve-max-num-seqs 256 --api-server-count 1 --num-clients 4 --serve-sync;--serve-model gpt2 --serve-requests 1000 --api-server-count 6 --num-clients 8 --serve-stream --serve-poisson-rate 400 --serve-timeline"}

serve_stage() {
  local i=0 spec
  IFS=';' read -ra specs <<<"$SERVE"
  for spec in "${specs[@]}"; do
    # shellcheck disable=SC2086
    run_step "tandem bench --workload serve $spec" "$BENCH_S" python3 -m tandem.cli bench --workload serve \
      $spec --out "$WORK/serve-$i.json"
    i=$((i + 1))
  done
  WORK=$WORK OUT=$OUT python3 - <<'EOF' || echo "merging serve results failed"
import glob, json, os
results = []
for path in sorted(glob.glob(os.path.join(os.environ["WORK"], "serve-*.json"))):
    with open(path) as f:
        data = json.load(f)
    for r in data["results"]:
        r["command"] = data.get("command", "")
        results.append(r)
with open(os.path.join(os.environ["OUT"], "serve.json"), "w") as f:
    json.dump({"results": results}, f, indent=2)
for r in results:
    line = f"  serve {r['model']}: offline {r['offline_tokens_per_s']:.0f} tok/s, server/offline {r['server_over_offline']:.3f}"
    if "server_overlap_over_sync" in r:
        line += f", overlap/sync through the server {r['server_overlap_over_sync']:.3f}"
    print(line)
    run = r["server_overlap"]
    for name in ("saturation", "stream", "poisson"):
        if name in run:
            s = run[name]["summary"]
            pct = lambda k: {q: round(v * 1e3, 2) for q, v in s.get(k, {}).items() if q in ("p50", "p95", "p99")}
            print(f"    {name}: {s['output_tokens_per_s']:.0f} tok/s, {s['num_completed']}/{s['num_requests']} ok, "
                  f"ttft ms {pct('ttft_s')}, tpot ms {pct('tpot_s')}, itl ms {pct('itl_s')}")
            if run[name].get("step_phases"):
                print(f"      engine steps: " + ", ".join(f"{k} {v:.2f}" for k, v in run[name]["step_phases"].items()))
    print(f"    cpu %: {run.get('cpu_percent')}")
    for label, phases in (("offline", r.get("offline_step_phases")), ("server", run.get("step_phases"))):
        if phases:
            print(f"    step phases {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
EOF
}

collect_plots() {
  local pngs=() n_now
  if [ -d "$WORK/plots" ]; then
    mapfile -t pngs < <(find "$WORK/plots" -maxdepth 1 -name '*.png' | sort)
  fi
  ((${#pngs[@]})) || return 0
  n_now=$(find "$OUT" -type f | wc -l)
  if ((n_now + ${#pngs[@]} <= MAX_FILES)); then
    cp "${pngs[@]}" "$OUT"/
  elif ((n_now + 1 <= MAX_FILES)); then
    tar -cf "$OUT/timelines.tar" -C "$WORK/plots" "${pngs[@]##*/}"
    echo "packed ${#pngs[@]} timeline PNGs into timelines.tar (file limit $MAX_FILES)"
  else
    echo "no room for timeline PNGs under $OUT (file limit $MAX_FILES)"
  fi
}

summary() {
  echo
  echo "=== summary (t=${SECONDS}s of ${BUDGET_S}s budget)"
  local line
  for line in "${SUMMARY[@]}"; do echo "  $line"; done
  OUT=$OUT python3 - <<'EOF' || true
import json, os
import xml.etree.ElementTree as ET
out = os.environ["OUT"]
junit = os.path.join(out, "gpu-tests.xml")
if os.path.exists(junit):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    print("  tests: " + ", ".join(f"{v} {k}" for k, v in count.items()))
    for case in root.iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error")]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if bad:
            message = (bad[0].get("message") or "").splitlines()[0][:200] if bad[0].get("message") else ""
            print(f"    {bad[0].tag.upper()} {case.get('name')}: {message}")
        if props:
            print(f"    {case.get('name')}: {props}")
fp8 = os.path.join(out, "fp8-report.json")
if os.path.exists(fp8):
    with open(fp8) as f:
        print("  fp8 vs bf16 (SmolLM2): " + json.dumps(json.load(f)))
bench = os.path.join(out, "bench.json")
if os.path.exists(bench):
    with open(bench) as f:
        data = json.load(f)
    for r in data["results"]:
        busy = r.get("gpu_busy_pct")
        print(f"  {r['workload']:<11} {r['tokens_per_s']:>9.1f} tok/s  roofline {r['roofline_fraction']:.3f}  "
              f"gpu busy {busy if busy is None else round(busy, 1)}%  "
              + ", ".join(f"{k} x{v:.2f}" for k, v in r.get("ratios", {}).items()))
    if data.get("missing_workloads"):
        print(f"  bench missing: {data['missing_workloads']}")
EOF
  echo "  files under $OUT:"
  find "$OUT" -type f -printf '    %P (%s bytes)\n' | sort
}

main() {
  environment
  case "$STAGE" in
    tests) tests_stage ;;
    bench) bench_stage ;;
    serve) serve_stage ;;
    all) tests_stage; bench_stage ;;
  esac
  collect_plots
  summary
  rm -rf "$WORK"
  return "$FAILED"
}

main 2>&1 | tee "$OUT/gpu-check.log"
exit "${PIPESTATUS[0]}"
