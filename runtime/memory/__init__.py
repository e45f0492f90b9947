"""What a session remembers of its inputs: the transcript now; segment-level video memory later."""
