"""Random-weight HuggingFace-format CosyVoice2 and CosyVoice3 LLMs, built offline.

CosyVoice2 (``cosyvoice2_llm/``) has what the released ``yuekai/cosyvoice2_llm`` has
(``llm_layout.md`` §2): ``config.json`` (Qwen2ForCausalLM, vocab 158336, untied head with bias),
``generation_config.json``, ``model.safetensors`` in bfloat16 with ``lm_head.bias`` (-inf outside
the speech+eos rows), and a tokenizer with the exact id layout and chat template.

CosyVoice3 (``cosyvoice3_llm/``) has what ``convert_cosyvoice3_to_hf.py`` writes
(``cosyvoice3_llm_layout.md`` §7): vocab 158720, eos ``<|eos1|>`` 158486, an lm_head without bias
(zero rows past the tokenizer), the converter's generation config and ``cosyvoice3_metadata.json``.

The tokenizers are a byte-level BPE trained here on a few sentences; the vocabulary is padded with
unreachable filler entries so that the special tokens land on their released ids. CosyVoice3's
260 phone tokens (ids 151664..151923) are named ``[phone_i]``: their released names are in no
prompt this package builds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..llm.prompt import (
    COSYVOICE2,
    COSYVOICE3,
    EOS_IDS,
    NUM_SPEECH_TOKENS,
    SOS,
    TASK,
    TOKENIZER_SIZE,
    PromptLayout,
    speech_token_string,
)

BASE_VOCAB_SIZE = 151643  # byte-level BPE entries before <|endoftext|>
ENDOFTEXT = "<|endoftext|>"
# The CosyVoice2 text tokenizer's additional special tokens, in its order; the first two already
# exist in the Qwen2 tokenizer, so <|endofprompt|> becomes 151646 and the length 151663.
ADDITIONAL_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)
EXTRA_TOKENS = ("<|eos1|>", "<|eos2|>", "<|eos3|>", SOS, TASK)
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# A user turn renders as <|sos|>content<|task_id|>, an assistant turn verbatim (§2.7).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '<|sos|>' + message['content'] + '<|task_id|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- message['content'] -}}"
    "{%- else -%}{{- raise_exception('only user and assistant messages are supported') -}}"
    "{%- endif -%}{%- endfor -%}"
)
# Text the small BPE is trained on: enough English and Chinese to give real merges.
TRAINING_TEXT = (
    "Hello, this is a speech synthesis test. The weather is nice today, so let us take a walk.",
    "We generate speech tokens from text, then turn the tokens into a waveform with a vocoder.",
    "Numbers like 2024 and 3.14 are read aloud; questions end with a question mark, right?",
    "希望你以后能够做的比我还好呦。今天天气很好，我们一起去公园散步吧。",
    "语音合成系统把文字转换成声音，大语言模型先生成语音标记，再由声码器生成波形。",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
)
TRAINED_VOCAB_SIZE = 1200

SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
    "real": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
}


def build_tokenizer() -> Tokenizer:
    """The byte-level BPE with the CosyVoice2 LLM id layout (length 158229)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)

    trained = json.loads(tokenizer.to_str())["model"]
    vocab = dict(trained["vocab"])
    merges = [tuple(pair) for pair in trained["merges"]]
    # Fillers: no merge produces them, so no text ever encodes to one of these ids.
    for index in range(len(vocab), BASE_VOCAB_SIZE):
        vocab[f"<|filler_{index}|>"] = index
    tokenizer.model = models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False)

    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in (ENDOFTEXT, *ADDITIONAL_SPECIAL_TOKENS)])
    tokenizer.add_tokens([AddedToken(speech_token_string(k), normalized=False) for k in range(NUM_SPEECH_TOKENS)]
                         + [AddedToken(t, normalized=False) for t in EXTRA_TOKENS])
    if tokenizer.get_vocab_size() != TOKENIZER_SIZE:
        raise AssertionError(f"tokenizer length {tokenizer.get_vocab_size()} != {TOKENIZER_SIZE}")
    return tokenizer


