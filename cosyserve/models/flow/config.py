"""Hyper-parameters of the CosyVoice2 flow (``CausalMaskedDiffWithXvec``) and where they come from.

Three sources describe the same network: the released ``cosyvoice2.yaml`` (HyperPyYAML, read
through :func:`cosyserve.config.load_hyperpyyaml`), the parity fixtures' ``flow_tiny_config.json``
and the real-size manifest. All of them go through :meth:`FlowConfig.from_sections`. Defaults are
the released CosyVoice2-0.5B values, so a missing key means "as released".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...config import Ref, Tagged, plain, tagged_kwargs
from ...errors import ModelLoadError

FLOW_CLASS = "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
ENCODER_CLASS = "cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder"
CFM_CLASS = "cosyvoice.flow.flow_matching.CausalConditionalCFM"
ESTIMATOR_CLASS = "cosyvoice.flow.decoder.CausalConditionalDecoder"
# Older model-repo revisions name the estimator ConditionalDecoder with ``causal: True``.
LEGACY_ESTIMATOR_CLASS = "ConditionalDecoder"

# Upstream hard-codes these parts of the encoder (not constructor arguments, so not in the YAML).
NUM_UP_BLOCKS = 4
UP_STRIDE = 2


@dataclass(frozen=True)
class EncoderConfig:
    """``UpsampleConformerEncoder`` arguments. Dropouts are recorded for round trips only (eval)."""

    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    dropout_rate: float = 0.1
    positional_dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    normalize_before: bool = True
    input_layer: str = "linear"
    pos_enc_layer_type: str = "rel_pos_espnet"
    selfattention_layer_type: str = "rel_selfattn"
    use_cnn_module: bool = False
    macaron_style: bool = False
    static_chunk_size: int = 25


@dataclass(frozen=True)
class EstimatorConfig:
    """``CausalConditionalDecoder`` arguments (the CFM vector-field network)."""

    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    dropout: float = 0.0
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50
    num_decoding_left_chunks: int = -1


@dataclass(frozen=True)
class CFMConfig:
    """``CausalConditionalCFM`` arguments, ``cfm_params`` flattened in."""

    in_channels: int = 240
    n_spks: int = 1
    spk_emb_dim: int = 80
    sigma_min: float = 1e-6
    solver: str = "euler"
    t_scheduler: str = "cosine"
    training_cfg_rate: float = 0.2
    inference_cfg_rate: float = 0.7
    reg_loss_type: str = "l1"


_CFM_PARAMS = ("sigma_min", "solver", "t_scheduler", "training_cfg_rate", "inference_cfg_rate", "reg_loss_type")


@dataclass(frozen=True)
class FlowConfig:
    """``CausalMaskedDiffWithXvec`` arguments plus its nested encoder / CFM / estimator."""

    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    output_type: str = "mel"
    vocab_size: int = 6561
    input_frame_rate: int = 25
    only_mask_loss: bool = True
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def real(cls) -> FlowConfig:
        """The released CosyVoice2-0.5B flow."""
        return cls()

    @classmethod
    def tiny(cls) -> FlowConfig:
        """The shrunk architecture of the parity fixtures: builds and runs in milliseconds on a CPU."""
        return cls(
            input_size=64,
            encoder=EncoderConfig(input_size=64, output_size=64, attention_heads=2, linear_units=128, num_blocks=2),
            estimator=EstimatorConfig(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2, num_heads=2),
        )

    @classmethod
    def from_sections(cls, flow: dict, encoder: dict, cfm: dict, estimator: dict) -> FlowConfig:
        """Build from plain kwargs dicts; ``cfm`` may nest the CFM settings under ``cfm_params``."""
        cfm = {**{k: v for k, v in cfm.items() if k != "cfm_params"}, **plain(cfm.get("cfm_params") or {})}
        return cls(
            **_fields(cls, flow, "flow", skip=("encoder", "cfm", "estimator")),
            encoder=EncoderConfig(**_fields(EncoderConfig, encoder, "flow.encoder")),
            cfm=CFMConfig(**_fields(CFMConfig, cfm, "flow.decoder")),
            estimator=EstimatorConfig(**_fields(EstimatorConfig, estimator, "flow.decoder.estimator")),
        )

    @classmethod
    def from_yaml_tree(cls, tree: dict) -> FlowConfig:
        """Read the top-level ``flow`` node of a parsed ``cosyvoice2.yaml``."""
        if "flow" not in tree:
            raise ModelLoadError("config has no top-level 'flow' node")
        flow = tagged_kwargs(tree["flow"], FLOW_CLASS.rsplit(".", 1)[-1], "flow")
        encoder = _optional_node(flow, "encoder", ENCODER_CLASS, "flow.encoder")
        cfm = _optional_node(flow, "decoder", CFM_CLASS, "flow.decoder")
        estimator = _optional_node(
            cfm, "estimator", (ESTIMATOR_CLASS, LEGACY_ESTIMATOR_CLASS), "flow.decoder.estimator"
        )
        estimator_node = cfm.get("estimator")
        if isinstance(estimator_node, Tagged) and estimator_node.class_name == LEGACY_ESTIMATOR_CLASS:
            if estimator.get("causal") is not True:
                raise ModelLoadError(
                    "flow.decoder.estimator: ConditionalDecoder without 'causal: True' is the non-causal "
                    "CosyVoice 1 estimator; only the causal CosyVoice2 network is supported"
                )
        return cls.from_sections(flow, encoder, cfm, estimator)

    @classmethod
    def from_fixture_json(cls, d: dict) -> FlowConfig:
        """Read a parity fixture's ``flow_tiny_config.json`` (constructor kwargs by upstream class)."""
        try:
            encoder, decoder = d["encoder"], d["decoder"]
            config = cls.from_sections(
                d["kwargs"], encoder["kwargs"], decoder["kwargs"], decoder["estimator"]["kwargs"]
            )
        except KeyError as exc:
            raise ModelLoadError(f"flow fixture config lacks {exc}") from exc
        check_fixed_encoder_parts(
            config,
            pre_lookahead=encoder.get("pre_lookahead_layer", {}).get("kwargs", {}),
            up_layer=encoder.get("up_layer", {}).get("kwargs", {}),
            num_up_blocks=encoder.get("num_up_blocks", NUM_UP_BLOCKS),
        )
        return config

    def to_yaml_node(self) -> Tagged:
        """The upstream-style ``!new:`` node; ``from_yaml_tree({'flow': node})`` gives this config back."""
        nested = ("encoder", "cfm", "estimator")
        flow = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in nested}
        cfm = dataclasses.asdict(self.cfm)
        cfm_params = {name: cfm.pop(name) for name in _CFM_PARAMS}
        estimator = dataclasses.asdict(self.estimator)
        estimator["channels"] = list(self.estimator.channels)  # YAML has no tuples
        decoder = Tagged("new", CFM_CLASS, kwargs={
            **cfm,
            "cfm_params": Tagged("new", "omegaconf.DictConfig", kwargs={"content": cfm_params}),
            "estimator": Tagged("new", ESTIMATOR_CLASS, kwargs=estimator),
        })
        encoder = Tagged("new", ENCODER_CLASS, kwargs=dataclasses.asdict(self.encoder))
        return Tagged("new", FLOW_CLASS, kwargs={**flow, "encoder": encoder, "decoder": decoder})


