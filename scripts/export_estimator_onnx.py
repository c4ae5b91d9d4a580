#!/usr/bin/env python3
"""Export the CosyVoice2 flow estimator to ONNX (dynamic batch and frames), check it, optionally build TensorRT plans.

    python scripts/export_estimator_onnx.py --model-dir models/CosyVoice2-0.5B
    python scripts/export_estimator_onnx.py --model-dir models/CosyVoice2-0.5B --tensorrt --max-requests 16

Writes ``flow.decoder.estimator.fp32.onnx`` (full attention: offline and final chunks) and
``flow.decoder.estimator.streaming.fp32.onnx`` (block-causal: non-final streaming chunks) into
``--out-dir`` (default: the model dir). Inputs ``x, mask, mu, t, spks, cond``, output
``estimator_out``, as in the reference's TensorRT path. Each file is checked with onnxruntime
(CPU) against the torch estimator on fresh random inputs of another batch and length.
``--tensorrt`` then builds a ``.plan`` next to each ONNX file (needs the ``tensorrt`` package and
a GPU); load them with ``Token2WavOptions(tensorrt_plan=..., tensorrt_streaming_plan=...)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.models.flow import load_flow  # noqa: E402
from cosyserve.token2wav.tensorrt import (build_estimator_engine, check_estimator_onnx,  # noqa: E402
                                          estimator_onnx_name, export_estimator_onnx, require_tensorrt)

CHECK_REL_L2 = 1e-4  # float32 onnxruntime vs float32 torch: rounding only


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="CosyVoice2-0.5B directory (flow.pt, cosyvoice2.yaml)")
    p.add_argument("--out-dir", type=Path, help="where to write (default: --model-dir)")
    p.add_argument("--modes", choices=("both", "offline", "streaming"), default="both")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime check")
    p.add_argument("--tensorrt", action="store_true", help="also build TensorRT plans (needs tensorrt + GPU)")
    p.add_argument("--fp32-engine", action="store_true", help="TensorRT in fp32 (default fp16, as deployed)")
    p.add_argument("--max-requests", type=int, default=16, help="engine batch: up to 2 x this many rows")
    p.add_argument("--max-frames", type=int, default=3000, help="engine frames (prompt + target), 50 per second")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    if args.tensorrt:
        require_tensorrt("--tensorrt")  # fail before the export, not after
    estimator = load_flow(args.model_dir).decoder.estimator
    out_dir = args.out_dir or args.model_dir
    modes = {"both": (False, True), "offline": (False,), "streaming": (True,)}[args.modes]
    failed = False
    for streaming in modes:
        path = export_estimator_onnx(estimator, out_dir / estimator_onnx_name(streaming), streaming=streaming,
                                     opset=args.opset)
        line = f"wrote {path}"
        if not args.no_check:
            rel = check_estimator_onnx(path, estimator, streaming=streaming)
            failed |= not rel < CHECK_REL_L2
            line += f"  onnxruntime vs torch rel-L2 {rel:.2e} ({'ok' if rel < CHECK_REL_L2 else 'FAILED'})"
        print(line)
        if args.tensorrt:
            plan = path.with_name(path.name.replace(".fp32.onnx", ".fp32.plan" if args.fp32_engine else ".fp16.plan"))
            build_estimator_engine(path, plan, fp16=not args.fp32_engine, max_requests=args.max_requests,
                                   max_frames=args.max_frames)
            print(f"wrote {plan}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
