"""Download the released models (stage 0 of run.sh).

Sources are the ones NVIDIA's runtime uses: the HuggingFace-format LLM ``yuekai/cosyvoice2_llm``
from the HuggingFace Hub and ``iic/CosyVoice2-0.5B`` from ModelScope (or its HuggingFace mirror
``FunAudioLLM/CosyVoice2-0.5B`` when ``source="huggingface"``). After a download the directory is
checked for the files the pipeline needs, so a partial download fails here and not at serving time.

CosyVoice3 (``--model cosyvoice3``, ``run_cosyvoice3.sh`` stage 0): the HuggingFace-format LLM
``yuekai/Fun-CosyVoice3-0.5B-2512-LLM-HF`` (what the reference's run script downloads) into
``cosyvoice3_llm/`` and ``FunAudioLLM/Fun-CosyVoice3-0.5B-2512`` (the same id on ModelScope and the
Hub) into ``Fun-CosyVoice3-0.5B-2512/``. Not run here (no network): written against the documented
``snapshot_download`` calls used for CosyVoice2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .bundle import COSYVOICE2_DIR, LLM_DIR
from .errors import ModelLoadError
from .runtime import COSYVOICE3_DIR, COSYVOICE3_LLM_DIR

LLM_REPO = "yuekai/cosyvoice2_llm"
COSYVOICE2_REPOS = {"modelscope": "iic/CosyVoice2-0.5B", "huggingface": "FunAudioLLM/CosyVoice2-0.5B"}
# The default speaker "001" that NVIDIA's runtime uses when a request has no reference audio; it is
# not part of the ModelScope/HuggingFace model repository.
SPK2INFO_URL = "https://raw.githubusercontent.com/qi-hua/async_cosyvoice/main/CosyVoice2-0.5B/spk2info.pt"
COSYVOICE3_LLM_REPO = "yuekai/Fun-CosyVoice3-0.5B-2512-LLM-HF"
COSYVOICE3_REPO = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
REQUIRED_FILES = {
    COSYVOICE2_DIR: ("flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx"),
    LLM_DIR: ("config.json", "tokenizer_config.json"),
    COSYVOICE3_DIR: ("cosyvoice3.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx"),
    COSYVOICE3_LLM_DIR: ("config.json", "tokenizer_config.json"),
}


def check_model_dir(path: Path, name: str) -> None:
    missing = [f for f in REQUIRED_FILES[name] if not (path / f).exists()]
    if name in (LLM_DIR, COSYVOICE3_LLM_DIR) and not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelLoadError(f"{path} is missing {', '.join(missing)}: the download is incomplete")


def download_llm(out_dir: Path, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    target = out_dir / LLM_DIR
    snapshot_download(repo_id=LLM_REPO, local_dir=str(target), revision=revision)
    check_model_dir(target, LLM_DIR)
    return target


def download_cosyvoice2(out_dir: Path, source: str = "modelscope", revision: str | None = None) -> Path:
    target = out_dir / COSYVOICE2_DIR
    if source == "modelscope":
        from modelscope import snapshot_download as ms_snapshot_download

        ms_snapshot_download(COSYVOICE2_REPOS[source], local_dir=str(target), revision=revision or "master")
    elif source == "huggingface":
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=COSYVOICE2_REPOS[source], local_dir=str(target), revision=revision)
    else:
        raise ValueError(f"unknown source {source!r}; use modelscope or huggingface")
    check_model_dir(target, COSYVOICE2_DIR)
    download_spk2info(target)
    return target


def download_cosyvoice3(out_dir: Path, source: str = "huggingface", revision: str | None = None) -> tuple[Path, Path]:
    """``cosyvoice3_llm/`` (always from the Hub) and ``Fun-CosyVoice3-0.5B-2512/`` (from ``source``)."""
    from huggingface_hub import snapshot_download

    llm = out_dir / COSYVOICE3_LLM_DIR
    snapshot_download(repo_id=COSYVOICE3_LLM_REPO, local_dir=str(llm), revision=revision)
    check_model_dir(llm, COSYVOICE3_LLM_DIR)
    target = out_dir / COSYVOICE3_DIR
    if source == "modelscope":
        from modelscope import snapshot_download as ms_snapshot_download

        ms_snapshot_download(COSYVOICE3_REPO, local_dir=str(target), revision=revision or "master")
    elif source == "huggingface":
        snapshot_download(repo_id=COSYVOICE3_REPO, local_dir=str(target), revision=revision)
    else:
        raise ValueError(f"unknown source {source!r}; use modelscope or huggingface")
    check_model_dir(target, COSYVOICE3_DIR)
    return llm, target


def download_spk2info(model_dir: Path, url: str = SPK2INFO_URL) -> Path:
    """Fetch spk2info.pt (if absent) and check that it loads as a speaker registry."""
    import urllib.request

    from .frontend.speakers import SpeakerRegistry

    target = model_dir / "spk2info.pt"
    if not target.exists():
        tmp = target.with_suffix(".part")
        urllib.request.urlretrieve(url, tmp)
        tmp.replace(target)
    SpeakerRegistry.load(target)  # raises ModelLoadError on a broken download
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Download CosyVoice2 or CosyVoice3 models into OUT_DIR")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=("cosyvoice2", "cosyvoice3"), default="cosyvoice2")
    parser.add_argument("--source", choices=sorted(COSYVOICE2_REPOS), default="modelscope",
                        help="where to get the token2wav models (the LLM always comes from the HuggingFace Hub)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "cosyvoice3":
        llm, model_dir = download_cosyvoice3(args.out, args.source)
        print(f"LLM -> {llm}\nCosyVoice3 -> {model_dir}")
        return 0
    print(f"LLM -> {download_llm(args.out)}")
    print(f"CosyVoice2 -> {download_cosyvoice2(args.out, args.source)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
