"""scripts/fill_template.py: substitution syntax, strictness, and the command line."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fill_template.py"
_spec = importlib.util.spec_from_file_location("fill_template", SCRIPT)
fill_template = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fill_template)

TEMPLATE = """name: "token2wav"
max_batch_size: ${triton_max_batch_size}
dynamic_batching { max_queue_delay_microseconds: ${max_queue_delay_microseconds} }
parameters { key: "model_dir" value: { string_value: "${model_dir}" } }
parameters { key: "url" value: { string_value: "${url}" } }
"""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_parse_splits_key_on_first_colon_and_honours_escapes():
    parsed = fill_template.parse_substitutions(r"a:1,url:http://h:8000/x,list:1\,2\,3,k\:ey:v,empty:")
    assert parsed == {"a": "1", "url": "http://h:8000/x", "list": "1,2,3", "k:ey": "v", "empty": ""}


@pytest.mark.parametrize("spec", ["novalue", ":v", "a:1,broken"])
def test_parse_rejects_items_without_key(spec):
    with pytest.raises(fill_template.TemplateError, match="is not key:value"):
        fill_template.parse_substitutions(spec)


def test_fill_substitutes_and_defaults_queue_delay():
    out = fill_template.fill(TEMPLATE, {"triton_max_batch_size": "16", "model_dir": "/m/C:x", "url": "a:b"})
    assert "max_batch_size: 16\n" in out
    assert "max_queue_delay_microseconds: 0 }" in out
    assert 'string_value: "/m/C:x"' in out and 'string_value: "a:b"' in out
    assert "${" not in out


def test_fill_names_every_unfilled_placeholder():
    with pytest.raises(fill_template.TemplateError) as caught:
        fill_template.fill(TEMPLATE, {"triton_max_batch_size": "16"})
    assert str(caught.value) == "unfilled placeholder(s): ${model_dir}, ${url}"


def test_fill_rejects_keys_missing_from_template():
    with pytest.raises(fill_template.TemplateError, match="typo_key"):
        fill_template.fill(TEMPLATE, {"typo_key": "1", "triton_max_batch_size": "1", "model_dir": "m", "url": "u"})


def test_values_are_not_rescanned():
    assert fill_template.fill("a=${a} b=${b}", {"a": "${b}", "b": "x"}) == "a=${b} b=x"


def test_cli_in_place(tmp_path):
    config = tmp_path / "config.pbtxt"
    config.write_text(TEMPLATE)
    result = run("-i", str(config), "triton_max_batch_size:4,model_dir:/models/cv2,url:http://localhost:8000")
    assert result.returncode == 0, result.stderr
    text = config.read_text()
    assert 'string_value: "http://localhost:8000"' in text and "max_batch_size: 4" in text
    assert result.stdout == ""


def test_cli_output_and_stdout(tmp_path):
    config = tmp_path / "config.pbtxt"
    config.write_text("x: ${x}\n")
    result = run(str(config), "x:1", "--output", str(tmp_path / "out.pbtxt"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.pbtxt").read_text() == "x: 1\n" and config.read_text() == "x: ${x}\n"
    printed = run(str(config), "x:2")
    assert printed.returncode == 0 and printed.stdout == "x: 2\n"


def test_cli_fails_loudly_and_leaves_file_untouched(tmp_path):
    config = tmp_path / "config.pbtxt"
    config.write_text(TEMPLATE)
    result = run("-i", str(config), "triton_max_batch_size:4")
    assert result.returncode == 1
    assert "${model_dir}" in result.stderr and "${url}" in result.stderr
    assert config.read_text() == TEMPLATE