# CosyVoice3's text special tokens after CosyVoice2's: <|endofsystem|>, then 84 ARPAbet and 176 pinyin tokens.
NUM_COSYVOICE3_PHONE_TOKENS = 84 + 176
# Speech-head classes 6561..6564 have names of their own in the converted tokenizer (§7.1).
COSYVOICE3_RENAMED_CLASSES = {6561: "<|sos|>", 6562: "<|eos1|>", 6563: "<|task_id|>", 6564: "<|fill|>"}


def build_cosyvoice3_tokenizer() -> Tokenizer:
    """The same BPE with CosyVoice3's added tokens (length 158685): text specials to 151923, then
    the 6761 speech-head classes as ``<|s_k|>`` (four renamed)."""
    data = json.loads(build_tokenizer().to_str())
    data["added_tokens"] = []  # keep the BPE (151643 entries), rebuild the added tokens in CosyVoice3's order
    tokenizer = Tokenizer.from_str(json.dumps(data))
    specials = [ENDOFTEXT, *ADDITIONAL_SPECIAL_TOKENS, "<|endofsystem|>",
                *(f"[phone_{i}]" for i in range(NUM_COSYVOICE3_PHONE_TOKENS))]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(COSYVOICE3_RENAMED_CLASSES.get(k, speech_token_string(k)), normalized=False)
                          for k in range(COSYVOICE3.output_window_size)])
    if tokenizer.get_vocab_size() != COSYVOICE3.tokenizer_size:
        raise AssertionError(f"tokenizer length {tokenizer.get_vocab_size()} != {COSYVOICE3.tokenizer_size}")
    return tokenizer


TOKENIZER_BUILDERS = {COSYVOICE2.name: build_tokenizer, COSYVOICE3.name: build_cosyvoice3_tokenizer}


def write_tokenizer(out_dir: Path, layout: PromptLayout = COSYVOICE2) -> None:
    tokenizer = TOKENIZER_BUILDERS[layout.name]()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # Every added token is listed, as save_pretrained does: loaders rebuild the added tokens from here.
    added = {
        str(token_id): {"content": token.content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": token.special}
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    special = {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT,
               "additional_special_tokens": [t.content for _, t in sorted(tokenizer.get_added_tokens_decoder().items())
                                             if t.special and t.content != ENDOFTEXT]}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "unk_token": None,
        **special,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def llm_config(size: str, layout: PromptLayout = COSYVOICE2) -> dict:
    """config.json contents: a Qwen2ForCausalLM with the layout's vocabulary and head."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    shape = SIZES[size]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **shape,
        "vocab_size": layout.vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": shape["num_hidden_layers"],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        **({"use_bias": True} if layout.head_bias else {}),  # the CosyVoice2 converter's marker for the lm_head bias
        "bos_token_id": 151643,
        "eos_token_id": layout.eos_id,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.3",  # the converter's era; newer transformers read it fine
    }


def random_state_dict(config: dict, seed: int, layout: PromptLayout = COSYVOICE2) -> dict[str, torch.Tensor]:
    """bfloat16 weights with unit-scale activations, so attention and every layer matter."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    kv_dim = config["num_key_value_heads"] * head_dim
    residual_scale = (2 * layers) ** -0.5  # keeps the residual stream from growing with depth

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std + mean).to(torch.bfloat16)

    def proj(out_features: int, in_features: int, scale: float = 1.0) -> torch.Tensor:
        return normal(out_features, in_features, std=scale * in_features ** -0.5)

    vocab = layout.vocab_size
    state = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": normal(hidden, std=0.1, mean=1.0),
            p + "post_attention_layernorm.weight": normal(hidden, std=0.1, mean=1.0),
            p + "self_attn.q_proj.weight": proj(hidden, hidden),
            p + "self_attn.q_proj.bias": normal(hidden, std=0.1),
            p + "self_attn.k_proj.weight": proj(kv_dim, hidden),
            p + "self_attn.k_proj.bias": normal(kv_dim, std=0.1),
            p + "self_attn.v_proj.weight": proj(kv_dim, hidden),
            p + "self_attn.v_proj.bias": normal(kv_dim, std=0.1),
            p + "self_attn.o_proj.weight": proj(hidden, hidden, residual_scale),
            p + "mlp.gate_proj.weight": proj(inter, hidden),
            p + "mlp.up_proj.weight": proj(inter, hidden),
            p + "mlp.down_proj.weight": proj(hidden, inter, residual_scale),
        })
    state["model.norm.weight"] = normal(hidden, std=0.1, mean=1.0)
    window = slice(layout.speech_token_offset, layout.speech_token_offset + layout.output_window_size)
    head = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    head[window] = proj(layout.output_window_size, hidden, scale=3.0)
    if layout.head_bias:
        # CosyVoice2: zero weight and -inf bias outside the speech+eos rows, as the converter writes it.
        bias = torch.full((vocab,), float("-inf"), dtype=torch.bfloat16)
        bias[window] = normal(layout.output_window_size, std=1.0)
        state["lm_head.bias"] = bias
    else:
        # CosyVoice3: text rows are the (tied) text embeddings, rows past the tokenizer stay zero.
        head[:layout.speech_token_offset] = state["model.embed_tokens.weight"][:layout.speech_token_offset]
    state["lm_head.weight"] = head
    return state


