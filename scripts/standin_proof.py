"""The engine's decode graphs through the TorchNeuron stand-in pipeline on the tiny model, against the eager host
engine and the HF golden (issue 21 item 4's proof, until `--backend neuron-standin` exists).

    .venv-standin/bin/python scripts/standin_proof.py [--graph-mode layer|regions] [--dump DIR] [--no-embed-head]

Runs every golden prompt greedily through (1) the eager host engine and (2) the same engine whose decode regions /
layer graphs (and embed + head, unless --no-embed-head) are compiled by `StandinPipeline` (Dynamo -> AOTAutograd ->
torch-mlir StableHLO -> XLA CPU) instead of the host's torch.compile; prefill chunks run eagerly on the host in both.
Prints the tokens / logits comparison and one row per compiled graph. Exit 1 on any token difference, a logit
difference over 1e-4, an eager fallback or a module with an f8 type / torch op.
Label: TorchNeuron pipeline on a CPU stand-in (torch-mlir + XLA CPU), not neuronx-cc, not trn2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOGIT_TOL = 1e-4  # fp32 graphs vs the eager host path: summation order only (XLA fuses and reorders reductions)


def _run(cfg, prompts):
    import engine
    from engine.llm import greedy_with_logits

    eng = engine.build(cfg)
    return greedy_with_logits(eng, [p.prompt_ids for p in prompts], [len(p.output_ids) for p in prompts])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph-mode", default="layer", choices=("layer", "regions"))
    ap.add_argument("--dump", default=None, help="write each graph's StableHLO text (.mlir) here")
    ap.add_argument("--no-embed-head", action="store_true", help="embed and head eager (as HostBackend does)")
    args = ap.parse_args()

    from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, load_golden
    from engine.backends.host import HostBackend
    from engine.backends.standin_pipeline import LABEL, StandinPipeline, module_problems

    cfg_eager = golden_config(graph_mode="eager")
    _, prompts = load_golden(GOLDEN_DIR, cfg_eager.model.config)
    t0 = time.perf_counter()
    ref_outs, ref_logits = _run(cfg_eager, prompts)
    t_eager = time.perf_counter() - t0

    pipe = StandinPipeline(dump_dir=args.dump)
    HostBackend.compile_region = lambda self, region: pipe.compile_region(region)  # the lead's protocol replaces this
    if not args.no_embed_head:
        HostBackend.compile_fn = lambda self, fn, name: pipe.compile_fn(fn, name)
    cfg = golden_config(graph_mode=args.graph_mode, host_compiler="aot_eager")  # aot_eager: raises dynamo's limits
    t0 = time.perf_counter()
    outs, logits = _run(cfg, prompts)
    t_standin = time.perf_counter() - t0

    ok = True
    print(f"{LABEL}\ntiny model, golden prompts, graph mode {args.graph_mode}, embed/head "
          f"{'eager' if args.no_embed_head else 'graphs'}")
    print(f"{'prompt':14s} {'tokens':>9s} {'max|dlogit| vs eager':>21s} {'vs HF golden':>13s}")
    worst = worst_hf = 0.0
    for p, o, lg, ro, rl in zip(prompts, outs, logits, ref_outs, ref_logits, strict=True):
        same = sum(a == b for a, b in zip(o, ro, strict=True))
        d = float((lg - rl).abs().max())
        n = len(p.output_ids)
        d_hf = float((lg[:n] - p.logits[:n]).abs().max())
        worst, worst_hf = max(worst, d), max(worst_hf, d_hf)
        ok &= o == ro and o[:n] == p.output_ids and d <= LOGIT_TOL
        print(f"{p.name:14s} {same:>4d}/{len(ro):<4d} {d:21.3e} {d_hf:13.3e}")
    s = pipe.stats
    print(f"max |dlogit| vs eager host {worst:.3e}, vs HF golden {worst_hf:.3e}; eager run {t_eager:.1f} s, "
          f"stand-in run {t_standin:.1f} s (of which compile {s.compile_s:.1f} s)")
    print(f"graphs compiled {s.graphs_compiled}, executions {s.executions}, eager fallbacks {s.fallbacks}")
    print(f"{'graph':24s} {'inputs':>6s} {'ops':>6s} {'mut':>4s} {'lower s':>8s} {'(mlir s)':>8s} {'xla s':>7s}  "
          "last input shapes")
    for r in s.graphs:
        shapes = " ".join("x".join(map(str, sh)) or "()" for sh, _ in r.inputs[-3:])
        print(f"{r.name:24s} {len(r.inputs):6d} {r.ops:6d} {r.mutated_inputs:4d} {r.lower_s:8.2f} {r.mlir_s:8.2f} "
              f"{r.xla_s:7.2f}  ...{shapes}{'  FELL BACK: ' + r.fallback if r.fallback else ''}")
        if r.mlir:
            problems = module_problems(Path(r.mlir).read_text())
            ok &= not problems
            for msg in problems:
                print(f"  {r.name}: {msg}")
    ok &= s.fallbacks == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
