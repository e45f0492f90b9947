"""PP-OCRv4 text detection and recognition (PaddleOCR's models, Apache-2.0) through RapidOCR's onnxruntime
pipeline: what a live captioner reads off a slide, a title card or a shared screen.

The weights are the ONNX files inside the pinned `rapidocr-onnxruntime` wheel (`builtin:pp-ocrv4`, hash-checked
at load like every packaged model), and RapidOCR's own code does the work around them (DB box post-processing
with pyclipper and shapely, crops, CTC decoding): the `ocr` extra installs what it imports. The angle classifier
is off: slides and screens are upright. One `TextReader` (one pair of ONNX sessions) serves every session; it
runs on the device worker, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.packaged import PACKAGED, packaged_checkpoint

MODEL = "builtin:pp-ocrv4"


@dataclass(frozen=True)
class TextLine:
    text: str
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 as fractions of the frame's width and height
    confidence: float


class TextReader:
    """`read(image)`: the lines of text in an RGB uint8 frame, top to bottom, left to right."""

    def __init__(self, model: str = MODEL, *, threads: int = 1, max_side: int = 1280) -> None:
        if model != MODEL:
            raise ConfigError(f"screen.model {model!r}: only {MODEL} (PP-OCRv4 from rapidocr-onnxruntime) is known")
        det, rec = (packaged_checkpoint(name) for name in ("pp-ocrv4-det", "pp-ocrv4-rec"))
        assert det is not None and rec is not None
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:
            raise CheckpointNotFound(f"{MODEL} needs RapidOCR's pipeline and its imports ({err.name} is missing): "
                                     "pip install -e '.[ocr]' (or: make install)") from None
        self.max_side = max_side
        self._ocr = RapidOCR(det_model_path=str(det / PACKAGED["pp-ocrv4-det"].weight_file),
                             rec_model_path=str(rec / PACKAGED["pp-ocrv4-rec"].weight_file), use_cls=False,
                             intra_op_num_threads=threads, inter_op_num_threads=1)

    def read(self, image: np.ndarray) -> list[TextLine]:
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"expected an RGB uint8 frame, got {image.dtype} {image.shape}")
        h, w = image.shape[:2]
        scale = min(1.0, self.max_side / max(h, w))
        if scale < 1.0:
            import cv2

            image = cv2.resize(image, (round(w * scale), round(h * scale)), interpolation=cv2.INTER_AREA)
        found, _ = self._ocr(np.ascontiguousarray(image[:, :, ::-1]), use_cls=False)  # RapidOCR takes BGR
        lines = []
        for points, text, score in found or []:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            sh, sw = image.shape[:2]
            box = (min(xs) / sw, min(ys) / sh, max(xs) / sw, max(ys) / sh)
            lines.append(TextLine(str(text).strip(), tuple(round(v, 4) for v in box), round(float(score), 4)))
        return sorted((t for t in lines if t.text), key=lambda t: (round(t.box[1], 2), t.box[0]))
