"""cosyserve: CosyVoice2 text-to-speech serving on Triton Inference Server.

All model code and pipeline logic lives in this package; the Triton models under
``model_repo/`` and the command-line scripts are thin adapters over it.
"""

__version__ = "0.1.0"
