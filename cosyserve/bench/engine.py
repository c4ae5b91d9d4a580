"""The engine core in-process (no Triton): open-loop Poisson arrivals and closed-loop concurrency
against :class:`~cosyserve.engine.service.TTSEngine`, with the loop's own per-stage profile
(``scripts/bench_engine.py``). A GPU experiment takes minutes, not a server start.

Per level: first-chunk latency (arrival to the first PCM piece handed out by the loop), playback
underruns of each stream (a listener that starts with the first piece, :class:`~cosyserve.clients.Playback`),
and where the loop's time went (:class:`~cosyserve.engine.core.EngineCounters` deltas: chunk
starts, flow batches, vocoder, host, idle (the loop's launches, not the GPU's time); ms per iteration; and the free-running LLM's busy
seconds and rows per decode step). Every reply is exactly
``--tokens`` speech tokens (min = max), so timing depends on shapes, not on random weights' output.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..audio.features import TOKENIZER_SAMPLE_RATE
from ..clients import Playback
from ..engine.device import synchronize
from ..engine.scheduler import DEFAULT_MAX_BATCH_FRAMES, DEFAULT_MAX_BATCH_JOBS, Scheduler
from ..data import load_reference_audio
from ..engine.service import BUNDLE_DIRS, TTSEngine, load_engine, warm_up_clip
from ..engine.front_end import TokenLimits, TTSRequest
from ..serving.settings import EngineSettings
from ..token2wav.cosyvoice2 import Token2WavOptions
from ..runtime import resolve_device
from .kernels import call_profile, host_syncs, kernel_profile, trace_until
from .openloop import poisson_arrivals, run_open_loop

TEXT = "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。"


@dataclass
class Outcome:
    first_chunk_ms: float | None
    underruns: int
    stall_s: float
    error: str | None
    stages_ms: dict[str, float] | None = None  # the first chunk's way through the engine
    voice_ms: float | None = None  # a new clip's front-end (its voice resolved before the submit)


# The engine's stages of a first chunk (engine/request.py FIRST_CHUNK_STAGES), from the submit on.
ENGINE_STAGES = (("prefill", "received", "first_token"), ("chunk_tokens", "first_token", "chunk_planned"),
                 ("chunk_start", "chunk_planned", "chunk_started"), ("launch", "chunk_started", "launched"),
                 ("gpu", "launched", "emitted"))


def one_request(engine: TTSEngine, voice, tokens: int, request_id: str, on_first=None) -> Outcome:
    """Stream one request; times are taken as the loop hands each piece out. ``voice``: a resolved
    voice, or a callable that resolves one (a new clip: its front-end time is then counted too).
    ``on_first``: called on another thread once the first piece is out."""
    arrival = time.perf_counter()
    playback, first = Playback(), None
    done = threading.Event()
    error: list[BaseException | None] = []

    def emit(pcm) -> None:
        nonlocal first
        now = time.perf_counter()
        if first is None and pcm.size:
            first = now
            if on_first is not None:
                threading.Thread(target=on_first, daemon=True).start()
        playback.arrive(now, pcm.size / engine.sample_rate)

    def finish(exc) -> None:
        error.append(exc)
        done.set()
    trace: dict[str, float] = {}
    voice_ms = None
    try:
        if callable(voice):
            voice = voice()
            voice_ms = 1e3 * (time.perf_counter() - arrival)
        engine.submit(TTSRequest(request_id, TEXT, voice, TokenLimits(tokens, tokens)), streaming=True, emit=emit,
                      finish=finish, trace=trace)
    except Exception as exc:  # refused, or a bad clip
        return Outcome(None, 0, 0.0, f"{type(exc).__name__}: {exc}")
    done.wait()
    failed = error[0]
    stages = ({stage: 1e3 * (trace[end] - trace[begin]) for stage, begin, end in ENGINE_STAGES}
              if all(stamp in trace for _, begin, end in ENGINE_STAGES for stamp in (begin, end)) else None)
    return Outcome(None if first is None else 1e3 * (first - arrival), playback.underruns, playback.stall_s,
                   None if failed is None else f"{type(failed).__name__}: {failed}", stages, voice_ms)


# Each request's first chunk by stage in a level's ``first_chunk_stages_ms``: its new clip's front end
# (voice), then ENGINE_STAGES.
FIRST_CHUNK_STAGES = ("voice", *(stage for stage, _, _ in ENGINE_STAGES))


def _first_chunk_stages(outcome: Outcome) -> list[float | None]:
    stages = outcome.stages_ms or {}
    return [outcome.voice_ms, *(stages.get(stage) for stage, _, _ in ENGINE_STAGES)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _profile(before: dict, after: dict) -> dict:
    """The loop's per-stage time per iteration between two :class:`~cosyserve.engine.wire.EngineStats`
    counter snapshots; the LLM's busy share is of the wall clock on its own thread."""
    delta = {name: after[name] - before.get(name, 0) for name in after}
    iterations = max(delta["iterations"], 1)
    busy = sum(delta.get(k, 0.0) for k in ("voice_s", "start_s", "flow_s", "vocoder_s", "host_s"))
    return {"iterations": delta["iterations"], "busy_ms_per_iteration": 1e3 * busy / iterations,
            **{f"{k[:-2]}_ms_per_iteration": 1e3 * delta[k] / iterations
               for k in ("voice_s", "start_s", "flow_s", "vocoder_s", "host_s") if k in delta},
            "idle_share": delta["idle_s"] / max(busy + delta["idle_s"], 1e-9),
            "jobs_per_flow_batch": delta["flow_batch_jobs"] / max(delta["flow_batches"], 1),
            "llm_busy_s": delta.get("llm_busy_s"),
            "llm_rows_per_decode_step": (delta["llm_decode_rows"] / max(delta["llm_decode_steps"], 1)
                                         if "llm_decode_steps" in delta else None),
            # the LLM's time per request prefilled, and per decode step (its own thread's wall clock)
            "llm_prefill_ms_per_request": (1e3 * delta["llm_prefill_s"] / max(delta["llm_prefills"], 1)
                                           if "llm_prefill_s" in delta else None),
            "llm_ms_per_decode_step": (1e3 * (delta["llm_busy_s"] - delta["llm_prefill_s"])
                                       / max(delta["llm_decode_steps"], 1) if "llm_prefill_s" in delta else None)}


