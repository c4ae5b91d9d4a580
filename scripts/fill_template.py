#!/usr/bin/env python3
"""Fill ``${key}`` placeholders of a Triton ``config.pbtxt`` template.

    python3 scripts/fill_template.py -i model_repo/x/config.pbtxt key:value,key2:value2
    python3 scripts/fill_template.py config.pbtxt key:value --output filled.pbtxt
    python3 scripts/fill_template.py config.pbtxt key:value          # print the result

Same command line as NVIDIA's CosyVoice runtime script. Substitutions are ``key:value``
pairs separated by commas; only the first ':' separates key and value (so values such as
``http://host:8000`` or ``C:/x`` work); a backslash escapes the next character (``\\,``
for a comma inside a value). ``max_queue_size`` and ``max_queue_delay_microseconds``
default to 0, ``llm_protocol``, ``llm_url``, ``mps_thread_percentage`` and ``mps_priority`` to empty. It is an error (exit status 1) to
name a key that the template does not contain or to leave any ``${...}`` placeholder
unfilled; nothing is written then. The logic is :mod:`cosyserve.serving.model_repository`'s, which
also builds whole repositories (run.sh stage 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from cosyserve.serving.model_repository import TemplateError, fill, parse_substitutions

__all__ = ["TemplateError", "fill", "parse_substitutions", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file_path", type=Path, help="the .pbtxt template")
    parser.add_argument("substitutions", help="key_1:value_1,key_2:value_2,...")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--in_place", "--in-place", "-i", action="store_true", help="overwrite the template")
    where.add_argument("--output", "-o", type=Path, help="write the result to this file")
    args = parser.parse_args(argv)
    try:
        filled = fill(args.file_path.read_text(), parse_substitutions(args.substitutions))
    except (TemplateError, OSError) as e:
        print(f"fill_template: {args.file_path}: {e}", file=sys.stderr)
        return 1
    if args.in_place:
        args.file_path.write_text(filled)
    elif args.output:
        args.output.write_text(filled)
    else:
        sys.stdout.write(filled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
