"""Reading text on screen: PP-OCRv4 (builtin:pp-ocrv4) through RapidOCR."""