def check_fixed_encoder_parts(config: FlowConfig, pre_lookahead: dict, up_layer: dict, num_up_blocks: int) -> None:
    """Reject descriptions whose hard-coded encoder parts differ from what this code builds."""
    width, lookahead = config.encoder.output_size, config.pre_lookahead_len
    expected = {
        "pre-lookahead in_channels": (pre_lookahead.get("in_channels", width), width),
        "pre-lookahead channels": (pre_lookahead.get("channels", width), width),
        "pre-lookahead length": (pre_lookahead.get("pre_lookahead_len", lookahead), lookahead),
        "up-layer channels": (up_layer.get("channels", width), width),
        "up-layer out_channels": (up_layer.get("out_channels", width), width),
        "up-layer stride": (up_layer.get("stride", UP_STRIDE), UP_STRIDE),
        "number of up-blocks": (num_up_blocks, NUM_UP_BLOCKS),
    }
    wrong = [f"{name} {got} (supported: {want})" for name, (got, want) in expected.items() if got != want]
    if wrong:
        raise ModelLoadError("unsupported flow encoder layout: " + "; ".join(wrong))


def _optional_node(parent: dict, key: str, expected_class: str | tuple[str, ...], where: str) -> dict:
    if key not in parent:
        return {}
    names = (expected_class,) if isinstance(expected_class, str) else expected_class
    return tagged_kwargs(parent[key], tuple(n.rsplit(".", 1)[-1] for n in names), where)


