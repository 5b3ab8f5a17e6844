#!/usr/bin/env bash
# Everything the project checks on a GPU, in one command that fits one device call (9 minutes):
#
#   wheels   install the wheels the GPU machine lacks (diffusers, torchao, ...) from $GPU_WHEELS
#            (default build/gpu-wheels, made by `make gpu-wheels` on a networked machine) with
#            pip --no-index into a --target folder put on PYTHONPATH; without wheels, check the imports
#   tests    the CUDA tests: pytest -m gpu
#   kernels  bench/kernels.py --device cuda --quick --no-compile
#   e2e      bench/e2e.py --device cuda --quick, FLUX.1-dev size, eager and our device-kernel rows
#   families bench/families_device.py --device cuda: every zoo family's tiny build optimized (W8A8
#            dynamic, bf16, quality against float) and its package generating on the GPU's kernels
#   load     bench/scale_load.py --device cuda --full: the full FLUX.1-dev W8A8 package loaded to the
#            GPU, cold and warm (compile cache) start to the first 1024x1024 step, host and device peaks
#   scale    bench/scale.py --device cuda --full: optimize's peak memory against its bound
#
# Each part runs under its own `timeout` and the time left of GPU_PASS_TOTAL_S (540 s); a part that
# fails does not stop the later ones. Logs and JSON go to one folder: $OUT if set (the device
# machine's returned folder), else build/gpu-pass/<timestamp>; the result JSON is also copied to
# bench/results/ (named by the device: kernels_h100_quick.json, ...). summary.json and summary.txt
# list each part's exit code and seconds; the script exits 0 only when every part passed.
#
#   tools/gpu_pass.sh [--dry-run] [--parts wheels,tests,kernels,e2e,load,scale]
#
# --dry-run (or GPU_PASS_DRY_RUN=1) runs every part on CPU in its smallest form (the wheels' imports,
# test collection only, one small op, the small e2e model, scale.py --dry-run --full) into a
# temporary folder and copies nothing to bench/results/: the plumbing, tested without a GPU.
# Settings: GPU_PASS_PARTS, GPU_PASS_TOTAL_S, GPU_PASS_BUDGET_<PART> (seconds), GPU_PASS_<PART>_ARGS
# (extra arguments: TESTS, KERNELS, E2E, FAMILIES, LOAD, SCALE), GPU_PASS_TESTS (test paths, default tests),
# GPU_WHEELS, PYTHON.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DRY=${GPU_PASS_DRY_RUN:-0}
PARTS=${GPU_PASS_PARTS:-wheels,tests,kernels,e2e,families,load,scale}
while [ $# -gt 0 ]; do
	case $1 in
	--dry-run) DRY=1 ;;
	--parts) PARTS=$2 && shift ;;
	--parts=*) PARTS=${1#--parts=} ;;
	*) echo "gpu_pass: unknown argument $1 (use --dry-run, --parts a,b)" >&2 && exit 2 ;;
	esac
	shift
done

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
WHEELS=${GPU_WHEELS:-build/gpu-wheels}
TESTS=${GPU_PASS_TESTS:-tests}
SITE=${GPU_PASS_SITE:-${TMPDIR:-/tmp}/sdkiln-gpu-pass-site}
if [ "$DRY" = 1 ]; then
	PASS_DIR=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-pass-dry.XXXXXX")}
	RESULTS=$PASS_DIR/results
	export OMP_NUM_THREADS=1
	TOTAL=${GPU_PASS_TOTAL_S:-300}
else
	PASS_DIR=${OUT:-build/gpu-pass/$(date +%Y%m%d-%H%M%S)}
	RESULTS=bench/results
	TOTAL=${GPU_PASS_TOTAL_S:-540}
fi
mkdir -p "$PASS_DIR" "$RESULTS"
PASS_DIR=$(cd "$PASS_DIR" && pwd)
LOG=$PASS_DIR/pass.log
ROWS=$(mktemp "${TMPDIR:-/tmp}/gpu-pass-parts.XXXXXX")
trap 'rm -f "$ROWS"' EXIT
# the dry run installs nothing, so it leaves out the folder an earlier real pass may have filled
if [ "$DRY" = 1 ]; then export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
else export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0
START=$(date +%s)

