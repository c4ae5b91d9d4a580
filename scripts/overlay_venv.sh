#!/usr/bin/env bash
# A virtualenv layered over an existing Python environment, for machines without a package
# index (air-gapped GPU boxes, a PyTorch container): the wheels given are installed into the
# new venv and win over the base environment, whose packages (torch...) stay visible after them.
# This checkout is put on the venv's path too, since Triton's Python stubs ignore PYTHONPATH.
#
#   bash scripts/overlay_venv.sh VENV BASE_PYTHON WHEEL...
#   e.g. bash scripts/overlay_venv.sh /tmp/venv /opt/torch/.venv/bin/python3 wheels/*.whl
#   then: export PATH=/tmp/venv/bin:$PATH   (run.sh uses VENV=/tmp/venv directly)
#
# Typical wheels: nvidia-pytriton, tritonclient, numpy<2 (the bundled Triton stub needs it),
# soundfile + cffi, python-rapidjson. HIDE_MODULES="scipy sklearn" makes base packages that
# were built for another numpy look absent (transformers then skips its optional imports of them).
set -euo pipefail

[ $# -ge 2 ] || { echo "usage: $0 VENV BASE_PYTHON [WHEEL...]" >&2; exit 2; }
venv=$1 base_python=$2
shift 2
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

"$base_python" -m venv --without-pip "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ $# -gt 0 ]; then
  "$base_python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$@"
fi
# addsitedir (not a plain path line) so that the base environment's own .pth files are honoured
base_site=$("$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$base_site')" > "$site/zz_base_environment.pth"
echo "$repo_root" > "$site/cosyserve_checkout.pth"
if [ -n "${HIDE_MODULES:-}" ]; then
  # sys.modules[name] = None: `import name` fails and importlib.util.find_spec(name) answers None
  modules=$(printf "'%s'," ${HIDE_MODULES})
  echo "import sys; sys.modules.update(dict.fromkeys([${modules%,}]))" > "$site/aa_hidden_modules.pth"
fi
"$venv/bin/python" -c 'import numpy, torch, cosyserve; print("overlay venv:", numpy.__version__, torch.__version__)'
