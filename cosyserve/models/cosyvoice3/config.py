"""Hyper-parameters of the CosyVoice3 token2wav models (``cosyvoice3.yaml``: ``flow`` and ``hift``).

The released yaml builds upstream classes through HyperPyYAML tags; like the other model
configs of this package we never execute them: the tag arguments are read from the safe parse
of :func:`cosyserve.config.load_hyperpyyaml` and written back by ``to_yaml_node``. Options this
implementation does not support are rejected with :class:`ModelLoadError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ...config import Tagged, checked_kwargs, load_hyperpyyaml, tagged_kwargs
from ...errors import ModelLoadError
from ..hift.config import HiftConfig

FLOW_CLASS = "cosyvoice.flow.flow.CausalMaskedDiffWithDiT"
PRE_LOOKAHEAD_CLASS = "cosyvoice.transformer.upsample_encoder.PreLookaheadLayer"
CFM_CLASS = "cosyvoice.flow.flow_matching.CausalConditionalCFM"
ESTIMATOR_CLASS = "cosyvoice.flow.DiT.dit.DiT"
HIFT_CLASS = "cosyvoice.hifigan.generator.CausalHiFTGenerator"
F0_PREDICTOR_CLASS = "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor"
CONFIG_FILE = "cosyvoice3.yaml"
# The prompt mel's upper band edge: cosyvoice3.yaml (and the reference runtime) pass fmax=None, i.e. the
# Nyquist frequency (12 kHz), where CosyVoice2 used 8 kHz; the other Matcha mel settings are the same.
PROMPT_MEL_FMAX = None

# Training-only or derived arguments: accepted and not used at inference.
_FLOW_INERT = {"output_type", "input_frame_rate", "only_mask_loss"}
_CFM_INERT = {"in_channels", "n_spks", "spk_emb_dim"}
_CFM_PARAMS_INERT = {"sigma_min", "training_cfg_rate", "reg_loss_type"}
_CFM_PARAMS_FIXED = {"solver": "euler", "t_scheduler": "cosine"}  # what Cv3CFM implements
_ESTIMATOR_INERT = {"num_decoding_left_chunks", "dropout", "long_skip_connection"}


@dataclass(frozen=True)
class Cv3EstimatorConfig:
    """The DiT velocity estimator (upstream ``cosyvoice.flow.DiT.dit.DiT``)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # frames per attention block in streaming mode (25 tokens x 2)

    @property
    def inner_dim(self) -> int:
        return self.heads * self.dim_head


