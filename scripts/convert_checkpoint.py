#!/usr/bin/env python3
"""HuggingFace-format CosyVoice2 LLM -> TensorRT-LLM checkpoint (input of ``trtllm-build``).

    python3 scripts/convert_checkpoint.py --model_dir models/cosyvoice2_llm \\
        --output_dir trt_weights_bfloat16 --dtype bfloat16 [--tp_size 1] [--converter auto]

``--converter tensorrt_llm`` uses TensorRT-LLM's own Qwen conversion
(``QWenForCausalLM.from_hugging_face``, one rank at a time); ``cosyserve`` uses this package's
mapping (cosyserve/llm/trtllm/convert.py, no TensorRT-LLM needed, e.g. to prepare a checkpoint on a
machine without a GPU); ``auto`` (default) picks TensorRT-LLM when it can be imported. Either
way the result is then checked against the HuggingFace weights (vocabulary embedding, head rows
and tensor-parallel padding, config fields) and the head bias is validated: TensorRT-LLM's Qwen
head has no bias, so the bias is applied per request from the HuggingFace directory
(cosyserve/llm/trtllm/request.py), which must therefore stay available at serving time.

Exit status: 0 done, 1 bad input or model files, 2 TensorRT-LLM required but not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cosyserve.errors import CosyServeError  # noqa: E402
from cosyserve.llm.base import BackendUnavailableError  # noqa: E402
from cosyserve.llm.trtllm import require_tensorrt_llm  # noqa: E402
from cosyserve.llm.trtllm.convert import read_hf_config, resolve_dtype, verify_checkpoint, write_checkpoint  # noqa: E402


def convert_with_tensorrt_llm(model_dir: Path, output_dir: Path, dtype: str, tp_size: int) -> None:
    """TensorRT-LLM's own Qwen conversion, one tensor-parallel rank at a time."""
    require_tensorrt_llm("convert_checkpoint.py --converter tensorrt_llm")
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import QWenForCausalLM

    output_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(tp_size):
        mapping = Mapping(world_size=tp_size, rank=rank, tp_size=tp_size, pp_size=1)
        model = QWenForCausalLM.from_hugging_face(str(model_dir), dtype, mapping=mapping)
        model.save_checkpoint(str(output_dir), save_config=rank == 0)
        del model  # one rank's weights in memory at a time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", type=Path, required=True, help="HuggingFace CosyVoice2 LLM directory")
    parser.add_argument("--output_dir", type=Path, default=Path("tllm_checkpoint"))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                        help="weight dtype; auto = the checkpoint's (float32 becomes float16)")
    parser.add_argument("--tp_size", type=int, default=1, help="tensor-parallel size (GPUs per engine)")
    parser.add_argument("--converter", default="auto", choices=["auto", "tensorrt_llm", "cosyserve"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tensor copies only; leave the cores to others
    converter = args.converter
    if converter == "auto":
        converter = "tensorrt_llm" if importlib.util.find_spec("tensorrt_llm") else "cosyserve"
    started = time.time()
    try:
        hf_config, _ = read_hf_config(args.model_dir)
        dtype = resolve_dtype(args.dtype, hf_config)
        if converter == "tensorrt_llm":
            convert_with_tensorrt_llm(args.model_dir, args.output_dir, dtype, args.tp_size)
        else:
            write_checkpoint(args.model_dir, args.output_dir, dtype, args.tp_size)
        config = verify_checkpoint(args.output_dir, args.model_dir)
    except BackendUnavailableError as exc:
        print(f"convert_checkpoint: {exc}", file=sys.stderr)
        return 2
    except (CosyServeError, ValueError, OSError) as exc:
        print(f"convert_checkpoint: {exc}", file=sys.stderr)
        return 1
    print(f"converted {args.model_dir} -> {args.output_dir} with the {converter} converter in "
          f"{time.time() - started:.1f} s: {config['dtype']}, vocab {config['vocab_size']}, "
          f"tp {config['mapping']['tp_size']}; checked against the HuggingFace weights. The head bias is "
          f"applied per request from {args.model_dir} (keep that directory next to the engine).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
