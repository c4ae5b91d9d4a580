"""``python -m cosyserve.api``: the OpenAI-compatible speech API in front of a running Triton
(command line: settings from arguments and the environment, then uvicorn)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..engine.front_end import MAX_TEXT_CHARS
from .app import MAX_UPLOAD_BYTES, Settings, create_app
from .router import split_urls


def api_keys(env_value: str, key_file: str | None) -> frozenset[str]:
    """Keys from ``API_KEYS`` (comma-separated) and a file (one per line, # comments)."""
    keys = {k.strip() for k in env_value.split(",") if k.strip()}
    if key_file:
        lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        keys |= {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    return frozenset(keys)


def model_url(text: str) -> tuple[str, str]:
    name, sep, urls = text.partition("=")
    if not sep or not name.strip() or not urls.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT[,HOST:PORT...], got {text!r}")
    try:
        split_urls(urls)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name.strip(), urls.strip()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cosyserve.api", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=int(os.environ.get("API_PORT", 8080)))
    parser.add_argument("--triton-url", default=os.environ.get("TRITON_URLS", "127.0.0.1:8001"),
                        help="Triton's gRPC address host:port, or several comma-separated (also TRITON_URLS): streams "
                             "are spread over them, each name resolved to all its addresses (cosyserve/api/router.py)")
    parser.add_argument("--model", default="cosyvoice2", help="the streaming (decoupled) Triton model")
    parser.add_argument("--model-url", action="append", default=[], metavar="NAME=URLS", type=model_url,
                        help="one more streaming Triton model that requests select with 'model': its name and its "
                             "servers (as --triton-url), e.g. cosyvoice3=127.0.0.1:18001; repeatable")
    parser.add_argument("--model-dir", required=True, type=Path,
                        help="the CosyVoice2 directory the Triton server serves (spk2info.pt, voices/)")
    parser.add_argument("--tokenizer-dir", required=True, type=Path, help="the LLM tokenizer (usage counts)")
    parser.add_argument("--voices-dir", type=Path, help="voice store (default <model-dir>/voices, as the Triton front door)")
    parser.add_argument("--api-key-file", default=os.environ.get("API_KEY_FILE"),
                        help="file of accepted API keys, one per line; also API_KEYS=k1,k2 (none: no auth)")
    parser.add_argument("--max-input-chars", type=int, default=MAX_TEXT_CHARS)
    parser.add_argument("--max-upload-bytes", type=int, default=MAX_UPLOAD_BYTES)
    return parser


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    cli = parser()
    args = cli.parse_args(argv)
    try:
        split_urls(args.triton_url)
    except ValueError as exc:
        cli.error(str(exc))
    settings = Settings(triton_url=args.triton_url, model_dir=args.model_dir, tokenizer_dir=args.tokenizer_dir,
                        voices_dir=args.voices_dir, model=args.model, extra_models=dict(args.model_url),
                        api_keys=api_keys(os.environ.get("API_KEYS", ""), args.api_key_file),
                        max_input_chars=args.max_input_chars, max_upload_bytes=args.max_upload_bytes)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")