@dataclass(frozen=True)
class Cv3FlowConfig:
    """``CausalMaskedDiffWithDiT``: token embedding, pre-look-ahead conv, CFM with a DiT estimator."""

    vocab_size: int = 6561
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    inference_cfg_rate: float = 0.7
    estimator: Cv3EstimatorConfig = field(default_factory=Cv3EstimatorConfig)

    def __post_init__(self) -> None:
        est, problems = self.estimator, []
        if self.input_size != self.output_size:
            problems.append(f"input_size {self.input_size} != output_size {self.output_size} (the pre-look-ahead "
                            "output is the decoder condition mu)")
        if (est.mel_dim, est.mu_dim, est.out_channels) != (self.output_size,) * 3 or est.spk_dim != self.output_size:
            problems.append(f"estimator mel/mu/spk/out dims must all be {self.output_size}")
        if est.dim % 16:
            problems.append(f"estimator dim {est.dim} must be a multiple of 16 (grouped position convolution)")
        if problems:
            raise ModelLoadError("inconsistent CosyVoice3 flow config: " + "; ".join(problems))

    @classmethod
    def real(cls) -> "Cv3FlowConfig":
        """Fun-CosyVoice3-0.5B-2512."""
        return cls()

    @classmethod
    def tiny(cls) -> "Cv3FlowConfig":
        """The architecture at the parity fixtures' tiny size."""
        return cls(pre_lookahead_channels=32, estimator=Cv3EstimatorConfig(dim=64, depth=2, heads=2, dim_head=16))

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_yaml_tree(cls, tree: dict) -> "Cv3FlowConfig":
        """From a parsed ``cosyvoice3.yaml`` (its ``flow`` node)."""
        if "flow" not in tree:
            raise ModelLoadError("cosyvoice3.yaml has no 'flow' node")
        flow = dict(tagged_kwargs(tree["flow"], "CausalMaskedDiffWithDiT", "flow"))
        lookahead = tagged_kwargs(flow.pop("pre_lookahead_layer", None), "PreLookaheadLayer",
                                  "flow.pre_lookahead_layer")
        cfm = dict(tagged_kwargs(flow.pop("decoder", None), "CausalConditionalCFM", "flow.decoder"))
        estimator = tagged_kwargs(cfm.pop("estimator", None), "DiT", "flow.decoder.estimator")
        params = cfm.pop("cfm_params", None)
        if isinstance(params, Tagged):  # !new:omegaconf.DictConfig {content: {...}}
            params = params.kwargs.get("content", params.args[0] if params.args else None)
        if not isinstance(params, dict):
            raise ModelLoadError("flow.decoder.cfm_params must be a mapping")
        return cls._from_dicts(flow, lookahead, cfm, params, estimator)

    @classmethod
    def from_fixture_json(cls, data: dict) -> "Cv3FlowConfig":
        """From ``flow_tiny_config.json`` (``kwargs`` per class) or a real-size manifest (``config``)."""
        try:
            if "config" in data:
                c = data["config"]
                cfm = dict(c["cfm"])
                return cls._from_dicts(c["flow"], c["pre_lookahead_layer"], cfm, cfm.pop("cfm_params"), c["estimator"])
            decoder = dict(data["decoder"]["kwargs"])
            return cls._from_dicts(data["kwargs"], data["pre_lookahead_layer"]["kwargs"], decoder,
                                   decoder.pop("cfm_params"), data["decoder"]["estimator"]["kwargs"])
        except KeyError as exc:
            raise ModelLoadError(f"CosyVoice3 flow description lacks {exc}") from exc

    @classmethod
    def _from_dicts(cls, flow: dict, lookahead: dict, cfm: dict, params: dict, est: dict) -> "Cv3FlowConfig":
        for where, section in (("flow", flow), ("flow.pre_lookahead_layer", lookahead), ("flow.decoder", cfm),
                               ("flow.decoder.cfm_params", params), ("flow.decoder.estimator", est)):
            if not isinstance(section, dict):
                raise ModelLoadError(f"{where}: expected a mapping, got {section!r}")
        checked_kwargs(flow, "flow", required={"input_size", "output_size", "spk_embed_dim", "vocab_size",
                                               "token_mel_ratio", "pre_lookahead_len"}, fixed={}, inert=_FLOW_INERT)
        checked_kwargs(lookahead, "flow.pre_lookahead_layer", required={"in_channels", "channels", "pre_lookahead_len"},
                       fixed={}, inert=set())
        checked_kwargs(cfm, "flow.decoder", required=set(), fixed={}, inert=_CFM_INERT)
        checked_kwargs(params, "flow.decoder.cfm_params", required={"inference_cfg_rate"}, fixed=_CFM_PARAMS_FIXED,
                       inert=_CFM_PARAMS_INERT)
        checked_kwargs(est, "flow.decoder.estimator",
                       required={"dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim", "mu_dim", "spk_dim",
                                 "out_channels", "static_chunk_size"}, fixed={}, inert=_ESTIMATOR_INERT)
        if int(lookahead["in_channels"]) != int(flow["input_size"]) or \
                int(lookahead["pre_lookahead_len"]) != int(flow["pre_lookahead_len"]):
            raise ModelLoadError("flow.pre_lookahead_layer must take input_size channels and pre_lookahead_len frames")
        try:
            return cls(
                vocab_size=int(flow["vocab_size"]),
                input_size=int(flow["input_size"]),
                output_size=int(flow["output_size"]),
                spk_embed_dim=int(flow["spk_embed_dim"]),
                token_mel_ratio=int(flow["token_mel_ratio"]),
                pre_lookahead_len=int(flow["pre_lookahead_len"]),
                pre_lookahead_channels=int(lookahead["channels"]),
                inference_cfg_rate=float(params["inference_cfg_rate"]),
                estimator=Cv3EstimatorConfig(**{k: int(est[k]) for k in (
                    "dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim", "mu_dim", "spk_dim", "out_channels",
                    "static_chunk_size")}),
            )
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"bad value in CosyVoice3 flow config: {exc}") from exc

    # ------------------------------------------------------------------ writer
    def to_yaml_node(self) -> Tagged:
        """The ``flow:`` node of an equivalent ``cosyvoice3.yaml``."""
        est = self.estimator
        estimator = Tagged("new", ESTIMATOR_CLASS, kwargs={
            "dim": est.dim, "depth": est.depth, "heads": est.heads, "dim_head": est.dim_head, "ff_mult": est.ff_mult,
            "mel_dim": est.mel_dim, "mu_dim": est.mu_dim, "spk_dim": est.spk_dim, "out_channels": est.out_channels,
            "static_chunk_size": est.static_chunk_size, "num_decoding_left_chunks": -1})
        cfm_params = Tagged("new", "omegaconf.DictConfig", kwargs={"content": {
            "sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine", "training_cfg_rate": 0.2,
            "inference_cfg_rate": self.inference_cfg_rate, "reg_loss_type": "l1"}})
        decoder = Tagged("new", CFM_CLASS, kwargs={
            "in_channels": 3 * self.output_size, "n_spks": 1, "spk_emb_dim": self.output_size,
            "cfm_params": cfm_params, "estimator": estimator})
        lookahead = Tagged("new", PRE_LOOKAHEAD_CLASS, kwargs={
            "in_channels": self.input_size, "channels": self.pre_lookahead_channels,
            "pre_lookahead_len": self.pre_lookahead_len})
        return Tagged("new", FLOW_CLASS, kwargs={
            "input_size": self.input_size, "output_size": self.output_size, "spk_embed_dim": self.spk_embed_dim,
            "output_type": "mel", "vocab_size": self.vocab_size, "input_frame_rate": 25, "only_mask_loss": True,
            "token_mel_ratio": self.token_mel_ratio, "pre_lookahead_len": self.pre_lookahead_len,
            "pre_lookahead_layer": lookahead, "decoder": decoder})