def level(engine: TTSEngine, outcomes: list[Outcome], label: str, wall_s: float, before) -> dict:
    firsts = [o.first_chunk_ms for o in outcomes if o.first_chunk_ms is not None]
    voiced = [o for o in outcomes if o.first_chunk_ms is not None]
    return {"level": label, "requests": len(outcomes), "failed": sum(o.error is not None for o in outcomes),
            "first_p50_ms": _percentile(firsts, 0.5), "first_p95_ms": _percentile(firsts, 0.95),
            "first_chunks_ms": [round(ms, 1) for ms in firsts],  # in arrival order: a slow round shows as a run
            # the same requests' first chunks by stage (FIRST_CHUNK_STAGES; None: not measured), so that a
            # late one shows where its time went
            "first_chunk_stages_ms": [[None if v is None else round(v, 1) for v in _first_chunk_stages(o)]
                                      for o in voiced],
            "underrun_requests": sum(o.underruns > 0 for o in outcomes),
            "stall_s": sum(o.stall_s for o in outcomes), "wall_s": wall_s,
            "errors": sorted({o.error for o in outcomes if o.error})[:3],
            "voice_ms": _mean([o.voice_ms for o in outcomes if o.voice_ms is not None]),
            **{f"{stage}_ms": _mean([o.stages_ms[stage] for o in outcomes if o.stages_ms]) for stage, _, _ in ENGINE_STAGES},
            **_profile(before, engine.stats().counters)}


def kind_options(args: argparse.Namespace, models: Path, device: torch.device) -> dict:
    """The kind's options as the Triton model's parameters of the same meaning would give them."""
    model_dir, llm_dir, _ = BUNDLE_DIRS[args.model]
    settings = EngineSettings(models / model_dir, models / llm_dir, model_kind=args.model, final=args.final,
                              incremental_stream=not args.rerun, state_pool_gb=args.state_pool_gb,
                              hift_max_tokens=args.tokens)
    options = settings.kind_options(device)
    # experiments' options, not served settings (yet)
    if args.prefix_priority is not None:
        if args.model != "cosyvoice2":
            raise SystemExit("--prefix-priority / --no-prefix-priority: CosyVoice2's flow engine only")
        options["prefix_priority"] = args.prefix_priority
    if args.prepare_beside:
        if args.model != "cosyvoice3":
            raise SystemExit("--prepare-beside: CosyVoice3 only (CosyVoice2 always prepares beside the loop)")
        options["prepare_beside"] = True
    return options


