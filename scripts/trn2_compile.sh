#!/usr/bin/env bash
# Compile every decode graph written by `deepinfer compile --backend xla --out DIR` with neuronx-cc for trn2, and
# record per graph: pass/fail, seconds, the NCC error code (NCC_XXXNNN) if any, into DIR/neuronx_cc.csv.
# Prepared for a trn2 host with the Neuron SDK (neuronx-cc on PATH); NOT run by this project yet.
#   scripts/trn2_compile.sh DIR [extra neuronx-cc flags...]     (LNC from NEURON_LOGICAL_NC_CONFIG, default 2)
# Example extra flags (see `neuronx-cc compile --help`): --model-type transformer -O1 --auto-cast none
set -uo pipefail
dir=${1:?usage: scripts/trn2_compile.sh DIR [neuronx-cc flags...]}
shift
command -v neuronx-cc >/dev/null || { echo "neuronx-cc not found: activate the Neuron SDK environment" >&2; exit 2; }
ls "$dir"/*.hlo.pb >/dev/null 2>&1 || { echo "no *.hlo.pb in $dir (run deepinfer compile first)" >&2; exit 2; }
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
