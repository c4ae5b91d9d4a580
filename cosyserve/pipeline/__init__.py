"""The TTS pipeline glue shared by the Triton BLS, offline_inference.py and the tests."""