def _fields(cls: type, values: dict, where: str, skip: tuple[str, ...] = ()) -> dict:
    """Pick the dataclass' fields out of ``values`` (other keys are ignored), coercing types."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in skip}
    return {name: _coerce(values[name], defaults[name], f"{where}.{name}") for name in defaults if name in values}


def _coerce(value: Any, default: Any, where: str) -> Any:
    if isinstance(value, Ref):
        raise ModelLoadError(f"{where}: unresolved reference {value.expr!r}")
    try:
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError
            return value
        if isinstance(default, int):
            if isinstance(value, bool) or not float(value).is_integer():
                raise TypeError
            return int(value)
        if isinstance(default, float):
            # PyYAML reads "1e-06" (no dot) as a string; upstream's YAML relies on that being a float.
            return float(value)
        if isinstance(default, tuple):
            return tuple(_coerce(v, default[0], where) for v in value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: expected a {type(default).__name__}, got {value!r}") from exc


def _validate(c: FlowConfig) -> None:
    e, s, m = c.encoder, c.estimator, c.cfm
    problems = [
        (e.input_size == c.input_size, f"encoder.input_size {e.input_size} != token embedding size {c.input_size}"),
        (e.output_size % e.attention_heads == 0,
         f"encoder width {e.output_size} not divisible by {e.attention_heads} heads"),
        (e.input_layer == "linear", f"encoder input_layer {e.input_layer!r} (supported: 'linear')"),
        (e.pos_enc_layer_type == "rel_pos_espnet",
         f"pos_enc_layer_type {e.pos_enc_layer_type!r} (supported: 'rel_pos_espnet')"),
        (e.selfattention_layer_type == "rel_selfattn",
         f"selfattention_layer_type {e.selfattention_layer_type!r} (supported: 'rel_selfattn')"),
        (e.normalize_before and not e.use_cnn_module and not e.macaron_style,
         "encoder must be pre-norm without convolution module or macaron FFN"),
        (e.static_chunk_size > 0, f"encoder static_chunk_size must be positive, got {e.static_chunk_size}"),
        (c.token_mel_ratio == UP_STRIDE,
         f"token_mel_ratio {c.token_mel_ratio} (the encoder up-samples by {UP_STRIDE})"),
        (c.pre_lookahead_len > 0, f"pre_lookahead_len must be positive, got {c.pre_lookahead_len}"),
        (c.output_size == 80, f"output_size {c.output_size} (the fixed CFM noise buffer has 80 mel channels)"),
        (m.spk_emb_dim == c.output_size, f"cfm spk_emb_dim {m.spk_emb_dim} != output_size {c.output_size}"),
        (m.solver == "euler", f"cfm solver {m.solver!r} (supported: 'euler')"),
        (m.t_scheduler in ("cosine", "linear"), f"cfm t_scheduler {m.t_scheduler!r} (supported: 'cosine', 'linear')"),
        (s.in_channels == 4 * c.output_size,
         f"estimator in_channels {s.in_channels} != 4 * output_size (x, mu, spk, cond)"),
        (s.in_channels % 2 == 0, "estimator in_channels must be even (sinusoidal time embedding)"),
        (s.out_channels == c.output_size, f"estimator out_channels {s.out_channels} != output_size {c.output_size}"),
        (len(s.channels) == 1, f"estimator channels {list(s.channels)} (supported: a single entry, as released)"),
        (s.act_fn == "gelu", f"estimator act_fn {s.act_fn!r} (supported: 'gelu')"),
        (s.static_chunk_size > 0, f"estimator static_chunk_size must be positive, got {s.static_chunk_size}"),
    ]
    wrong = [message for ok, message in problems if not ok]
    if wrong:
        raise ModelLoadError("unsupported flow config: " + "; ".join(wrong))
