"""The torch engine serves the CosyVoice3 LLM (tiny random HF checkpoint of ``cosyvoice3_llm_layout.md`` §7).

Prompt ids in, raw speech tokens out: logits equal transformers' on the speech-head window, sampling
never leaves the window (the converted checkpoint has finite text logits and no mask), generation
stops on every stop class 6561..6760 (not only ``<|eos1|>``) and no stop class is drawn before
``min_tokens``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen2ForCausalLM

from cosyserve.bundle import make_bundle
from cosyserve.errors import InvalidInputError, ModelLoadError
from cosyserve.llm import SamplingParams, create_backend
from cosyserve.llm.prompt import COSYVOICE3, build_prompt_ids, layout_for_vocab_size
from cosyserve.runtime import COSYVOICE3_LLM_DIR

START, WINDOW_SIZE = COSYVOICE3.speech_token_offset, COSYVOICE3.output_window_size
WINDOW = slice(START, START + WINDOW_SIZE)


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("cv3"), "tiny", parts=("cosyvoice3_llm",)) / COSYVOICE3_LLM_DIR


@pytest.fixture(scope="module")
def prompt_ids(llm_dir):
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    return build_prompt_ids(tokenizer, "Hello there, 你好。", "The weather is nice.", [5, 17, 6560, 0],
                            layout=COSYVOICE3)


def _engine(model_dir):
    return create_backend("torch", model_dir, "cpu", max_slots=4, max_model_len=256)


def test_bundle_is_the_converted_layout(llm_dir):
    config = json.loads((llm_dir / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["tie_word_embeddings"]) == (158720, 158486, False)
    assert layout_for_vocab_size(config["vocab_size"]) is COSYVOICE3
    weights = load_file(str(llm_dir / "model.safetensors"))
    assert "lm_head.bias" not in weights and weights["lm_head.weight"].shape == (158720, 64)
    assert not weights["lm_head.weight"][COSYVOICE3.tokenizer_size:].any()  # padding rows: logit exactly 0
    assert json.loads((llm_dir / "cosyvoice3_metadata.json").read_text())["speech_token_offset"] == 151924
    assert len(AutoTokenizer.from_pretrained(llm_dir)) == COSYVOICE3.tokenizer_size


def test_logits_and_greedy_match_transformers_on_the_window(llm_dir, prompt_ids):
    hf = Qwen2ForCausalLM.from_pretrained(llm_dir, torch_dtype=torch.float32).eval()
    with _engine(llm_dir) as engine:
        assert engine.engine.layout is COSYVOICE3
        tokens = engine.generate(prompt_ids, SamplingParams.greedy(max_tokens=12))
        forced = tokens[:-1]
        ours = engine.engine.teacher_forced_logits(prompt_ids, forced)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt_ids + [START + t for t in forced]])).logits[0, len(prompt_ids) - 1:]
    assert ours.shape == (len(forced) + 1, WINDOW_SIZE)
    assert (ours - theirs[:, WINDOW]).abs().max() < 1e-4
    assert tokens == theirs[:, WINDOW].argmax(-1).tolist()[:len(tokens)]
    assert all(0 <= t < COSYVOICE3.num_speech_tokens for t in tokens)


def _edited(llm_dir, tmp_path, edit) -> object:
    out = tmp_path / "edited"
    out.mkdir()
    for path in llm_dir.iterdir():
        if path.name != "model.safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    weights = load_file(str(llm_dir / "model.safetensors"))
    edit(weights["lm_head.weight"])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_sampling_stays_in_the_speech_window(llm_dir, prompt_ids, tmp_path):
    def loud_text(head):  # text rows dominate every speech logit, as they could in a real conversion
        head[:START] *= 1000

    model_dir = _edited(llm_dir, tmp_path, loud_text)
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert int(hf(torch.tensor([prompt_ids])).logits[0, -1].argmax()) < START  # unrestricted: a text id
    with _engine(model_dir) as engine:
        for seed in range(3):
            tokens = engine.generate(prompt_ids, SamplingParams(seed=seed, max_tokens=20, temperature=1.0, top_k=0,
                                                                top_p=1.0, ras=False))
            assert tokens and all(0 <= t < COSYVOICE3.num_speech_tokens for t in tokens)


def test_any_stop_class_ends_generation_and_min_tokens_masks_them_all(llm_dir, prompt_ids, tmp_path):
    def stop_wins(head):
        # Speech logits 0; stop classes 6564.. (neither <|sos|> nor <|eos1|>) get ±1000·h_j, so one is large.
        hidden = head.shape[1]
        head[START:START + WINDOW_SIZE] = 0
        for j in range(hidden):
            head[START + 6564 + 2 * j, j] = 1000
            head[START + 6565 + 2 * j, j] = -1000

    model_dir = _edited(llm_dir, tmp_path, stop_wins)
    with _engine(model_dir) as engine:
        assert engine.generate(prompt_ids, SamplingParams.greedy(max_tokens=50)) == []
        assert engine.generate(prompt_ids, SamplingParams(seed=3, max_tokens=50)) == []
        # Below min_tokens every stop class is masked: the tied speech logits give token 0, then it stops.
        assert engine.generate(prompt_ids, SamplingParams.greedy(max_tokens=50, min_tokens=4)) == [0, 0, 0, 0]


def test_bad_prompts_and_checkpoints_are_refused(llm_dir, tmp_path):
    with _engine(llm_dir) as engine:
        with pytest.raises(InvalidInputError, match="not a known token"):
            engine.generate([COSYVOICE3.sos_id, COSYVOICE3.tokenizer_size], SamplingParams.greedy(max_tokens=2))
    broken = _edited(llm_dir, tmp_path, lambda head: None)
    weights = load_file(str(broken / "model.safetensors"))
    weights["lm_head.bias"] = torch.zeros(158720, dtype=torch.bfloat16)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head.bias"):
        _engine(broken)
