"""One engine per GPU: the LLM, the flow and the vocoder of every request, its loop in a process of its own.

Layout (one role per file): :mod:`.core` the loop; :mod:`.scheduler` admission and which chunks
join a step; :mod:`.request` a request's state; :mod:`.front_end` what a request is before the
engine runs it (its text, voice, limits and segment prompts); :mod:`.runners` the LLM; :mod:`.kinds`
the token2wav kinds (their modules, vocabularies and schedules); :mod:`.service` requests in, PCM out,
and the loader; :mod:`.process` the engine process, :mod:`.client` a front door's side of it and
:mod:`.wire` the messages between them.
"""
