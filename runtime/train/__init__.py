"""Training entry points behind `runtime train <what>`: each module exposes `add_arguments(parser)` and
`run(args) -> int`. They import torch and the model code at import time, so import one only when its
subcommand is chosen."""
