"""`runtime bench ...`: shape-true benchmarks, arriving with the ASR, language-engine and video issues."""
