#!/usr/bin/env bash
# The host kernels on an emulated x86 CPU (QEMU user mode, TCG), by default one without AVX-512: which build the
# loader takes there, the host-kernel tests, and `deepinfer golden` on the default path (--kernels auto), all run as
# on that CPU. TCG executes no AVX-512 instruction at all, so a build that held one would die with SIGILL here.
# Times under emulation mean nothing; the loader's choice and the results do.
#
#   apt-get install qemu-user                 # Debian / Ubuntu: qemu-x86_64
#   scripts/emulated_cpu_check.sh [CPU]       # CPU: a `qemu-x86_64 -cpu help` model; default EPYC-Milan (AMD
#                                             # Zen 3: AVX2 + FMA, no AVX-512); ~5 minutes on 2 cores
#
# qemu-user emulates cpuid but shows the host's own /proc/cpuinfo, and gcc (a child process) runs natively: on an
# AVX-512 host the loader's first two checks (engine/host_kernels/build.py) see AVX-512, the library's own cpuid
# check does not, and `load("auto")` steps down to the best build that check accepts. That is what step 1 shows.
# The tests work out what this machine runs from /proc/cpuinfo too, so step 2 caps them at the build step 1 chose.
set -euo pipefail
cd "$(dirname "$0")/.."
cpu=${1:-EPYC-Milan}
py=$("${PYTHON:-python}" -c "import sys; print(sys.executable)")  # the interpreter itself, not a shim script
command -v qemu-x86_64 >/dev/null || { echo "qemu-x86_64 not found: apt-get install qemu-user" >&2; exit 2; }
export QEMU_CPU=$cpu
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
emu() {  # python under the emulator; its stderr without QEMU's notes on the model's features TCG lacks
    local rc=0
    qemu-x86_64 "$py" "$@" 2>"$out/stderr" || rc=$?
    grep -v "TCG doesn't support" "$out/stderr" >&2 || true
    return $rc
}

echo "== 1/3 which build the loader takes on $cpu"
emu -c "from engine import host_kernels as H; H.ensure_loaded(); print(H.summary())" | tee "$out/summary"
build=$(sed -n 's/^host kernels: \([a-z0-9-]*\) .*/\1/p' "$out/summary")
[ -n "$build" ] || { echo "no build chosen" >&2; exit 1; }

echo "== 2/3 host-kernel tests on $cpu (DEEPINFER_HOST_SIMD=$build)"
# EMULATED_TESTS: the test files to run there (none: only steps 1 and 3), EMULATED_K: a pytest -k expression
tests=${EMULATED_TESTS:-tests/test_host_kernels.py tests/test_host_moe.py tests/test_host_attn_ops.py \
    tests/test_host_sites.py tests/test_portable.py}
if [ "$tests" = none ]; then
    echo "(none: EMULATED_TESTS=none)"
else
    # shellcheck disable=SC2086  # a list of paths
    DEEPINFER_HOST_SIMD=$build emu -m pytest -q -p no:cacheprovider ${EMULATED_K:+-k "$EMULATED_K"} $tests
fi

echo "== 3/3 deepinfer golden on $cpu (default: --kernels auto)"
emu -m deepinfer_bench.cli golden --out "$out/golden"
# the build the golden ran (its results' stack.host_kernels.loaded) must be step 1's
"$py" -c "import json, glob, sys; m = json.load(open(glob.glob(sys.argv[1] + '/golden-*/meta.json')[0])); \
ran = m['stack']['host_kernels']['loaded']['variant']; print('kernels:', m['engine_config']['kernels'], '- ran the', \
ran, 'build'); sys.exit(0 if ran == sys.argv[2] else f'the golden ran the {ran} build, step 1 chose {sys.argv[2]}')" \
    "$out/golden" "$build"