def _generation_config(layout: PromptLayout) -> dict:
    if layout.head_bias:
        return {"bos_token_id": 151643, "eos_token_id": list(EOS_IDS), "do_sample": True,
                "temperature": 1.0, "top_p": 0.8, "top_k": 25, "transformers_version": "4.51.3"}
    return {"eos_token_id": layout.eos_id, "pad_token_id": layout.eos_id, "temperature": 0.8, "top_p": 0.95,
            "top_k": 25, "repetition_penalty": 1.1, "max_new_tokens": 2048, "transformers_version": "4.51.3"}


def _cosyvoice3_metadata(layout: PromptLayout) -> dict:
    """``cosyvoice3_metadata.json`` as the converter writes it."""
    return {"original_vocab_size": 151646, "text_vocab_size": layout.speech_token_offset,
            "base_speech_token_size": layout.num_speech_tokens, "embedding_size": layout.output_window_size,
            "padded_vocab_size": layout.vocab_size, "eos_token_id": layout.eos_id,
            "speech_token_offset": layout.speech_token_offset, "dtype": "bfloat16"}


def write_llm_bundle(out_dir: str | Path, size: str = "tiny", seed: int = 0,
                     layout: PromptLayout = COSYVOICE2) -> Path:
    """Write the HF directory (config, generation config, weights, tokenizer) into ``out_dir``."""
    out_dir = Path(out_dir)
    config = llm_config(size, layout)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(layout), indent=2) + "\n")
    if not layout.head_bias:
        (out_dir / "cosyvoice3_metadata.json").write_text(json.dumps(_cosyvoice3_metadata(layout), indent=2) + "\n")
    write_tokenizer(out_dir, layout)
    save_file(random_state_dict(config, seed, layout), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def ensure_llm_bundle(out_dir: str | Path, size: str = "tiny", seed: int = 0,
                      layout: PromptLayout = COSYVOICE2) -> Path:
    """Like :func:`write_llm_bundle`, but reuses a directory already written with the same size, seed and layout."""
    out_dir = Path(out_dir)
    stamp = out_dir / ".cosyserve_bundle"
    wanted = json.dumps({"size": size, "seed": seed, "speech_offset": layout.speech_token_offset})
    if stamp.exists() and stamp.read_text() == wanted and (out_dir / "model.safetensors").exists():
        return out_dir
    write_llm_bundle(out_dir, size, seed, layout)
    stamp.write_text(wanted)
    return out_dir
