"""Load a HuggingFace Qwen2ForCausalLM checkpoint (safetensors) into :class:`Qwen2SpeechLM`.

Strict: every tensor of the checkpoint must be used and every parameter filled. The layout
(:func:`~cosyserve.llm.prompt.layout_for_vocab_size`) says whether ``lm_head.bias`` exists: the
CosyVoice2 conversion requires it (stock transformers drops it; without it text tokens would get
finite logits and the trained speech biases would be lost), the CosyVoice3 one has none (the head
is then the window's rows with a zero bias).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ...errors import ModelLoadError
from ..prompt import COSYVOICE2, PromptLayout, layout_for_vocab_size
from .config import Qwen2Config
from .qwen2 import Qwen2SpeechLM


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors file in {model_dir}")
    return files


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, on the CPU in their stored dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def _layer_tensors(ckpt: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    src = f"model.layers.{i}."
    dst = f"layers.{i}."
    take = ckpt.pop
    return {
        dst + "input_layernorm.weight": take(src + "input_layernorm.weight"),
        dst + "post_attention_layernorm.weight": take(src + "post_attention_layernorm.weight"),
        dst + "self_attn.qkv_proj.weight": torch.cat(
            [take(src + f"self_attn.{p}_proj.weight") for p in "qkv"]),
        dst + "self_attn.qkv_proj.bias": torch.cat([take(src + f"self_attn.{p}_proj.bias") for p in "qkv"]),
        dst + "self_attn.o_proj.weight": take(src + "self_attn.o_proj.weight"),
        dst + "mlp.gate_up_proj.weight": torch.cat([take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]),
        dst + "mlp.down_proj.weight": take(src + "mlp.down_proj.weight"),
    }


def map_checkpoint(ckpt: dict[str, torch.Tensor], config: Qwen2Config,
                   layout: PromptLayout = COSYVOICE2) -> dict[str, torch.Tensor]:
    """HF names -> this model's names (fused projections, windowed head). Consumes ``ckpt``."""
    ckpt = dict(ckpt)
    if layout.head_bias and "lm_head.bias" not in ckpt:
        raise ModelLoadError(f"checkpoint has no lm_head.bias: the {layout.name} LLM head needs its bias "
                             "(-inf outside the speech rows); was it saved by a loader that dropped it?")
    if not layout.head_bias and "lm_head.bias" in ckpt:
        raise ModelLoadError(f"checkpoint has an lm_head.bias; the {layout.name} conversion writes none")
    window = slice(layout.speech_token_offset, layout.speech_token_offset + layout.output_window_size)
    try:
        head = ckpt.pop("lm_head.weight")[window].float()
        state = {"embed_tokens.weight": ckpt.pop("model.embed_tokens.weight"),
                 "norm.weight": ckpt.pop("model.norm.weight"),
                 "head.weight": head,
                 "head.bias": ckpt.pop("lm_head.bias")[window].float() if layout.head_bias else head.new_zeros(len(head))}
        for i in range(config.num_layers):
            state.update(_layer_tensors(ckpt, i))
    except KeyError as exc:
        raise ModelLoadError(f"checkpoint is missing tensor {exc}") from exc
    if ckpt:
        raise ModelLoadError(f"checkpoint has tensors this Qwen2 model does not use: {sorted(ckpt)[:8]}")
    if not torch.isfinite(state["head.bias"]).all():
        raise ModelLoadError("lm_head.bias is not finite on the speech/eos rows")
    return state


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype, max_positions: int,
               config: Qwen2Config | None = None) -> Qwen2SpeechLM:
    config = config or Qwen2Config.from_model_dir(model_dir)
    layout = layout_for_vocab_size(config.vocab_size)
    state = map_checkpoint(read_checkpoint(model_dir), config, layout)
    model = Qwen2SpeechLM(config, max_positions, device, dtype, layout.output_window_size)
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not match config "
                                 f"shape {tuple(expected[name].shape)}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"checkpoint does not match the Qwen2 config: {exc}") from exc
    return model.eval().requires_grad_(False)