say() { echo "gpu_pass: $*" | tee -a "$LOG"; }

# budget NAME DEFAULT: the part's seconds, cut to what is left of the total
budget() {
	local var="GPU_PASS_BUDGET_$(echo "$1" | tr a-z A-Z)" left
	left=$((TOTAL - ($(date +%s) - START)))
	local b=${!var:-$2}
	[ "$b" -gt "$left" ] && b=$left
	echo "$b"
}

# part NAME BUDGET CMD...: run CMD under timeout, its output into the log, and record the outcome
part() {
	local name=$1 secs=$2 t0 rc status
	shift 2
	if ! [[ ",$PARTS," == *",$name,"* ]]; then return 0; fi
	if [ "$secs" -le 5 ]; then
		say "== $name: not run, the total budget of ${TOTAL} s is spent"
		printf '%s\t%s\t%s\t%s\t%s\n' "$name" 124 0 "$secs" "not run (budget)" >>"$ROWS"
		return 0
	fi
	say "== $name (budget ${secs} s): $*"
	t0=$(date +%s%N)
	timeout --kill-after=15 "$secs" "$@" 2>&1 | tee -a "$LOG"
	rc=${PIPESTATUS[0]}
	case $rc in
	0) status=passed ;;
	124 | 137) status="timed out" ;;
	*) status=failed ;;
	esac
	local ms=$((($(date +%s%N) - t0) / 1000000))
	local secs_run=$((ms / 1000)).$(printf '%03d' $((ms % 1000)))
	printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs_run" "$secs" "$status" >>"$ROWS"
	say "== $name: $status (exit $rc, $secs_run s)"
}

# wheels: a function run under timeout through `bash -c` (timeout runs commands, not functions)
wheels() {
	shopt -s nullglob
	local files=("$WHEELS"/*.whl)
	if [ ${#files[@]} -eq 0 ]; then
		echo "no wheels in $WHEELS: checking that this python already has what the project needs"
	elif [ "$DRY" = 1 ]; then
		echo "dry run: would install ${#files[@]} wheels from $WHEELS into $SITE:"
		printf '  %s\n' "${files[@]##*/}"
	else
		"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${files[@]}" || return
	fi
	"$PY" - <<-'EOF'
		import importlib, sys
		from importlib import metadata
		missing = []
		for name in ("torch", "diffusers", "transformers", "safetensors", "accelerate", "torchao", "triton"):
		    try:
		        importlib.import_module(name)
		        print(f"{name} {metadata.version(name)}")
		    except Exception as exc:
		        missing.append(f"{name} ({type(exc).__name__}: {exc})")
		if missing:
		    sys.exit("cannot import: " + "; ".join(missing))
	EOF
}

