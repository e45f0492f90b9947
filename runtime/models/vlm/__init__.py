"""Vision-language models: the vision half (tower + projector) of a VLM checkpoint whose language model the
engine runs, and how video memory becomes engine input."""
