#!/usr/bin/env python3
"""Send one offline request to the cosyvoice2 Triton model over HTTP and save the audio.

    python3 client_http.py --server-addr localhost --server-port 8000 \\
        --reference-audio prompt.wav --reference-text "transcript of the prompt" \\
        --target-text "text to synthesise" --output-audio output.wav

The prompt is sent as mono 16 kHz (other rates are resampled); the 24 kHz result is written as
16-bit PCM. Prints the latency, the audio duration and the real-time factor.
"""

from __future__ import annotations

import argparse
import sys

import soundfile as sf
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from cosyserve import clients, data
from cosyserve.errors import InvalidInputError


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-addr", default="localhost")
    parser.add_argument("--server-port", type=int, default=8000, help="Triton HTTP port")
    parser.add_argument("--server-url", help="host:port, instead of --server-addr/--server-port")
    parser.add_argument("--reference-audio", required=True, help="prompt wav (any rate, mono or not)")
    parser.add_argument("--reference-text", required=True, help="transcript of the prompt")
    parser.add_argument("--target-text", required=True, help="text to synthesise")
    parser.add_argument("--model-name", default="cosyvoice2")
    parser.add_argument("--speaker-id", help="optional speaker_id input (cache the prompt's speaker under it)")
    parser.add_argument("--output-audio", default="output.wav")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    url = args.server_url or f"{args.server_addr}:{args.server_port}"
    url = url.removeprefix("http://")
    try:
        waveform = data.load_reference_audio(args.reference_audio)
        inputs = clients.build_inputs(httpclient, waveform, args.reference_text, args.target_text, args.speaker_id)
    except InvalidInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    client = httpclient.InferenceServerClient(url, connection_timeout=args.timeout, network_timeout=args.timeout)
    try:
        audio, result = clients.run_offline(client, args.model_name, inputs, clients.requested_outputs(httpclient),
                                            "http")
    except (InferenceServerException, OSError) as e:
        print(f"error: request to {url} failed: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    sf.write(args.output_audio, audio, clients.OUTPUT_SAMPLE_RATE, "PCM_16")
    rtf = result.latency_s / result.audio_s if result.audio_s else float("nan")
    print(f"latency {result.latency_s:.3f} s, audio {result.audio_s:.3f} s ({audio.size} samples at "
          f"{clients.OUTPUT_SAMPLE_RATE} Hz), RTF {rtf:.3f}; wrote {args.output_audio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
