"""The ``cosyvoice2.yaml`` / ``cosyvoice3.yaml`` of a random-weight bundle."""

from __future__ import annotations

from pathlib import Path

from ..config import Tagged, dump_hyperpyyaml
from ..schedule import OUTPUT_SAMPLE_RATE


def write_model_yaml(path: Path, flow_cfg, hift_cfg, llm_class: str = "cosyvoice.llm.llm.Qwen2LM") -> None:
    """A cosyvoice2.yaml / cosyvoice3.yaml with the given flow and HiFT (and the LLM's class name)."""
    tree = {
        "sample_rate": OUTPUT_SAMPLE_RATE,
        "llm_input_size": 896,
        "llm_output_size": 896,
        "spk_embed_dim": 192,
        "token_frame_rate": 25,
        "token_mel_ratio": 2,
        "chunk_size": 25,
        "num_decoding_left_chunks": -1,
        "flow": flow_cfg.to_yaml_node(),
        "hift": hift_cfg.to_yaml_node(),
        # The LLM is served from the HuggingFace-format directory; this entry only mirrors the
        # released file so that tools which look for it find the class name.
        "llm": Tagged("new", llm_class, kwargs={
            "llm_input_size": 896, "llm_output_size": 896, "speech_token_size": 6561}),
    }
    dump_hyperpyyaml(tree, path)
