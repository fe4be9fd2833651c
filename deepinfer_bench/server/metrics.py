"""GET /metrics as Prometheus text: the engine loop's gauges and step timing, the server's counters, and speculative
decoding under vLLM's own metric names (so its dashboards work unchanged)."""

from __future__ import annotations

from deepinfer_bench.server.engine_client import LoopStats
from deepinfer_bench.server.runs import Counters
from engine.profiling import quantiles


def prometheus_text(st: LoopStats, counters: Counters, alive: bool, served_model_name: str) -> str:
    """Every metric of one scrape, each with its HELP and TYPE lines."""
    es = st.engine
    lines: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP deepinfer:{name} {doc}", f"# TYPE deepinfer:{name} {kind}"])
        lines.extend(f"deepinfer:{name}{labels} {value:g}" for labels, value in samples)

    model = served_model_name.replace("\\", "\\\\").replace('"', '\\"')
    label = f'{{model_name="{model}"}}'
    metric("num_requests_running", "gauge", "Requests in the running batch.", [(label, es.num_running)])
    metric("num_requests_waiting", "gauge", "Requests waiting for KV blocks or a batch slot.",
           [(label, es.num_waiting)])
    metric("kv_cache_usage_perc", "gauge", "Fraction of the KV block pool in use (0-1).", [(label, es.kv_usage)])
    metric("kv_blocks_used", "gauge", "KV blocks in use.", [(label, es.num_used_blocks)])
    metric("kv_blocks_total", "gauge", "KV blocks in the pool.", [(label, es.num_kv_blocks)])
    metric("engine_alive", "gauge", "1 while the engine loop runs.", [(label, float(alive))])
    metric("engine_steps_total", "counter", "Engine steps run.", [(label, st.num_steps)])
    recent = list(st.recent_step_s)
    qs = [(f'{{model_name="{model}",quantile="{q / 100}"}}', v)
          for q, v in zip((50, 90), quantiles(recent, 50, 90), strict=True)] if recent else []
    metric("engine_step_seconds", "summary", "Engine step time (quantiles over the last 512 steps).",
           [*qs, (f"_sum{label}", st.step_s_total), (f"_count{label}", st.num_steps)])
    metric("engine_gap_seconds_total", "counter", "Seconds between consecutive busy steps (server overhead).",
           [(label, st.gap_s_total)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
           [(label, counters.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Tokens generated and sent to clients.",
           [(label, counters.generation_tokens)])
    metric("engine_generated_tokens_total", "counter", "Tokens the engine generated (aborted ones too).",
           [(label, es.num_generated_tokens)])
    metric("num_preemptions_total", "counter", "Sequences preempted for KV blocks.", [(label, es.num_preemptions)])
    reasons = [(f'{{model_name="{model}",finished_reason="{r}"}}', n) for r, n in sorted(counters.requests.items())]
    metric("request_success_total", "counter", "Finished requests by finish reason.", reasons)
    metric("requests_total", "counter", "Engine requests admitted (one per prompt and sample).",
           [(label, counters.admitted)])
    metric("time_to_first_token_seconds", "summary", "Server-side TTFT: request received -> first token.",
           [(f"_sum{label}", counters.ttft_s_sum), (f"_count{label}", counters.ttft_count)])
    metric("requests_rejected_total", "counter", "Requests refused with an error.", [(label, counters.rejected)])

    def spec(name: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} counter"])
        lines.extend(f"vllm:{name}_total{labels} {value:g}" for labels, value in samples)

    spec("spec_decode_num_drafts", "Verify steps that carried drafts.", [(label, es.spec_num_drafts)])
    spec("spec_decode_num_draft_tokens", "Drafted tokens.", [(label, es.spec_num_draft_tokens)])
    spec("spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.",
         [(label, es.spec_num_accepted_tokens)])
    spec("spec_decode_num_accepted_tokens_per_pos", "Accepted drafts per draft position.",
         [(f'{{model_name="{model}",position="{i}"}}', n) for i, n in enumerate(es.spec_accepted_per_pos)])
    spec("prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up at admission.",
         [(label, es.prefix_cache_queries)])
    spec("prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.", [(label, es.prefix_cache_hits)])
    return "\n".join(lines) + "\n"
