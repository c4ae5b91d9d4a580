"""Parity checks against fixture directories recorded from the reference implementation.

A fixture directory is recognised by its files (see ``SUITES``); each suite module exposes
``detect(fixture_dir) -> bool`` and ``run(fixture_dir) -> list[CaseResult]``. The same code
backs ``scripts/check_parity.py`` and the test suite, so any directory in one of these formats
can be checked, not only the shared one. (:mod:`.llm_engine` is no fixture suite: it compares the
LLM back ends with each other, for ``scripts/check_llm_parity.py``.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError

# Suite modules, in the order their tables are printed. Each is cosyserve.parity.<name>.
SUITES = ("cv2_frontend", "cv2_flow", "cv2_hift", "cv2_token2wav", "step_audio2", "cv3_frontend", "cv3_flow", "cv3_hift", "cv3_token2wav")
# The CosyVoice3 set reuses CosyVoice2's file names (flow_tiny.pt, hift_tiny_io.safetensors, ...); its yaml
# tells the two apart.
COSYVOICE3_MARKER = "cosyvoice3_tiny.yaml"


@dataclass
class CaseResult:
    suite: str
    case: str
    max_abs: float
    rel_l2: float
    tolerance: str
    passed: bool
    note: str = ""


def compare(
    suite: str,
    case: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    *,
    rel_l2: float | None = None,
    max_abs: float | None = None,
    note: str = "",
) -> CaseResult:
    """Compare two tensors; passes when every given tolerance holds and shapes match."""
    got = torch.as_tensor(got).detach().to("cpu", torch.float64)
    ref = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    tol_parts = []
    if rel_l2 is not None:
        tol_parts.append(f"rel-L2<{rel_l2:g}")
    if max_abs is not None:
        tol_parts.append(f"max-abs<{max_abs:g}")
    tolerance = ", ".join(tol_parts) or "exact"
    if got.shape != ref.shape:
        return CaseResult(suite, case, float("inf"), float("inf"), tolerance, False,
                          f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    diff = got - ref
    err_max = float(diff.abs().max()) if diff.numel() else 0.0
    ref_norm = float(ref.norm())
    err_rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    if rel_l2 is None and max_abs is None:
        ok = err_max == 0.0
    else:
        ok = (rel_l2 is None or err_rel < rel_l2) and (max_abs is None or err_max < max_abs)
    if not torch.isfinite(got).all():
        ok, note = False, (note + " non-finite values").strip()
    return CaseResult(suite, case, err_max, err_rel, tolerance, ok, note)


def check(suite: str, case: str, ok: bool, note: str = "") -> CaseResult:
    """A pass/fail case that is not a tensor comparison (exact ids, strict loads...)."""
    return CaseResult(suite, case, 0.0 if ok else float("nan"), 0.0 if ok else float("nan"), "exact", ok, note)


def manifest_case(suite: str, config_cls, model_cls, manifest: dict) -> CaseResult:
    """A real-size manifest (``config`` in the fixture's JSON layout; ``keys``: name, shape, dtype in module
    order) against ``model_cls(config_cls.from_fixture_json(manifest))`` built on the meta device: the
    same keys in the same order, the same shapes and dtypes."""
    case = "real manifest/strict load"
    try:
        cfg = config_cls.from_fixture_json(manifest)
        theirs = {e["name"]: (list(e["shape"]), e["dtype"]) for e in manifest["keys"]}
    except (ModelLoadError, KeyError, TypeError) as exc:
        return check(suite, case, False, f"malformed manifest: {exc}"[:200])
    with torch.device("meta"):
        model = model_cls(cfg)
    ours = {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
    if list(ours) != list(theirs):
        return check(suite, case, False, f"key lists differ: only ours {sorted(ours.keys() - theirs.keys())[:3]}, "
                                         f"only theirs {sorted(theirs.keys() - ours.keys())[:3]}")
    differing = [k for k in ours if ours[k] != theirs[k]]
    if differing:
        return check(suite, case, False, f"{len(differing)} shapes or dtypes differ, e.g. {differing[:3]}")
    numel = sum(torch.Size(shape).numel() for shape, _ in theirs.values())
    released = "=" if cfg == config_cls.real() else "!="
    return check(suite, case, numel == manifest.get("num_elements", numel),
                 f"{len(theirs)} tensors, {numel} values, config {released} {config_cls.__name__}.real()")


def is_cosyvoice3_fixture(fixture_dir: str | Path) -> bool:
    return (Path(fixture_dir) / COSYVOICE3_MARKER).is_file()


def run_fixture_dir(fixture_dir: str | Path, suites: tuple[str, ...] = SUITES) -> list[CaseResult]:
    """Run every suite whose files are present in ``fixture_dir``."""
    fixture_dir = Path(fixture_dir)
    if not fixture_dir.is_dir():
        raise FileNotFoundError(f"fixture directory {fixture_dir} does not exist")
    results: list[CaseResult] = []
    matched = False
    for name in suites:
        module = importlib.import_module(f"{__name__}.{name}")
        if module.detect(fixture_dir):
            matched = True
            results.extend(module.run(fixture_dir))
    if not matched:
        raise ValueError(f"{fixture_dir} matches no known fixture format (suites: {', '.join(suites)})")
    return results


def format_table(results: list[CaseResult]) -> str:
    header = f"{'suite':<14} {'case':<44} {'max abs err':>12} {'rel-L2':>10}  {'tolerance':<26} verdict"
    lines = [header, "-" * len(header)]
    for r in results:
        verdict = "PASS" if r.passed else "FAIL"
        note = f"  ({r.note})" if r.note else ""
        lines.append(f"{r.suite:<14} {r.case:<44} {r.max_abs:>12.3e} {r.rel_l2:>10.3e}  {r.tolerance:<26} {verdict}{note}")
    n_fail = sum(not r.passed for r in results)
    lines.append(f"{len(results) - n_fail} passed, {n_fail} failed")
    return "\n".join(lines)
