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
unfilled; nothing is written then.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Sequence

# llm_protocol / llm_url of cosyvoice2: empty = by llm_model_name / a Triton LLM model;
# mps_thread_percentage / mps_priority of llm: empty = no cap, normal priority. So repositories filled with the keys of NVIDIA's
# runtime (which has none of them) keep working.
DEFAULTS = {"max_queue_size": "0", "max_queue_delay_microseconds": "0", "llm_protocol": "", "llm_url": "",
            "mps_thread_percentage": "", "mps_priority": ""}
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


class TemplateError(ValueError):
    """The substitutions do not fit the template."""


def split_unescaped(text: str, delimiter: str, maxsplit: int = -1) -> list[str]:
    """Split ``text`` on ``delimiter`` where it is not preceded by a backslash.

    Escapes are kept in the parts (so that a later split still sees them); see :func:`unescape`.
    """
    parts, start, i = [], 0, 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == delimiter and (maxsplit < 0 or len(parts) < maxsplit):
            parts.append(text[start:i])
            start = i + 1
        i += 1
    return parts + [text[start:]]


def unescape(text: str) -> str:
    """``\\x`` -> ``x`` (a trailing backslash stays)."""
    return re.sub(r"\\(.)", r"\1", text, flags=re.DOTALL)


def parse_substitutions(spec: str) -> dict[str, str]:
    """``"a:1,b:x\\,y:z"`` -> ``{"a": "1", "b": "x,y:z"}``."""
    substitutions = {}
    for item in split_unescaped(spec, ","):
        if not item:
            continue
        key_value = split_unescaped(item, ":", maxsplit=1)
        key = unescape(key_value[0]).strip()
        if len(key_value) != 2 or not key:
            raise TemplateError(f"substitution {item!r} is not key:value")
        substitutions[key] = unescape(key_value[1])
    return substitutions


def fill(template: str, substitutions: dict[str, str]) -> str:
    """Replace ``${key}`` by its value; raises :class:`TemplateError` on unknown or unfilled keys."""
    present = set(PLACEHOLDER.findall(template))
    unknown = sorted(set(substitutions) - present)
    if unknown:
        raise TemplateError(f"key(s) {', '.join(unknown)} do not appear as ${{...}} in the template")
    values = {**DEFAULTS, **substitutions}
    filled = PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)
    # Values are inserted verbatim and never re-scanned, so what is left came from the template.
    left = sorted({m.group(1) for m in PLACEHOLDER.finditer(template) if m.group(1) not in values})
    if left:
        raise TemplateError("unfilled placeholder(s): " + ", ".join(f"${{{k}}}" for k in left))
    return filled


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
