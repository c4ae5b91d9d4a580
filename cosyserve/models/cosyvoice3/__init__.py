"""CosyVoice3 token2wav models: the DiT flow (tokens -> mel) and the causal HiFT vocoder (mel -> 24 kHz)."""
