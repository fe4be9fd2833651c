#!/usr/bin/env bash
# Compile every graph of the engine with neuronx-cc for trn2 and record per graph: pass/fail, seconds and the NCC
# error code (NCC_XXXNNN), in DIR/neuronx_cc.csv. Prepared for a host with the Neuron SDK; NOT run by this project.
#
#   scripts/trn2_compile.sh DIR [deepinfer compile options...]
#       TorchNeuron (Neuron SDK 2.33+, the current stack): `deepinfer compile --backend neuron --out DIR` in
#       TorchNeuron's compile-only mode (TORCH_NEURONX_COMPILE_ONLY=1, NEURON_PLATFORM_TARGET_OVERRIDE=trn2: the whole
#       torch-mlir -> StableHLO -> neuronx-cc lowering, nothing executed, no device needed); the CSV comes from
#       DIR/manifest.json. Example options: --model-dir /models/V4-Flash --max-num-seqs 8.
#   scripts/trn2_compile.sh --hlo DIR [neuronx-cc flags...]
#       The legacy PyTorch/XLA lane: each DIR/*.hlo.pb written by `deepinfer compile --backend xla --out DIR` through
#       `neuronx-cc compile --framework XLA --target trn2 --lnc $NEURON_LOGICAL_NC_CONFIG` (default LNC 2).
#       Example flags (see `neuronx-cc compile --help`): --model-type transformer -O1 --auto-cast none
set -uo pipefail
if [ "${1:-}" != "--hlo" ]; then
  dir=${1:?usage: scripts/trn2_compile.sh DIR [deepinfer compile options] | --hlo DIR [neuronx-cc flags]}
  shift
  deepinfer=${DEEPINFER:-deepinfer}
  command -v "$deepinfer" >/dev/null || { echo "$deepinfer not found: install deepinfer in the Neuron SDK's TorchNeuron environment" >&2; exit 2; }
  export TORCH_NEURONX_COMPILE_ONLY=1 NEURON_PLATFORM_TARGET_OVERRIDE=${NEURON_PLATFORM_TARGET_OVERRIDE:-trn2}
  "$deepinfer" compile --backend neuron --out "$dir" "$@"
  rc=$?
  [ -f "$dir/manifest.json" ] || { echo "no $dir/manifest.json (deepinfer compile exit $rc)" >&2; exit 2; }
  python3 - "$dir" <<'PY'
import csv, json, sys
from pathlib import Path
d = Path(sys.argv[1])
rows = json.loads((d / "manifest.json").read_text())["graphs"]
with (d / "neuronx_cc.csv").open("w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["graph", "status", "seconds", "ncc_error", "error"])
    for r in rows:
        w.writerow([r["graph"], r["status"], r.get("seconds", ""), r.get("ncc_error") or "", r.get("error") or ""])
failed = sum(r["status"] != "pass" for r in rows)
print(f"wrote {d / 'neuronx_cc.csv'} ({len(rows)} graphs, {failed} failed)")
PY
  exit $rc
fi
shift
dir=${1:?usage: scripts/trn2_compile.sh --hlo DIR [neuronx-cc flags...]}
shift
command -v neuronx-cc >/dev/null || { echo "neuronx-cc not found: activate the Neuron SDK environment" >&2; exit 2; }
ls "$dir"/*.hlo.pb >/dev/null 2>&1 || { echo "no *.hlo.pb in $dir (run deepinfer compile --backend xla first)" >&2; exit 2; }
lnc=${NEURON_LOGICAL_NC_CONFIG:-2}
out="$dir/neff"
mkdir -p "$out"
csv="$dir/neuronx_cc.csv"
echo "graph,status,seconds,ncc_error,log" > "$csv"
fail=0
for pb in "$dir"/*.hlo.pb; do
  name=$(basename "$pb" .hlo.pb)
  log="$out/$name.log"
  t0=$(date +%s.%N)
  if neuronx-cc compile "$pb" --framework XLA --target trn2 --lnc "$lnc" --output "$out/$name.neff" "$@" >"$log" 2>&1; then
    status=pass; code=""
  else
    status=fail; fail=$((fail + 1))
    code=$(grep -oE 'NCC_[A-Z]+[0-9]+' "$log" | head -n 1)
  fi
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.3f", b - a }')
  echo "$name,$status,$secs,$code,$log" >> "$csv"
  echo "$name: $status (${secs}s) $code"
done
echo "wrote $csv ($fail failed)"
[ "$fail" -eq 0 ]
