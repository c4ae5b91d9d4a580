"""Hyper-parameters of the Step-Audio-2-mini DiT flow (``token2wav/flow.yaml``).

The released ``flow.yaml`` builds four upstream classes through HyperPyYAML tags. We never
execute them: :meth:`StepAudio2FlowConfig.from_yaml_tree` reads the tag arguments from the safe
parse of :func:`cosyserve.config.load_hyperpyyaml`, and :meth:`StepAudio2FlowConfig.to_yaml_node`
writes an equivalent tree back. Options this implementation does not support are rejected
with :class:`ModelLoadError` instead of being silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosyserve.config import Tagged, checked_kwargs, tagged_kwargs
from cosyserve.errors import ModelLoadError

FLOW_TAG = "cosyvoice2.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_TAG = "cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2"
CFM_TAG = "cosyvoice2.flow.flow_matching.CausalConditionalCFM"
ESTIMATOR_TAG = "cosyvoice2.flow.decoder_dit.DiT"

# Options whose value is fixed by this implementation: any other value is a different model.
_ENCODER_FIXED = {
    "input_layer": "linear",
    "pos_enc_layer_type": "rel_pos_espnet",
    "selfattention_layer_type": "rel_selfattn",
    "key_bias": True,
    "normalize_before": True,
    "activation_type": "swish",
    "macaron_style": False,
    "use_cnn_module": False,
    "up_stride": 2,
    "up_scale_factor": 2,
}
# Training-only options: accepted and ignored (dropout is inactive at inference).
_ENCODER_INERT = {"dropout_rate", "positional_dropout_rate", "attention_dropout_rate",
                  "gradient_checkpointing", "use_dynamic_chunk", "use_dynamic_left_chunk",
                  "static_chunk_size"}
_FLOW_FIXED = {"output_type": "mel"}
_FLOW_INERT = {"input_frame_rate", "only_mask_loss", "token_mel_ratio", "pre_lookahead_len"}
_CFM_INERT = {"training_cfg_rate", "sigma_min", "t_scheduler", "solver", "in_channels",
              "n_spks", "spk_emb_dim"}


@dataclass(frozen=True)
class StepAudio2EncoderConfig:
    """``UpsampleConformerEncoderV2``: token-rate Conformer stack, ×2 up-sampling, frame-rate stack."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_rate: int = 2  # frames per token (the YAML's up_stride == up_scale_factor)
    dropout_rate: float = 0.1  # kept only to write the YAML back
    # Length of the relative-position table (upstream precomputes 5000 positions and never
    # extends it in chunk mode): the most frames one stream may ever hold, prompt included.
    max_positions: int = 5000

    @property
    def head_dim(self) -> int:
        return self.output_size // self.attention_heads


@dataclass(frozen=True)
class StepAudio2EstimatorConfig:
    """``DiT`` estimator: adaLN-Zero transformer blocks with a causal-conv sub-block."""

    in_channels: int = 320
    out_channels: int = 80
    hidden_size: int = 512
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


