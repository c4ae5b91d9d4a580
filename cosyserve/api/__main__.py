"""``python -m cosyserve.api``: see :mod:`cosyserve.api.server`."""

from .server import main

main()
