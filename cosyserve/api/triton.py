"""The API's way into Triton: one asyncio gRPC client, shared by every request, streaming the
decoupled ``cosyvoice2`` model (inputs as in :mod:`cosyserve.clients`; ``instruction`` is the
optional input for instruct mode).

Each synthesis is one gRPC stream on the shared channel that carries one request; the server
ends the stream after the request's last response. Closing the returned generator early (the
HTTP client went away) cancels the stream, which Triton turns into a cancelled request that
the front door notices within its cancellation poll.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from ..clients import build_inputs, requested_outputs


@dataclass(frozen=True)
class Synthesis:
    text: str
    speaker_id: str | None = None
    instruction: str | None = None
    prepare_voice: bool = False  # only compute and keep the voice's state: no audio comes back


class TritonTTS:
    def __init__(self, url: str, model: str = "cosyvoice2"):
        self.url = url
        self.model = model
        self.client = grpcclient_aio.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(self.model)
        except InferenceServerException:
            return False

    async def stream(self, synthesis: Synthesis) -> AsyncIterator[np.ndarray]:
        """The waveform chunks (float32, 24 kHz) in order; raises InferenceServerException with
        Triton's message when the request fails."""
        inputs = build_inputs(grpcclient, None, "", synthesis.text, speaker_id=synthesis.speaker_id,
                              instruction=synthesis.instruction, prepare_voice=synthesis.prepare_voice)

        async def one_request():
            yield {"model_name": self.model, "inputs": inputs, "request_id": f"api-{uuid.uuid4().hex[:12]}",
                   "outputs": requested_outputs(grpcclient)}

        responses = self.client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise error
                waveform = result.as_numpy("waveform")
                if waveform is not None and waveform.size:
                    yield waveform.reshape(-1)
            finished = True
        except grpc.RpcError as exc:  # the stream itself failed (Triton unreachable, gone): not translated there
            raise InferenceServerException(msg=exc.details(), status=str(exc.code())) from None
        finally:
            if not finished:
                responses.cancel()

    async def close(self) -> None:
        await self.client.close()
