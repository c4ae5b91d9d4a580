"""The hyper-parameters the torch engine needs, read from a HuggingFace ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...errors import ModelLoadError


@dataclass(frozen=True)
class Qwen2Config:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Qwen2Config":
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "Qwen2Config":
        if raw.get("model_type") != "qwen2":
            raise ModelLoadError(f"{source}: model_type is {raw.get('model_type')!r}; only qwen2 is supported")
        # Features of the Qwen2 family this engine does not implement must be off.
        if raw.get("use_sliding_window"):
            raise ModelLoadError(f"{source}: use_sliding_window=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("tie_word_embeddings", False):
            raise ModelLoadError(f"{source}: tie_word_embeddings=true; the CosyVoice2 LLM has its own lm_head")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelLoadError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            return cls(
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing key {exc}") from exc

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}")