def prefix_priority(args: argparse.Namespace) -> bool | None:
    """Whether CosyVoice2's new voices' prompts run on the high-priority stream (None: another model)."""
    if args.model != "cosyvoice2":
        return None
    return Token2WavOptions.prefix_priority if args.prefix_priority is None else args.prefix_priority


def run(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    models = Path(args.models_dir)
    model_dir, llm_dir, spk2info = BUNDLE_DIRS[args.model]
    loading = time.perf_counter()
    engine = load_engine(args.model, models / model_dir, models / llm_dir, device,
                         kind_options=kind_options(args, models, device),
                         llm_options={"max_slots": args.max_slots, "high_priority": args.llm_high_priority,
                                      "steps_per_replay": args.llm_steps_per_replay},
                         scheduler=Scheduler(max_batch_frames=args.max_batch_frames, max_batch_jobs=args.max_batch_jobs),
                         sync_stages=args.sync_stages, warm_up=not args.cold,
                         spk2info=models / spk2info if spk2info else None)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "model": args.model,
              "load_s": time.perf_counter() - loading, "load_phases_s": engine.load_phases,
              "prefix_priority": prefix_priority(args), "prepare_beside": args.prepare_beside,
              "llm_high_priority": args.llm_high_priority, "llm_steps_per_replay": args.llm_steps_per_replay,
              "tokens": args.tokens,
              "final": args.final, "levels": []}
    voice, prompt_text = registered_voice(engine, args)
    counter = iter(range(1 << 30))
    rng = np.random.default_rng(args.seed)
    try:
        first = one_request(engine, voice, args.tokens, f"first-{next(counter)}")
        report["first_request_ms"] = first.first_chunk_ms
        # each thread switch interval in turn (one: the engine's own), every level under it
        for interval_ms in args.switch_interval_ms or [None]:
            if interval_ms is not None:
                sys.setswitchinterval(interval_ms / 1e3)
            tag = f" @{sys.getswitchinterval() * 1e3:g} ms" if args.switch_interval_ms else ""
            report["switch_interval_ms"] = sys.getswitchinterval() * 1e3
            for concurrency in args.concurrency:
                def closed_loop(sender: int) -> list[Outcome]:
                    return [one_request(engine, voice, args.tokens, f"c-{next(counter)}")
                            for _ in range(args.requests_per_sender)]
                _measure(report, engine, f"{concurrency} concurrent{tag}",
                         lambda: ([o for outcomes in _in_threads(concurrency, closed_loop) for o in outcomes], {}))

            def new_clip():  # a clip of 3-8 s the server has never seen, with the registered voice's transcript
                wav = rng.standard_normal(int(TOKENIZER_SAMPLE_RATE * rng.uniform(3, 8))).astype(np.float32) * 0.1
                return lambda: engine.voices.resolve(wav, prompt_text)
            def uploaded_clip():  # a clip of the same kind whose features and engine state are kept beforehand
                voice_ = new_clip()()
                launched = threading.Event()
                engine.core.prepare_voices([voice_.features], launched.set)
                launched.wait()
                synchronize(engine.core.kind.device)  # computed, before the round starts
                return voice_
            for count in args.new_clips:
                def together(count=count, voices_of_round=None) -> list[Outcome]:  # a round after another
                    outcomes = []
                    for _ in range(args.new_clip_rounds):
                        voices = voices_of_round(count) if voices_of_round else [new_clip() for _ in range(count)]
                        outcomes += _in_threads(count, lambda i: one_request(engine, voices[i], args.tokens,
                                                                             f"n-{next(counter)}"))
                    return outcomes
                # the same arrivals with the registered voice, and with clips as long as the new ones but
                # uploaded beforehand: what the new clips add is the difference
                _measure(report, engine, f"{count} registered together{tag}",
                         lambda: (together(voices_of_round=lambda n: [voice] * n), {}))
                _measure(report, engine, f"{count} uploaded clips together{tag}",
                         lambda: (together(voices_of_round=lambda n: [uploaded_clip() for _ in range(n)]), {}))
                _measure(report, engine, f"{count} new clips together{tag}", lambda: (together(), {}))
            for playing in args.new_clips_while_playing:  # the playing streams alone first, then with each level
                for count in [0, *args.new_clips]:
                    clips = [new_clip() for _ in range(count)]
                    _measure_while_playing(report, engine, voice, args.tokens, playing, clips, counter,
                                           f"{count} new clips while {playing} play{tag}")
            if args.profile_new_clips:
                if device.type == "cuda":
                    clips = [new_clip() for _ in range(args.profile_new_clips)]
                    _, syncs = host_syncs(lambda: _in_threads(len(clips), lambda i: one_request(
                        engine, clips[i], args.tokens, f"h-{next(counter)}")))
                    report["new_clip_host_syncs"] = syncs
                    print(f"host syncs of {len(clips)} new clips: {syncs['syncs']}", flush=True)
                    for entry in syncs["top"]:
                        print(f"  {entry['count']:6d}  {entry['line']}", flush=True)
                # on the idle engine from this thread, three times each (the first may pay one-off costs):
                # a new clip's front end (resolve), then the kind's preparation of new voices
                report["new_voice_front_end_profile"] = _print_profiles(
                    "front end", [call_profile(lambda: new_clip()()) for _ in range(3)])
                preparations = []
                for _ in range(3):
                    features = [new_clip()().features for _ in range(args.profile_new_clips)]
                    preparations.append(call_profile(lambda: engine.core.kind.prepare_voices(features)))
                report["new_voice_preparation_profile"] = _print_profiles(
                    f"preparation ({args.profile_new_clips} together)", preparations)

            def traced_clips(first) -> list[Outcome]:  # the last level's count of new clips, under trace_until
                clips = [new_clip() for _ in range(args.new_clips[-1])]
                return _in_threads(len(clips), lambda i: one_request(engine, clips[i], args.tokens,
                                                                     f"t-{next(counter)}", on_first=first))
            if args.trace_registered:
                report["registered_trace"] = trace_until(args.trace_registered, lambda first: one_request(
                    engine, voice, args.tokens, f"r-{next(counter)}", on_first=first), 1)
                print(f"trace of one request of the registered voice until its first chunk: "
                      f"{report['registered_trace']}", flush=True)
            if args.trace_new_clips and args.new_clips:
                report["new_clip_trace"] = trace_until(args.trace_new_clips, traced_clips, args.new_clips[-1])
                print(f"trace of {args.new_clips[-1]} new clips until their first chunks: {report['new_clip_trace']}",
                      flush=True)
            if args.trace_while_playing and args.new_clips and args.new_clips_while_playing:
                playing = args.new_clips_while_playing[-1]
                trace, played = _while_playing(engine, voice, args.tokens, playing, counter, lambda: trace_until(
                    args.trace_while_playing, traced_clips, args.new_clips[-1]))
                report["while_playing_trace"] = {**trace, **played}
                print(f"trace of {args.new_clips[-1]} new clips while {playing} play, until their first chunks: "
                      f"{report['while_playing_trace']}", flush=True)
            for rate in args.rates:
                def open_loop():
                    arrivals = poisson_arrivals(rate, args.seed, duration_s=args.seconds_per_rate)
                    run_ = run_open_loop(arrivals,
                                         lambda i: one_request(engine, voice, args.tokens, f"o-{next(counter)}"))
                    return run_.results, {"peak_in_flight": run_.peak_in_flight}
                _measure(report, engine, f"{rate:g} req/s{tag}", open_loop)
        if args.profile_rate:
            def profiled():
                arrivals = poisson_arrivals(args.profile_rate, args.seed, duration_s=args.profile_seconds)
                before = engine.stats().counters
                run_, kernels = kernel_profile(lambda: run_open_loop(
                    arrivals, lambda i: one_request(engine, voice, args.tokens, f"p-{next(counter)}")))
                iterations = engine.stats().counters["iterations"] - before["iterations"]
                audio_s = len(arrivals) * args.tokens / 25
                kernels.update(kernels_per_iteration=kernels["kernels"] / max(iterations, 1),
                               kernels_per_audio_s=kernels["kernels"] / audio_s)
                report["kernel_profile"] = {"rate": args.profile_rate, **kernels}
                return run_.results, {"peak_in_flight": run_.peak_in_flight}
            _measure(report, engine, f"{args.profile_rate:g} req/s profiled", profiled)
            print(kernel_table(report["kernel_profile"]), flush=True)
        if args.sync_debug_rate and device.type != "cuda":
            print("--sync-debug-rate: torch's sync debug mode watches CUDA only; level skipped on the CPU", flush=True)
        elif args.sync_debug_rate:
            def sync_debugged():
                arrivals = poisson_arrivals(args.sync_debug_rate, args.seed, duration_s=args.profile_seconds)
                run_, syncs = host_syncs(lambda: run_open_loop(
                    arrivals, lambda i: one_request(engine, voice, args.tokens, f"y-{next(counter)}")))
                report["host_syncs"] = {"rate": args.sync_debug_rate, **syncs}
                return run_.results, {"peak_in_flight": run_.peak_in_flight}
            _measure(report, engine, f"{args.sync_debug_rate:g} req/s sync debug", sync_debugged)
            print(f"host syncs at {args.sync_debug_rate:g} req/s: {report['host_syncs']['syncs']}", flush=True)
            for entry in report["host_syncs"]["top"]:
                print(f"  {entry['count']:6d}  {entry['line']}", flush=True)
    finally:
        engine.close()
    return report