@dataclass(frozen=True)
class CausalHiftConfig(HiftConfig):
    """``CausalHiFTGenerator``: the CosyVoice2 HiFT hyper-parameters plus the look-ahead of ``conv_pre``.

    The F0 predictor (``CausalConvRNNF0Predictor``) takes the same three arguments as CosyVoice2's.
    """

    conv_pre_look_right: int = 4

    @classmethod
    def from_yaml_tree(cls, tree: dict) -> "CausalHiftConfig":
        """From a parsed ``cosyvoice3.yaml`` (its ``hift`` node)."""
        if "hift" not in tree:
            raise ModelLoadError("cosyvoice3.yaml has no 'hift' node")
        kwargs = dict(tagged_kwargs(tree["hift"], "CausalHiFTGenerator", "cosyvoice3.yaml: hift"))
        f0_node = kwargs.pop("f0_predictor", None)
        f0 = None if f0_node is None else tagged_kwargs(f0_node, "CausalConvRNNF0Predictor",
                                                        "cosyvoice3.yaml: hift.f0_predictor")
        return cls.from_kwargs(kwargs, f0)

    def to_yaml_node(self) -> Tagged:
        generator, f0 = self.to_kwargs()
        generator["f0_predictor"] = Tagged("new", F0_PREDICTOR_CLASS, kwargs=f0)
        return Tagged("new", HIFT_CLASS, kwargs=generator)



Config = TypeVar("Config", Cv3FlowConfig, CausalHiftConfig)


def config_from_model_dir(model_dir: str | Path, kind: type[Config]) -> Config:
    """``kind`` read from ``model_dir/cosyvoice3.yaml``; the released values where the directory has none."""
    path = Path(model_dir) / CONFIG_FILE
    return kind.from_yaml_tree(load_hyperpyyaml(path)) if path.is_file() else kind.real()
