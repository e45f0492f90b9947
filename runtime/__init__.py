"""runtime: a streaming multimodal runtime for real-time agents.

Data path, top-down: `cli` -> `io` sources -> `feed` -> `session` (channels) -> `pipeline` processors ->
`worker` (models) -> `events` out. See docs/architecture.md.
"""

__version__ = "0.1.0"
