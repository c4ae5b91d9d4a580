"""Token2wav kinds of the engine: what differs between models (flow, vocoder, chunk schedule)."""
