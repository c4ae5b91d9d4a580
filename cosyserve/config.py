"""Safe reading and writing of HyperPyYAML model configs (``cosyvoice2.yaml``, ``flow.yaml``).

The released configs use HyperPyYAML tags that, when loaded by ``hyperpyyaml``, import and
*execute* arbitrary Python (``!new:``, ``!name:``, ``!apply:``). We never execute anything:
tags become :class:`Tagged` nodes that record the class/function name and its arguments, and
``!ref <key>`` references are resolved against the already-parsed top-level keys. Model code
then reads hyper-parameters from the tree (``find_tagged``) and falls back to the released
defaults when the file is absent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from .errors import ModelLoadError


@dataclass
class Tagged:
    """A ``!new:``/``!name:``/``!apply:`` node: ``kind`` is new|name|apply, ``target`` the dotted path."""

    kind: str
    target: str
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]


@dataclass
class Ref:
    """An unresolved ``!ref`` expression (resolved after loading)."""

    expr: str


class _SafeHyperLoader(yaml.SafeLoader):
    pass


def _construct_tagged(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node, kind: str) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        return Tagged(kind, tag_suffix, kwargs=loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Tagged(kind, tag_suffix, args=loader.construct_sequence(node, deep=True))
    value = loader.construct_scalar(node)
    return Tagged(kind, tag_suffix, args=[] if value in ("", None) else [value])


for _kind in ("new", "name", "apply"):
    _SafeHyperLoader.add_multi_constructor(
        f"!{_kind}:", lambda loader, suffix, node, _k=_kind: _construct_tagged(loader, suffix, node, _k)
    )
_SafeHyperLoader.add_constructor("!ref", lambda loader, node: Ref(loader.construct_scalar(node)))
# Other HyperPyYAML tags (!copy, !include, !tuple, !module, !placeholder) are kept as plain data.
_SafeHyperLoader.add_constructor("!tuple", lambda loader, node: tuple(loader.construct_sequence(node, deep=True)))
_SafeHyperLoader.add_multi_constructor(
    "!", lambda loader, suffix, node: Tagged("other", suffix.lstrip("!"), args=[loader.construct_object(node)])
)

_REF_RE = re.compile(r"<([^<>]+)>")


def _lookup(root: dict, dotted: str) -> Any:
    value: Any = root
    for part in re.split(r"[.\[\]]+", dotted.strip()):
        if part == "":
            continue
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, Tagged) and part in value.kwargs:
            value = value.kwargs[part]
        elif isinstance(value, (list, tuple)) and part.isdigit():
            value = value[int(part)]
        else:
            raise KeyError(dotted)
    return value


def _resolve_ref(root: dict, ref: Ref) -> Any:
    expr = ref.expr.strip()
    whole = _REF_RE.fullmatch(expr)
    if whole:
        return _resolve(root, _lookup(root, whole.group(1)))
    # Arithmetic such as "<a> * <b>": substitute numbers and evaluate only plain arithmetic.
    substituted = _REF_RE.sub(lambda m: repr(_resolve(root, _lookup(root, m.group(1)))), expr)
    if re.fullmatch(r"[\d\s.+\-*/()e]+", substituted):
        return eval(substituted, {"__builtins__": {}}, {})  # noqa: S307 - digits and operators only
    return substituted


def _resolve(root: dict, value: Any) -> Any:
    if isinstance(value, Ref):
        try:
            return _resolve_ref(root, value)
        except KeyError:
            return value  # unresolvable refs stay as Ref; model code never needs them
    if isinstance(value, Tagged):
        value.args = [_resolve(root, a) for a in value.args]
        value.kwargs = {k: _resolve(root, v) for k, v in value.kwargs.items()}
        return value
    if isinstance(value, dict):
        return {k: _resolve(root, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(root, v) for v in value]
    return value


def load_hyperpyyaml(path: str | Path) -> dict:
    """Parse a HyperPyYAML file without executing any of its tags."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelLoadError(f"cannot read config {path}: {exc}") from exc
    try:
        tree = yaml.load(text, Loader=_SafeHyperLoader)  # noqa: S506 - loader is a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ModelLoadError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(tree, dict):
        raise ModelLoadError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    return _resolve(tree, tree)


def tagged_kwargs(node: Any, expected_class: str | tuple[str, ...], where: str) -> dict:
    """Return the constructor kwargs of a ``!new:`` node, checking its class name."""
    expected = (expected_class,) if isinstance(expected_class, str) else expected_class
    if not isinstance(node, Tagged) or node.kind != "new":
        raise ModelLoadError(f"{where}: expected a '!new:' node of {expected}, got {node!r}")
    if node.class_name not in expected:
        raise ModelLoadError(f"{where}: expected class {expected}, got {node.target}")
    return node.kwargs


def checked_kwargs(kwargs: dict, where: str, *, required: set[str], fixed: dict, inert: set[str]) -> dict:
    """``kwargs`` of a config node, after rejecting missing keys, unknown keys (beyond ``fixed`` and the
    ``inert`` ones, which change nothing here) and unsupported values of ``fixed`` options."""
    missing = required - kwargs.keys()
    if missing:
        raise ModelLoadError(f"{where}: missing {sorted(missing)}")
    unknown = kwargs.keys() - required - fixed.keys() - inert
    if unknown:
        raise ModelLoadError(f"{where}: unsupported options {sorted(unknown)}")
    for key, expected in fixed.items():
        if key in kwargs and kwargs[key] != expected:
            raise ModelLoadError(f"{where}.{key} = {kwargs[key]!r}; only {expected!r} is supported")
    return kwargs


def walk_tagged(tree: Any) -> Iterator[Tagged]:
    """Yield every Tagged node in a parsed tree (depth first)."""
    if isinstance(tree, Tagged):
        yield tree
        children = list(tree.args) + list(tree.kwargs.values())
    elif isinstance(tree, dict):
        children = list(tree.values())
    elif isinstance(tree, (list, tuple)):
        children = list(tree)
    else:
        return
    for child in children:
        yield from walk_tagged(child)


def plain(value: Any) -> Any:
    """Turn ``!new:omegaconf.DictConfig {content: {...}}``-style nodes into plain dicts."""
    if isinstance(value, Tagged) and value.class_name == "DictConfig":
        return plain(value.kwargs.get("content", value.kwargs))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class _HyperDumper(yaml.SafeDumper):
    pass


def _represent_tagged(dumper: yaml.SafeDumper, node: Tagged) -> yaml.Node:
    tag = f"!{node.kind}:{node.target}"
    if node.args and not node.kwargs:
        return dumper.represent_sequence(tag, node.args)
    return dumper.represent_mapping(tag, node.kwargs)


_HyperDumper.add_representer(Tagged, _represent_tagged)


def dump_hyperpyyaml(tree: dict, path: str | Path) -> None:
    """Write a tree of plain data and Tagged nodes in HyperPyYAML syntax."""
    text = yaml.dump(tree, Dumper=_HyperDumper, sort_keys=False, default_flow_style=False)
    Path(path).write_text(text, encoding="utf-8")