def registered_voice(engine: TTSEngine, args: argparse.Namespace):
    """The voice every request of the closed and open loops uses, and its transcript: ``--voice`` of
    spk2info.pt, or, for a model without registered voices, the clip ``--reference-audio`` (default:
    a synthetic 3 s clip) as a voice uploaded through the API would be, its prompt state kept."""
    if engine.voices.registry.ids():
        voice = engine.voices.resolve(speaker_id=args.voice)
        return voice, voice.prompt_text
    wav = load_reference_audio(args.reference_audio) if args.reference_audio else warm_up_clip()
    voice = engine.voices.resolve(wav, args.reference_text)
    engine.core.kind.prepare_voices([voice.features])
    return voice, args.reference_text


def _in_threads(count: int, work) -> list:
    """``work(i)`` for i < ``count``, each on a thread of its own, all at once; their results."""
    results: list = [None] * count
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, work(i))) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _print_profiles(name: str, profiles: list[dict]) -> list[dict]:
    """Print :func:`~.kernels.call_profile` results of one piece of work: the times of each, the
    last one's table and long host calls; the results without their tables."""
    for profile in profiles:
        print(f"new voice {name} on the idle engine: launched in {profile['host_ms']:.1f} ms, done after "
              f"{profile['done_ms']:.1f} ms, {profile['kernels']} kernels busy {profile['kernel_busy_ms']:.1f} ms",
              flush=True)
    print([profile.pop("table") for profile in profiles][-1], flush=True)
    for call in profiles[-1]["long_host_calls"]:
        print(f"  {call['count']:4d} x {call['call']} from {call['from']}: {call['ms']:.1f} ms", flush=True)
    return profiles


