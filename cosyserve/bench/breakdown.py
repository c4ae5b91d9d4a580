"""Where a level's time went: Triton's per-model statistics by pipeline part, and the server's
``cosyserve_*`` counters turned into busy shares and per-call figures."""

from __future__ import annotations


def model_group(name: str) -> str:
    """Triton model -> the part of the pipeline it is (BLS, LLM, token2wav, front-ends)."""
    if name.startswith("cosyvoice2"):
        return "bls"
    if name in ("llm", "tensorrt_llm"):
        return "llm"
    if name.startswith("token2wav"):
        return "token2wav"
    if name in ("audio_tokenizer", "speaker_embedding"):
        return "frontends"
    return name


def compute_by_group(triton_stats: dict, wall_s: float) -> dict[str, dict]:
    """Per pipeline part, from a level's Triton statistics: executions, inferences, mean queue
    time, compute time (input + infer + output), busy = compute / wall (instances busy on
    average), share = compute / compute of all parts but the BLS (the BLS's compute time includes
    the time it waits for the other models, so it has no share)."""
    groups: dict[str, dict] = {}
    for model in triton_stats.get("model_stats", []):
        stats = model.get("inference_stats", {})
        group = groups.setdefault(model_group(model["name"]), {"models": [], "executions": 0, "inferences": 0,
                                                                "queue_count": 0, "queue_ns": 0, "compute_ns": 0})
        group["models"].append(model["name"])
        group["executions"] += int(model.get("execution_count", 0))
        group["inferences"] += int(model.get("inference_count", 0))
        group["queue_count"] += int(stats.get("queue", {}).get("count", 0))
        group["queue_ns"] += int(stats.get("queue", {}).get("ns", 0))
        group["compute_ns"] += sum(int(stats.get(part, {}).get("ns", 0))
                                   for part in ("compute_input", "compute_infer", "compute_output"))
    pipeline_ns = sum(g["compute_ns"] for name, g in groups.items() if name != "bls")
    return {name: {"models": g["models"], "executions": g["executions"], "inferences": g["inferences"],
                   "queue_avg_ms": g["queue_ns"] / g["queue_count"] / 1e6 if g["queue_count"] else None,
                   "compute_s": g["compute_ns"] / 1e9,
                   "busy": g["compute_ns"] / 1e9 / wall_s if wall_s > 0 else None,
                   "share": g["compute_ns"] / pipeline_ns if name != "bls" and pipeline_ns else None}
            for name, g in groups.items()}



def server_breakdown(row: dict) -> dict | None:
    """Where a level's server time went, from its counter deltas: busy = seconds of that work / the
    level's wall time; flow per call (rows, padding, ms); LLM decode steps (ms, rows). A figure is
    None when its counters are missing or a denominator is 0; the whole is None without counters."""
    counters = row.get("server_counters")
    if not counters:
        return None

    def counter(name: str) -> float | None:
        return counters.get(f"cosyserve_{name}_total")

    def ratio(numerator: float | None, denominator: float | None, scale: float = 1.0) -> float | None:
        return None if numerator is None or not denominator else scale * numerator / denominator

    def difference(minuend: float | None, *subtrahends: float | None) -> float | None:
        return None if minuend is None or None in subtrahends else minuend - sum(subtrahends)

    wall_s = row.get("wall_s")
    flow_busy = ratio(counter("token2wav_flow_seconds"), wall_s)
    hift_busy = ratio(counter("token2wav_hift_seconds"), wall_s)
    execute_busy = ratio(counter("token2wav_execute_seconds"), wall_s)
    decode_s = difference(counter("llm_engine_busy_seconds"), counter("llm_prefill_seconds"))
    return {
        "flow_busy": flow_busy, "hift_busy": hift_busy, "token2wav_execute_busy": execute_busy,
        "token2wav_other_busy": difference(execute_busy, flow_busy, hift_busy),
        "flow_rows_per_call": ratio(counter("token2wav_flow_rows"), counter("token2wav_flow_calls")),
        "flow_padding": difference(1.0, ratio(counter("token2wav_flow_frames"),
                                              counter("token2wav_flow_padded_frames"))),
        "flow_ms_per_call": ratio(counter("token2wav_flow_seconds"), counter("token2wav_flow_calls"), 1000.0),
        "llm_busy": ratio(counter("llm_engine_busy_seconds"), wall_s),
        "llm_step_ms": ratio(decode_s, counter("llm_decode_steps"), 1000.0),
        "llm_rows_per_step": ratio(counter("llm_decode_rows"), counter("llm_decode_steps")),
        "llm_tokens_per_s": ratio(counter("llm_generated_tokens"), wall_s),
    }
