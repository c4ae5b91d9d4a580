"""The in-process TTS pipeline (one request on the calling thread): offline_inference.py and the tests."""
