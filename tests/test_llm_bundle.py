"""The random HF-format LLM bundle: tokenizer layout, config, head bias, prompt ids, strict loading."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cosyserve.bundle.llm import ensure_llm_bundle
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.llm.prompt import (
    ENDOFPROMPT_ID,
    EOS_IDS,
    OUTPUT_WINDOW_SIZE,
    OUTPUT_WINDOW_START,
    SOS_ID,
    SPEECH_TOKEN_OFFSET,
    TASK_ID,
    build_prefix_ids,
    build_prompt_ids,
    length_bounds,
    validate_prompt_ids,
)

WINDOW = slice(OUTPUT_WINDOW_START, OUTPUT_WINDOW_START + OUTPUT_WINDOW_SIZE)


@pytest.fixture(scope="session")
def llm_dir(tmp_path_factory):
    return ensure_llm_bundle(tmp_path_factory.getbasetemp() / "llm_tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(llm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llm_dir)


def test_tokenizer_layout(tokenizer):
    assert len(tokenizer) == 158229
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|endofprompt|>": 151646,
                "[breath]": 151647, "[mn]": 151662, "<|s_0|>": 151663, "<|s_5|>": 151668, "<|s_6560|>": 158223,
                "<|eos1|>": 158224, "<|eos2|>": 158225, "<|eos3|>": 158226, "<|sos|>": 158227, "<|task_id|>": 158228}
    for text, token_id in expected.items():
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id], text
        assert tokenizer.convert_ids_to_tokens(token_id) == text
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 151643
    # Plain text stays in the byte-level BPE range; special tokens split out of running text.
    ids = tokenizer.encode("<|sos|>Hello world, 你好<|task_id|><|s_12|>", add_special_tokens=False)
    assert ids[0] == SOS_ID and ids[-2:] == [TASK_ID, SPEECH_TOKEN_OFFSET + 12]
    assert all(t < 151643 for t in ids[1:-2])
    assert tokenizer.decode(ids) == "<|sos|>Hello world, 你好<|task_id|><|s_12|>"


def test_chat_template(tokenizer):
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "<|s_1|><|s_2|>"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<|sos|>Hi there<|task_id|><|s_1|><|s_2|>"
    assert "system" not in tokenizer.chat_template


def test_config_and_head(llm_dir):
    config = json.loads((llm_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["vocab_size"] == 158336
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == 158224 and config["use_bias"]
    generation = json.loads((llm_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(EOS_IDS)
    assert (generation["temperature"], generation["top_p"], generation["top_k"]) == (1.0, 0.8, 25)
    weights = load_file(llm_dir / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    bias, head = weights["lm_head.bias"].float(), weights["lm_head.weight"].float()
    outside = torch.ones(158336, dtype=torch.bool)
    outside[WINDOW] = False
    assert torch.isneginf(bias[outside]).all() and torch.isfinite(bias[WINDOW]).all()
    assert (head[outside] == 0).all() and head[WINDOW].abs().sum() > 0


def test_prompt_forms(tokenizer):
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    zero_shot = build_prompt_ids(tokenizer, "target text.", prompt_text="Prompt text, ", prompt_speech_tokens=[0, 7, 6560])
    assert zero_shot == encode("<|sos|>Prompt text, target text.<|task_id|>") + [151663, 151670, 158223]
    cross = build_prompt_ids(tokenizer, "target text.")
    assert cross == encode("<|sos|>target text.<|task_id|>") and cross[0] == SOS_ID and cross[-1] == TASK_ID
    instruct = build_prompt_ids(tokenizer, "target", instruction="speak slowly")
    assert instruct == encode("<|sos|>speak slowly<|endofprompt|>target<|task_id|>")
    assert ENDOFPROMPT_ID in instruct
    prefix = build_prefix_ids(tokenizer, "Prompt text, ")
    assert zero_shot[: len(prefix) - 1] == prefix[:-1]  # shared up to (at most) the boundary token
    with pytest.raises(InvalidInputError, match="empty"):
        build_prompt_ids(tokenizer, "")
    with pytest.raises(InvalidInputError, match="out of range"):
        build_prompt_ids(tokenizer, "x", prompt_text="y", prompt_speech_tokens=[6561])
    with pytest.raises(InvalidInputError, match="instruction"):
        build_prompt_ids(tokenizer, "x", prompt_text="y", instruction="z")


def test_length_bounds_and_id_validation(tokenizer):
    n = len(tokenizer.encode("hello world again", add_special_tokens=False))
    assert length_bounds(tokenizer, "hello world again") == (2 * n, 20 * n)
    assert length_bounds(tokenizer, "hello " * 200, max_cap=100)[1] == 100
    assert validate_prompt_ids([SOS_ID, 5, TASK_ID], 158336) == [SOS_ID, 5, TASK_ID]
    for bad, message in (([], "empty"), ([158229], "not a known token"), ([-1], "not a known token"),
                         ([1.5], "not an int"), ("abc", "list of ints")):
        with pytest.raises(InvalidInputError, match=message):
            validate_prompt_ids(bad, 158336)


def test_both_loaders_keep_the_bias(llm_dir):
    from cosyserve.llm.hf_reference import load_hf_model
    from cosyserve.llm.models.loader import load_model

    hf = load_hf_model(llm_dir)
    ids = torch.tensor([[SOS_ID, 100, 200, TASK_ID, SPEECH_TOKEN_OFFSET + 3]])
    logits = hf(input_ids=ids).logits[0, -1]
    assert torch.isneginf(logits[100]) and torch.isneginf(logits[SOS_ID]) and torch.isfinite(logits[WINDOW]).all()
    bias = load_file(llm_dir / "model.safetensors")["lm_head.bias"][WINDOW].float()
    assert torch.equal(hf.lm_head.bias[WINDOW].float(), bias)
    ours = load_model(llm_dir, torch.device("cpu"), torch.float32, 64)
    assert ours.head.weight.shape[0] == OUTPUT_WINDOW_SIZE and torch.equal(ours.head.bias, bias)


def test_loaders_refuse_a_checkpoint_without_bias(llm_dir, tmp_path):
    from cosyserve.llm.hf_reference import load_hf_model
    from cosyserve.llm.models.loader import load_model

    broken = tmp_path / "no_bias"
    shutil.copytree(llm_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["lm_head.bias"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head.bias"):
        load_model(broken, torch.device("cpu"), torch.float32, 64)
    with pytest.raises(ModelLoadError, match="lm_head.bias"):
        load_hf_model(broken)
    weights["lm_head.bias"] = torch.zeros(158336, dtype=torch.bfloat16)
    weights["model.extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="does not use"):
        load_model(broken, torch.device("cpu"), torch.float32, 64)
