"""Running the Triton Inference Server: finding and launching ``tritonserver`` (see
:mod:`cosyserve.serving.tritonserver`)."""