export -f wheels
export PY WHEELS SITE DRY
if [ "$DRY" = 1 ]; then DEVICE=cpu; else DEVICE=cuda; fi
KIND=$("$PY" -c "
import sys, torch
sys.path.insert(0, 'bench')
from timing import device_kind
print(device_kind(torch.device('$DEVICE')) if '$DEVICE' == 'cpu' or torch.cuda.is_available() else '')
" 2>>"$LOG")
if [ -z "$KIND" ]; then
	say "cannot name the device: no CUDA device here (tools/gpu_pass.sh --dry-run rehearses on CPU), or torch failed (see $LOG)"
	exit 2
fi
say "device $KIND, python $PY, output $PASS_DIR, parts $PARTS, total budget ${TOTAL} s$([ "$DRY" = 1 ] && echo ', DRY RUN')"

if [ "$DRY" = 1 ]; then
	part wheels "$(budget wheels 60)" bash -c wheels
	part tests "$(budget tests 120)" "$PY" -m pytest -q -p no:cacheprovider -p no:xdist -m gpu --collect-only $TESTS ${GPU_PASS_TESTS_ARGS:-}
	part kernels "$(budget kernels 60)" "$PY" bench/kernels.py --device cpu --quick --no-compile --ops rms_norm \
		--out "$PASS_DIR/kernels_${KIND}_quick.json" ${GPU_PASS_KERNELS_ARGS:-}
	part e2e "$(budget e2e 60)" "$PY" bench/e2e.py --device cpu --quick --model flux --rows eager,ours-w8a8-ref \
		--out "$PASS_DIR/e2e_${KIND}_quick.json" ${GPU_PASS_E2E_ARGS:-}
	part families "$(budget families 120)" "$PY" bench/families_device.py --device cpu --dtype float32 --families flux-kontext-tiny \
		--out "$PASS_DIR/families_${KIND}.json" ${GPU_PASS_FAMILIES_ARGS:-}
	part load "$(budget load 60)" "$PY" bench/scale_load.py --device cuda --full --dry-run ${GPU_PASS_LOAD_ARGS:-}
	part scale "$(budget scale 60)" "$PY" bench/scale.py --dry-run --full --out "$PASS_DIR/scale_${KIND}.json" \
		${GPU_PASS_SCALE_ARGS:-}
else
	part wheels "$(budget wheels 45)" bash -c wheels
	part tests "$(budget tests 120)" "$PY" -m pytest -q -p no:cacheprovider -m gpu $TESTS ${GPU_PASS_TESTS_ARGS:-}
	part kernels "$(budget kernels 75)" "$PY" bench/kernels.py --device cuda --quick --no-compile \
		--out "$PASS_DIR/kernels_${KIND}_quick.json" ${GPU_PASS_KERNELS_ARGS:-}
	part e2e "$(budget e2e 90)" "$PY" bench/e2e.py --device cuda --quick --model flux \
		--rows eager,ours-w8a8-eager,ours-fp8-eager --out "$PASS_DIR/e2e_${KIND}_quick.json" ${GPU_PASS_E2E_ARGS:-}
	part families "$(budget families 120)" "$PY" bench/families_device.py --device cuda \
		--out "$PASS_DIR/families_${KIND}.json" ${GPU_PASS_FAMILIES_ARGS:-}
	# the load's JSON goes under "load" in scale_<kind>.json, which scale.py then keeps
	part load "$(budget load 270)" "$PY" bench/scale_load.py --device cuda --full \
		--out "$PASS_DIR/scale_${KIND}.json" ${GPU_PASS_LOAD_ARGS:-}
	# scale.py stops itself 20 s before its budget, so its JSON is written; timeout is the backstop
	SCALE_S=$(budget scale 540)
	part scale "$SCALE_S" "$PY" bench/scale.py --device cuda --full --budget-s $((SCALE_S > 40 ? SCALE_S - 20 : SCALE_S / 2)) \
		--out "$PASS_DIR/scale_${KIND}.json" ${GPU_PASS_SCALE_ARGS:-}
fi

shopt -s nullglob
for f in "$PASS_DIR"/kernels_*.json "$PASS_DIR"/e2e_*.json "$PASS_DIR"/families_*.json "$PASS_DIR"/scale_*.json; do
	cp "$f" "$RESULTS/" && say "copied ${f##*/} to $RESULTS/"
done

"$PY" - "$ROWS" "$PASS_DIR" "$KIND" "$DRY" "$TOTAL" <<'EOF'
import json, sys, time
from pathlib import Path

rows, out, kind, dry, total = sys.argv[1:]
parts = []
for line in Path(rows).read_text().splitlines():
    name, rc, secs, budget, status = line.split("\t")
    parts.append({"part": name, "exit_code": int(rc), "seconds": round(float(secs or 0), 1),
                  "budget_s": int(budget), "status": status})
summary = {
    "device_kind": kind,
    "dry_run": dry == "1",
    "total_budget_s": int(total),
    "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "parts": parts,
    "results": sorted(p.name for p in Path(out).glob("*.json") if p.name != "summary.json"),
    "passed": bool(parts) and all(p["status"] == "passed" for p in parts),
}
Path(out, "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
lines = [f"{'part':<8}  {'status':<16}  {'exit':>4}  {'seconds':>8}  {'budget':>6}"]
lines += [f"{p['part']:<8}  {p['status']:<16}  {p['exit_code']:>4}  {p['seconds']:>8.1f}  {p['budget_s']:>6}" for p in parts]
lines.append(f"{'PASSED' if summary['passed'] else 'FAILED'} ({kind}{', dry run' if summary['dry_run'] else ''})")
Path(out, "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if summary["passed"] else 1)
EOF
rc=$?
say "summary: $PASS_DIR/summary.txt"
exit $rc