@dataclass(frozen=True)
class StepAudio2FlowConfig:
    """``CausalMaskedDiffWithXvec`` with its encoder, CFM and DiT estimator."""

    vocab_size: int = 6561
    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10  # fixed by the runtime, not in flow.yaml
    noise_frames: int = 30000  # length of the fixed streaming noise buffer
    encoder: StepAudio2EncoderConfig = field(default_factory=StepAudio2EncoderConfig)
    estimator: StepAudio2EstimatorConfig = field(default_factory=StepAudio2EstimatorConfig)

    def __post_init__(self) -> None:
        est = self.estimator
        problems = []
        if self.encoder.input_size != self.input_size:
            problems.append(f"encoder.input_size {self.encoder.input_size} != input_size {self.input_size}")
        if self.encoder.output_size % self.encoder.attention_heads:
            problems.append("encoder.output_size must be divisible by attention_heads")
        if est.in_channels != 4 * self.output_size:
            problems.append(f"estimator.in_channels {est.in_channels} != 4 x output_size {self.output_size} "
                            "(x, mu, spks, cond are concatenated)")
        if est.out_channels != self.output_size:
            problems.append(f"estimator.out_channels {est.out_channels} != output_size {self.output_size}")
        if problems:
            raise ModelLoadError("inconsistent Step-Audio2 flow config: " + "; ".join(problems))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def real(cls) -> "StepAudio2FlowConfig":
        """The released Step-Audio-2-mini configuration."""
        return cls()

    @classmethod
    def from_yaml_tree(cls, tree: Any) -> "StepAudio2FlowConfig":
        """Read a parsed ``flow.yaml`` (the whole tree or its ``flow`` node)."""
        node = tree["flow"] if isinstance(tree, dict) and "flow" in tree else tree
        flow = checked_kwargs(tagged_kwargs(node, "CausalMaskedDiffWithXvec", "flow"), "flow",
                              required={"input_size", "output_size", "spk_embed_dim", "vocab_size", "encoder",
                                        "decoder"}, fixed=_FLOW_FIXED, inert=_FLOW_INERT)
        enc = checked_kwargs(tagged_kwargs(flow["encoder"], "UpsampleConformerEncoderV2", "flow.encoder"),
                             "flow.encoder",
                             required={"input_size", "output_size", "attention_heads", "linear_units",
                                       "num_blocks", "num_up_blocks", "pre_lookahead_len"},
                             fixed=_ENCODER_FIXED, inert=_ENCODER_INERT)
        cfm = checked_kwargs(tagged_kwargs(flow["decoder"], "CausalConditionalCFM", "flow.decoder"), "flow.decoder",
                             required={"inference_cfg_rate", "estimator"}, fixed={}, inert=_CFM_INERT)
        est = checked_kwargs(tagged_kwargs(cfm["estimator"], "DiT", "flow.decoder.estimator"), "flow.decoder.estimator",
                             required={"in_channels", "out_channels", "hidden_size", "depth", "num_heads", "head_dim",
                                       "mlp_ratio"}, fixed={}, inert=set())
        return cls._from_dicts(flow, enc, cfm, est)

    @classmethod
    def from_fixture_json(cls, path_or_dict: str | Path | dict) -> "StepAudio2FlowConfig":
        """Read the ``flow_hparams`` block of a parity fixture's ``tiny_config.json``."""
        data = path_or_dict if isinstance(path_or_dict, dict) else json.loads(Path(path_or_dict).read_text())
        hp = data.get("flow_hparams", data)
        try:
            return cls._from_dicts(hp, hp["encoder"], hp["decoder"], hp["decoder"]["estimator"])
        except KeyError as exc:
            raise ModelLoadError(f"fixture config lacks {exc}") from exc

    @classmethod
    def _from_dicts(cls, flow: dict, enc: dict, cfm: dict, est: dict) -> "StepAudio2FlowConfig":
        try:
            return cls(
                vocab_size=int(flow["vocab_size"]),
                input_size=int(flow["input_size"]),
                output_size=int(flow["output_size"]),
                spk_embed_dim=int(flow["spk_embed_dim"]),
                inference_cfg_rate=float(cfm["inference_cfg_rate"]),
                encoder=StepAudio2EncoderConfig(
                    input_size=int(enc["input_size"]),
                    output_size=int(enc["output_size"]),
                    attention_heads=int(enc["attention_heads"]),
                    linear_units=int(enc["linear_units"]),
                    num_blocks=int(enc["num_blocks"]),
                    num_up_blocks=int(enc["num_up_blocks"]),
                    pre_lookahead_len=int(enc["pre_lookahead_len"]),
                    dropout_rate=float(enc.get("dropout_rate", 0.1)),
                ),
                estimator=StepAudio2EstimatorConfig(
                    in_channels=int(est["in_channels"]),
                    out_channels=int(est["out_channels"]),
                    hidden_size=int(est["hidden_size"]),
                    depth=int(est["depth"]),
                    num_heads=int(est["num_heads"]),
                    head_dim=int(est["head_dim"]),
                    mlp_ratio=float(est["mlp_ratio"]),
                ),
            )
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"bad value in Step-Audio2 flow config: {exc}") from exc

    # ------------------------------------------------------------------ writer
    def to_yaml_node(self) -> Tagged:
        """The ``flow`` node of an equivalent ``flow.yaml`` (write it with
        ``dump_hyperpyyaml({"flow": cfg.to_yaml_node()}, path)``)."""
        enc, est = self.encoder, self.estimator
        encoder = Tagged("new", ENCODER_TAG, kwargs={
            "input_size": enc.input_size,
            "output_size": enc.output_size,
            "input_layer": "linear",
            "pre_lookahead_len": enc.pre_lookahead_len,
            "num_blocks": enc.num_blocks,
            "num_up_blocks": enc.num_up_blocks,
            "up_stride": enc.up_rate,
            "up_scale_factor": enc.up_rate,
            "attention_heads": enc.attention_heads,
            "pos_enc_layer_type": "rel_pos_espnet",
            "selfattention_layer_type": "rel_selfattn",
            "key_bias": True,
            "linear_units": enc.linear_units,
            "dropout_rate": enc.dropout_rate,
            "positional_dropout_rate": enc.dropout_rate,
            "attention_dropout_rate": enc.dropout_rate,
            "normalize_before": True,
        })
        estimator = Tagged("new", ESTIMATOR_TAG, kwargs={
            "in_channels": est.in_channels,
            "out_channels": est.out_channels,
            "mlp_ratio": est.mlp_ratio,
            "depth": est.depth,
            "num_heads": est.num_heads,
            "head_dim": est.head_dim,
            "hidden_size": est.hidden_size,
        })
        decoder = Tagged("new", CFM_TAG, kwargs={"inference_cfg_rate": self.inference_cfg_rate,
                                                 "estimator": estimator})
        return Tagged("new", FLOW_TAG, kwargs={
            "input_size": self.input_size,
            "output_size": self.output_size,
            "spk_embed_dim": self.spk_embed_dim,
            "output_type": "mel",
            "vocab_size": self.vocab_size,
            "encoder": encoder,
            "decoder": decoder,
        })
