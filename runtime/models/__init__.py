"""Models: loading checkpoints (real or tiny random), streaming ASR backends and the answering LM.

Everything here runs on the device worker's thread; nothing in this package touches the event loop.
"""
