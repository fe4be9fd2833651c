"""`deepinfer golden --backend neuron --cp 2` end to end under the fake TorchNeuron (tests/fake_torchneuron.py): the
command runs as it would on a trn2, in its own processes, with the fake loaded in each of them (the parent and the
two spawned ranks) the way torch loads torch_neuronx - a `torch.backends` entry point (tests/fake_sdk/), read when
`import torch` runs, before any engine code. The ranks' device `neuron:<i>` holds CPU tensors; the "neuron" process
group checks the SDK's rules and then runs on gloo; graphs go through the fake `torch.compile` backend; NKI kernels
launch through the fake `wrap_nki` and compute on the NumPy stand-in. Each process appends what the SDK saw to a
record the test reads. What this proves is the rank setup, compile and launch calls of the engine against the SDK's
rules, not anything of neuronx-cc or a trn2.

Slow (a cp 2 golden of the tiny model with every graph traced by Dynamo: minutes on 2 cores): `pytest -m slow
tests/test_torchneuron_ranks.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.fake_torchneuron import FAKE_VAR, RECORD_VAR

ROOT = Path(__file__).resolve().parents[1]


def _records(folder: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["pid"]].append(row)
    return dict(out)


@pytest.mark.slow
def test_golden_cp2_under_the_fake_sdk_end_to_end(tmp_path: Path) -> None:
    record, out = tmp_path / "record", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")
           and not k.startswith(("NEURON_", "TORCH_NEURONX_", "LOCAL_", "DEEPINFER_"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "fake_sdk")]), FAKE_VAR: "1",
                RECORD_VAR: str(record), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                # every graph traced and every op dispatched in Python: far slower than a real job (the launcher's
                # job timeout is 4 x this)
                "DEEPINFER_DIST_TIMEOUT_S": "1200"})
    r = subprocess.run([sys.executable, "-m", "deepinfer_bench.cli", "golden", "--backend", "neuron", "--cp", "2",
                        "--kernels", "nki", "--out", str(out)], env=env, capture_output=True, text=True, timeout=5400,
                       cwd=tmp_path)
    said = r.stdout + r.stderr
    assert r.returncode == 0, said[-4000:]
    assert "12/12 prompts match" in said and "on a Neuron device" in said

    procs = _records(record)
    ranks = {rows[0]["LOCAL_RANK"]: rows for rows in procs.values() if rows[0]["event"] == "init_process_group"}
    assert sorted(ranks) == ["0", "1"]
    assert all(rows[0]["event"] == "init_process_group" for rows in procs.values())  # the parent touched nothing
    for rank, rows in ranks.items():
        i = int(rank)
        kinds = [row["event"] for row in rows]
        group = rows[0]["group"]
        # the group first (nothing touched the device before it), one visible core: the local rank's
        assert (group["backend"], group["local_rank"], group["cores"], group["world_size"]) == ("neuron", i, rank, 2)
        assert {row["NEURON_RT_VISIBLE_CORES"] for row in rows} == {rank}
        # then torch.neuron.set_device(local_rank), once, before the first tensor on the device: neuron:<local rank>
        assert kinds.count("set_device") == 1 and rows[kinds.index("set_device")]["index"] == i
        assert kinds.index("set_device") < kinds.index("first_alloc") and rows[kinds.index("first_alloc")]["index"] == i
        compiles = [row for row in rows if row["event"] == "compile"]
        assert compiles and all(row["devices"] == [f"neuron:{i}"] for row in compiles)
        names = Counter(row["name"] for row in compiles)
        assert "model_default" not in names and any(n.startswith("region_") for n in names)  # every graph named
        assert {"embed", "head"} <= set(names)
        # one wrap_nki per kernel (the SDK re-traces on each call), launched as [(lnc,)] at LNC 1
        traced = Counter(row["kernel"] for row in rows if row["event"] == "wrap_nki")
        assert traced and set(traced.values()) == {1}
        launches = [row for row in rows if row["event"] == "launch"]
        assert launches and {tuple(row["grid"]) for row in launches} == {(1,)}
