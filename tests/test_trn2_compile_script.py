"""scripts/trn2_compile.sh (the first thing a trn2 owner runs) against a fake `neuronx-cc` on PATH: one neuronx-cc
call per HLO proto with the documented flags and the process's LNC, and a CSV row per graph with pass/fail, seconds
and the NCC error code. The real neuronx-cc is not installable here."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trn2_compile.sh"

FAKE_NCC = """#!/usr/bin/env bash
echo "neuronx-cc $*" >> "$(dirname "$0")/calls.log"
case "$2" in *head*) echo "ERROR 1234 [NCC_EOCP001] unsupported element type f8e4m3fn"; exit 1;; esac
while [ $# -gt 0 ]; do [ "$1" = "--output" ] && touch "$2"; shift; done
"""


def test_trn2_compile_csv_with_a_fake_neuronx_cc(tmp_path: Path) -> None:
    bin_dir, hlo = tmp_path / "bin", tmp_path / "hlo"
    bin_dir.mkdir()
    hlo.mkdir()
    ncc = bin_dir / "neuronx-cc"
    ncc.write_text(FAKE_NCC)
    ncc.chmod(0o755)
    for name in ("embed_b1", "head_b1"):
        (hlo / f"{name}.hlo.pb").write_bytes(b"\x00")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NEURON_LOGICAL_NC_CONFIG": "1"}
    res = subprocess.run(["bash", str(SCRIPT), "--hlo", str(hlo), "--auto-cast", "none"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr  # one graph failed
    rows = {r["graph"]: r for r in csv.DictReader((hlo / "neuronx_cc.csv").open())}
    assert rows["embed_b1"]["status"] == "pass" and rows["embed_b1"]["ncc_error"] == ""
    assert rows["head_b1"]["status"] == "fail" and rows["head_b1"]["ncc_error"] == "NCC_EOCP001"
    assert all(float(r["seconds"]) >= 0 for r in rows.values())
    assert (hlo / "neff" / "embed_b1.neff").exists()
    calls = (bin_dir / "calls.log").read_text().splitlines()
    assert calls[0] == (f"neuronx-cc compile {hlo}/embed_b1.hlo.pb --framework XLA --target trn2 --lnc 1 "
                        f"--output {hlo}/neff/embed_b1.neff --auto-cast none")
    # no neuronx-cc on PATH: a clear message, exit 2
    res = subprocess.run(["bash", str(SCRIPT), "--hlo", str(hlo)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2 and "neuronx-cc not found" in res.stderr


FAKE_DEEPINFER = """#!/usr/bin/env bash
log="$(dirname "$0")/calls.log"
echo "$* compile_only=$TORCH_NEURONX_COMPILE_ONLY target=$NEURON_PLATFORM_TARGET_OVERRIDE" >> "$log"
out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/')
mkdir -p "$out"
cat > "$out/manifest.json" <<'JSON'
{"graphs": [{"graph": "layer_0_hash_b1_nb1", "status": "pass", "seconds": 41.5, "ncc_error": null, "error": null},
            {"graph": "head_b1", "status": "fail", "seconds": 3.25, "ncc_error": "NCC_EVRF051",
             "error": "RuntimeError: f8 operand"}]}
JSON
exit 1
"""


def test_trn2_compile_torchneuron_runs_deepinfer_compile_only(tmp_path: Path) -> None:
    """The TorchNeuron path: `deepinfer compile --backend neuron` with the compile-only variables, CSV from the
    manifest, deepinfer's exit status passed on."""
    bin_dir, out = tmp_path / "bin", tmp_path / "graphs"
    bin_dir.mkdir()
    fake = bin_dir / "deepinfer"
    fake.write_text(FAKE_DEEPINFER)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
    res = subprocess.run(["bash", str(SCRIPT), str(out), "--max-num-seqs", "8"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert (bin_dir / "calls.log").read_text().strip() == (
        f"compile --backend neuron --out {out} --max-num-seqs 8 compile_only=1 target=trn2")
    rows = {r["graph"]: r for r in csv.DictReader((out / "neuronx_cc.csv").open())}
    assert rows["layer_0_hash_b1_nb1"]["status"] == "pass" and rows["layer_0_hash_b1_nb1"]["ncc_error"] == ""
    assert (rows["head_b1"]["status"], rows["head_b1"]["ncc_error"], rows["head_b1"]["seconds"]) == (
        "fail", "NCC_EVRF051", "3.25")
    assert "2 graphs, 1 failed" in res.stdout
