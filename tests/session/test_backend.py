"""The ONNX conformance suites (node, simple, pytorch-converted, pytorch-operator) on onnxpack.

Every exclusion carries its reason.  The node suite is built from the test-case code shipped in
the onnx wheel (onnx.backend.test.case.node), the model suites from the wheel's data folder.
"""

from __future__ import annotations

import onnx.backend.test

import onnxpack.backend

backend_test = onnx.backend.test.BackendTest(onnxpack.backend, __name__)

# pattern -> reason.  Patterns are regular expressions matched against test names.
EXCLUDED: dict[str, str] = {
    r"^test_.*_cuda$": "no GPU: onnxpack runs on the CPU only",
    r"^test_resize_downsample_scales_(linear|cubic)_align_corners_cpu$": "align_corners with a scale whose output "
    "length is not exact (4 x 0.6 = 2.4 for 2 positions): onnxpack divides by the output's length minus one, as "
    "onnxruntime (and PyTorch, whose align_corners=True exports these) do, giving [1, 4] for [1, 2, 3, 4]; the stored "
    "outputs divide by 2.4 - 1 (onnx.reference's rule), [1, 3.14].  test_kernels_tensor checks the rule against "
    "onnxruntime",
    r"^test_bernoulli": "random sampling: outputs cannot match stored ones (onnx.reference fails these too)",
    r"^test_gradient_of_add": "ai.onnx.preview.training Gradient: a training op, no inference implementation "
    "(onnx.reference has none either)",
    r"^test_if_opt_cpu$": "the runner cannot compare an optional(sequence) output with the stored one "
    "(ours equals onnx.reference's, which fails this case the same way)",
    r"^test_loop16_seq_none_cpu$": "the runner cannot compare a sequence output containing a 0-d tensor "
    "(ours equals onnx.reference's, which fails this case the same way)",
    r"^test_squeezenet_cpu$": "light_squeezenet's last conv (512 -> 1000, 1x1) has every weight and bias equal "
    "(ConstantOfShape 0.02), so its 1000 logits are equal in exact arithmetic and ~1e10 in size; the stored "
    "softmax (all 0.001) holds only if the GEMM rounds every row the same way.  OpenBLAS does not: its "
    "micro-kernel's row positions round differently (measured on this input: 3-4 distinct rows of W @ X "
    "with W all 0.02), so the logits differ by ~1e3 and the softmax by up to 0.03 -- whether it happens "
    "depends on the input's bits, which this session's conv_shift path for the 16 -> 64 3x3 convs changed "
    "within float32 rounding.  test_light_squeezenet_logits_match_onnxruntime checks the logits instead",
}
for _pattern, _reason in EXCLUDED.items():
    backend_test.exclude(_pattern)

globals().update(backend_test.enable_report().test_cases)


def test_light_squeezenet_logits_match_onnxruntime():
    """The light squeezenet of the model suite (excluded above: its stored softmax output is
    rounding noise) up to its logits, against onnxruntime, at float32 rounding of their scale."""
    import os

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper

    import onnxpack

    folder = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    model = onnx.load(os.path.join(folder, "light_squeezenet.onnx"))
    assert model.graph.node[-1].op_type == "Softmax"
    logits = model.graph.node[-1].input[0]
    del model.graph.output[:]
    model.graph.output.extend([helper.make_tensor_value_info(logits, onnx.TensorProto.FLOAT, None)])
    data = model.SerializeToString()
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    got = onnxpack.InferenceSession(data).run(None, {"data_0": x})[0]
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"data_0": x})[0]
    assert got.shape == want.shape == (1, 1000, 1, 1)
    # every layer's float32 sums in another order: measured 1.4e-6 of the scale at the deepest layers
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))
