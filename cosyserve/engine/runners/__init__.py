"""What the engine core runs: the LLM (:mod:`.llm`) and the kinds' token2wav stages (:mod:`..kinds`)."""
