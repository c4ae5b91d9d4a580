"""One engine per GPU: the LLM, the flow and the vocoder stepped by one scheduler loop.

Layout (one role per file): :mod:`.core` the loop; :mod:`.scheduler` admission and which chunks
join a step; :mod:`.request` a request's state; :mod:`.runners` the LLM; :mod:`.kinds` the
token2wav kinds (their modules, vocabularies and schedules); :mod:`.service` requests in, PCM out,
and the loader.
"""