def _while_playing(engine: TTSEngine, voice, tokens: int, playing: int, counter, work):
    """``playing`` streams of the registered voice start together; once every one has emitted its
    first chunk, ``work()`` runs (new clips arriving, say); then the playing streams are waited for.
    Returns ``work``'s result and the playing streams' underruns and failures."""
    started = threading.Barrier(playing + 1)
    playing_outcomes: list = [None] * playing

    def play(i: int) -> None:
        def on_first() -> None:
            try:
                started.wait(timeout=60)
            except threading.BrokenBarrierError:  # a playing stream failed before its first chunk
                pass
        playing_outcomes[i] = one_request(engine, voice, tokens, f"w-{next(counter)}", on_first=on_first)
    threads = [threading.Thread(target=play, args=(i,)) for i in range(playing)]
    for thread in threads:
        thread.start()
    try:
        started.wait(timeout=60)
    except threading.BrokenBarrierError:
        pass
    result = work()
    for thread in threads:
        thread.join()
    done = [o for o in playing_outcomes if o is not None]
    return result, {"playing": playing, "playing_underrun_requests": sum(o.underruns > 0 for o in done),
                    "playing_failed": sum(o.error is not None for o in done)}


def _measure_while_playing(report: dict, engine: TTSEngine, voice, tokens: int, playing: int, clips: list,
                           counter, label: str) -> None:
    """The new ``clips`` arrive together while ``playing`` streams play (:func:`_while_playing`). The
    level is the new clips' requests; the playing streams' underruns are reported beside it
    (``playing_underrun_requests``)."""
    _measure(report, engine, label, lambda: _while_playing(
        engine, voice, tokens, playing, counter,
        lambda: _in_threads(len(clips), lambda i: one_request(engine, clips[i], tokens, f"n-{next(counter)}"))))


