#!/usr/bin/env bash
# First hour on a trn2 machine: compile every NKI kernel with the real `nki`, run it on the official simulator
# and on the device, and diff stand-in vs simulator vs device per element (one report).
#   scripts/trn2_check.sh [OUT_DIR] [--kernel NAME] [--slow] [--no-device]
# Needs the Neuron SDK (nki >= 0.3 from the AWS Neuron pip repository) in the active Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/trn2-check-$(date +%Y%m%d-%H%M%S)}
shift || true
export NEURON_PLATFORM_TARGET_OVERRIDE=trn2   # the simulator defaults to trn3 without a chip
# LNC 1 unless set: the kernels do not split work by program id (engine/backends/torchneuron.py FIRST_CONTACT_LNC)
export NEURON_LOGICAL_NC_CONFIG=${NEURON_LOGICAL_NC_CONFIG:-1}
export NKI_PRECISE_FP=${NKI_PRECISE_FP:-1}    # ml_dtypes low precision in the simulator, like the stand-in
python3 -c "import nki; assert hasattr(nki, 'jit'), 'PyPI placeholder nki installed, not the Neuron SDK'"
ls /dev/neuron* >/dev/null 2>&1 || echo "no /dev/neuron*: simulator only" >&2
exec python3 -m nki_kernels.trn2_check --out "$OUT" --lnc "$NEURON_LOGICAL_NC_CONFIG" "$@"