def _measure(report: dict, engine: TTSEngine, label: str, run) -> None:
    """One level: ``run()`` -> (outcomes, extra fields), with the loop's counters around it; the
    level is added to ``report`` and printed as it is measured."""
    before = engine.stats().counters
    start = time.perf_counter()
    outcomes, extra = run()
    gauges = {name: value for name, (_, value) in engine.stats().gauges.items()}  # the kind's state after it
    report["levels"].append({**level(engine, outcomes, label, time.perf_counter() - start, before), **extra,
                             "kind_gauges": gauges})
    print(table(report, report["levels"][-1:]), flush=True)


COLUMNS = ("level", "requests", "failed", "first_p50_ms", "first_p95_ms", "underrun_requests", "stall_s",
           "voice_ms", *(f"{stage}_ms" for stage, _, _ in ENGINE_STAGES),
           "busy_ms_per_iteration", "voice_ms_per_iteration", "start_ms_per_iteration", "flow_ms_per_iteration",
           "vocoder_ms_per_iteration", "host_ms_per_iteration", "idle_share", "jobs_per_flow_batch", "llm_busy_s",
           "llm_rows_per_decode_step", "llm_prefill_ms_per_request", "llm_ms_per_decode_step",
           "playing_underrun_requests")


def table(report: dict, levels: list[dict] | None = None) -> str:
    """The report as a markdown table (only ``levels``, when given: one level as it is measured)."""
    def cell(value) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)
    phases = ", ".join(f"{name} {s:.1f}" for name, s in report.get("load_phases_s", {}).items())
    lines = [f"{report.get('model', 'cosyvoice2')} on device {report['device']}, load {report['load_s']:.1f} s"
             f"{f' ({phases})' if phases else ''}"
             f"{', the prompts of new voices on a high-priority stream' if report.get('prefix_priority') else ''}"
             f"{', new voices prepared beside the loop' if report.get('prepare_beside') else ''}"
             f"{', the LLM on a high-priority stream' if report.get('llm_high_priority') else ''}"
             f"{f', {n} LLM decode steps a replay' if (n := report.get('llm_steps_per_replay', 1)) > 1 else ''}, "
             f"{report['tokens']} tokens a reply, "
             f"final {report['final']}, first request after load: first chunk "
             f"{cell(report.get('first_request_ms'))} ms",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in report["levels"] if levels is None else levels:
        lines.append("| " + " | ".join(cell(row.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models-dir", default="models",
                   help="bundle layout: CosyVoice2-0.5B/ and cosyvoice2_llm/, Fun-CosyVoice3-0.5B-2512/ and "
                        "cosyvoice3_llm/, Step-Audio-2-mini/token2wav/")
    p.add_argument("--model", default="cosyvoice2", choices=sorted(BUNDLE_DIRS))
    p.add_argument("--device", default="auto")
    p.add_argument("--voice", default="001", help="registered voice of spk2info.pt")
    p.add_argument("--reference-audio", help="a model without registered voices (CosyVoice3): the voice's clip "
                                             "(default: a synthetic 3 s clip)")
    p.add_argument("--reference-text", default="希望你以后能够做的比我还好呦。", help="its transcript")
    p.add_argument("--tokens", type=int, default=150, help="speech tokens per reply (6 s)")
    p.add_argument("--final", default="reference", choices=("reference", "streaming"), help="CosyVoice2's last chunk")
    p.add_argument("--rerun", action="store_true", help="CosyVoice3: the reference's full-attention re-run streaming")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 16], help="closed-loop levels")
    p.add_argument("--requests-per-sender", type=int, default=4)
    p.add_argument("--new-clips", type=int, nargs="*", default=[],
                   help="levels of N never-seen 3-8 s clips arriving together (their front-end counted), each "
                        "after N requests of the registered voice arriving together, and N of clips of the same "
                        "lengths uploaded beforehand (features and engine state kept)")
    p.add_argument("--new-clip-rounds", type=int, default=1,
                   help="each --new-clips level this many times in turn, fresh clips each round (its p50/p95 "
                        "over all of them)")
    p.add_argument("--new-clips-while-playing", type=int, nargs="*", default=[],
                   help="each --new-clips level again while this many streams of the registered voice play "
                        "(their underruns reported as playing_underrun_requests; first with no new clip)")
    p.add_argument("--profile-new-clips", type=int, default=0, help="then this many new clips together: (CUDA) "
                   "under torch's sync debug mode (host syncs by source line), then three times their voices "
                   "prepared by the kind on the idle engine from this thread under the profiler (launch and "
                   "done times, kernels, host time by operator and stack), printed")
    p.add_argument("--trace-new-clips", metavar="PATH", help="then the last --new-clips level's clips once more "
                   "under torch.profiler until their first chunks are out (every thread's operators, the kernels): "
                   "a gzipped Chrome trace written to PATH")
    p.add_argument("--trace-registered", metavar="PATH", help="then one request of the registered voice on the idle "
                   "engine, traced as --trace-new-clips until its first chunk")
    p.add_argument("--trace-while-playing", metavar="PATH", help="then the last --new-clips level's clips once "
                   "more while the last --new-clips-while-playing count of streams play, traced as --trace-new-clips "
                   "from the clips' arrival until their first chunks (the playing streams' operators and kernels too)")
    p.add_argument("--rates", type=float, nargs="*", default=[], help="open-loop Poisson arrival rates (req/s)")
    p.add_argument("--seconds-per-rate", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-slots", type=int, default=64, help="LLM requests decoded at once")
    p.add_argument("--max-batch-frames", type=int, default=DEFAULT_MAX_BATCH_FRAMES)
    p.add_argument("--max-batch-jobs", type=int, default=DEFAULT_MAX_BATCH_JOBS)
    p.add_argument("--state-pool-gb", type=float, default=0.0, help="0: a third of the free GPU memory")
    p.add_argument("--prefix-priority", action=argparse.BooleanOptionalAction, default=None,
                   help="CosyVoice2: new voices' prompts on a high-priority CUDA stream or not (Token2WavOptions."
                        "prefix_priority; default: the kind's default, on)")
    p.add_argument("--prepare-beside", action="store_true",
                   help="CosyVoice3: new voices' prefixes computed beside the loop as their requests arrive "
                        "(CosyVoice3Kind's prepare_beside)")
    p.add_argument("--llm-high-priority", action="store_true",
                   help="the LLM's steps on a CUDA stream of the highest priority, its kernels before the flow's "
                        "(LLMEngine's high_priority; default: the flow's priority)")
    p.add_argument("--llm-steps-per-replay", type=int, default=1,
                   help="the LLM's decode steps per graph replay, its tokens fed back on the device (LLMEngine's "
                        "steps_per_replay): its thread takes the GIL and reads tokens back once per that many")
    p.add_argument("--sync-stages", action="store_true", help="wait for the GPU after each stage (a true split)")
    p.add_argument("--cold", action="store_true", help="no warm-up at load (graphs and kernels on first use)")
    p.add_argument("--profile-rate", type=float, default=0.0, help="last, an open-loop level at this rate under "
                   "torch.profiler (CUDA): kernels per iteration and per second of audio, GPU busy share")
    p.add_argument("--profile-seconds", type=float, default=4.0)
    p.add_argument("--sync-debug-rate", type=float, default=0.0, help="last, an open-loop level at this rate "
                   "(for --profile-seconds) under torch's sync debug mode (CUDA): the host's waits for the GPU by "
                   "source line")
    p.add_argument("--switch-interval-ms", type=float, nargs="*", default=[],
                   help="the interpreter's thread switch intervals to run every level under, one after the other "
                   "(default: the engine's own, set when its loop starts)")
    p.add_argument("--json", help="write the report here")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    # the load's own lines (graphs captured and their seconds, the load's phases), before the tables
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(report))


def kernel_table(profile: dict) -> str:
    """The profiled level's device figures and its top kernels, as markdown."""
    lines = [f"kernel profile at {profile['rate']:g} req/s over {profile['wall_s']:.1f} s: {profile['kernels']} kernels "
             f"({profile['kernels_per_iteration']:.0f} per iteration, {profile['kernels_per_audio_s']:.0f} per second of "
             f"audio), {100 * (profile['short_kernel_share'] or 0):.0f} % under 10 us (median "
             f"{profile['median_kernel_us'] or 0:.1f} us), GPU busy {100 * (profile['gpu_busy_share'] or 0):.0f} %",
             "", "| kernel | calls | ms | share of busy |", "|---|---:|---:|---:|"]
    lines += [f"| {k['name']} | {k['calls']} | {k['ms']} | {k['share_of_busy']} |" for k in profile["top"]]
    return "\n".join(lines)
