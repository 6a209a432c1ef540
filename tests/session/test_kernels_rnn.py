"""RNN, LSTM and GRU: native vs onnx.reference / onnxruntime, packed (W, R, B) vs unpacked.

onnx.reference is the oracle for plain runs (all directions, layouts, initial states, GRU's
linear_before_reset, LSTM peepholes); it ignores ``sequence_lens``, ``clip`` and custom
activations, so onnxruntime is the oracle for those.  Tolerances: float32 rtol 1e-4 / atol 1e-5;
float16 rtol 1e-2 / atol 1e-2 (we compute in float32).  Packed vs unpacked: rtol 1e-6 / atol 1e-6.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from kernel_util import assert_close, make_node, run_ort, run_native, run_reference

import onnxpack
from onnxpack.errors import InvalidArgument, InvalidGraph, RuntimeFailure
from onnxpack.session.kernels import KernelContext, TensorInfo, lookup

PACK_TOL = dict(rtol=1e-6, atol=1e-6)
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def make_case(op, *, direction="forward", layout=0, seq=5, batch=3, inp=4, hidden=6, dtype=np.float32,
              bias=True, init=False, peep=False, seq_lens=None, seed=0, **attrs):
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    x_shape = (batch, seq, inp) if layout else (seq, batch, inp)
    st_shape = (batch, nd, hidden) if layout else (nd, batch, hidden)
    inputs = {
        "X": rng.standard_normal(x_shape).astype(dtype),
        "W": (rng.standard_normal((nd, g * hidden, inp)) * 0.5).astype(dtype),
        "R": (rng.standard_normal((nd, g * hidden, hidden)) * 0.5).astype(dtype),
        "B": (rng.standard_normal((nd, 2 * g * hidden)) * 0.5).astype(dtype) if bias else None,
        "sequence_lens": None if seq_lens is None else np.array(seq_lens, dtype=np.int32),
        "initial_h": rng.standard_normal(st_shape).astype(dtype) if init else None,
    }
    if op == "LSTM":
        inputs["initial_c"] = rng.standard_normal(st_shape).astype(dtype) if init else None
        inputs["P"] = (rng.standard_normal((nd, 3 * hidden)) * 0.5).astype(dtype) if peep else None
    names = [n if v is not None else "" for n, v in inputs.items()]
    while names and not names[-1]:
        names.pop()
    values = list(inputs.values())[: len(names)]
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    if layout:
        attrs["layout"] = 1
    node = make_node(op, names, outputs, hidden_size=hidden, direction=direction, **attrs)
    return node, values


def check_packed(node, values, got, opset=14):
    packable = [i for i in (1, 2, 3) if i < len(values) and values[i] is not None]
    packed = run_native(node, values, opset, pack=packable)
    for p, u in zip(packed, got):
        np.testing.assert_allclose(p.astype(np.float64), u.astype(np.float64), **PACK_TOL)


CASES = [
    ("fwd", dict()),
    ("rev", dict(direction="reverse")),
    ("bidi", dict(direction="bidirectional")),
    ("bidi-init", dict(direction="bidirectional", init=True)),
    ("nobias", dict(bias=False)),
    ("layout1", dict(layout=1, direction="bidirectional", init=True)),
    ("batch1-seq1", dict(batch=1, seq=1)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rnn_matches_reference_and_packed(case, op, dtype):
    node, values = make_case(op, dtype=dtype, **case[1])
    got = run_native(node, values, 14)
    assert_close(got, run_reference(node, values, 14), dtype)
    check_packed(node, values, got)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_gru_linear_before_reset(direction):
    node, values = make_case("GRU", direction=direction, init=True, linear_before_reset=1)
    got = run_native(node, values, 14)
    assert_close(got, run_reference(node, values, 14), np.float32)
    check_packed(node, values, got)


def test_lstm_peepholes():
    node, values = make_case("LSTM", direction="bidirectional", init=True, peep=True)
    got = run_native(node, values, 14)
    assert_close(got, run_reference(node, values, 14), np.float32)
    check_packed(node, values, got)


ORT_CASES = [
    ("seqlens-fwd", dict(seq_lens=[5, 2, 3])),
    ("seqlens-bidi", dict(seq_lens=[1, 5, 3], direction="bidirectional", init=True)),
    ("seqlens-rev-zero", dict(seq_lens=[4, 0, 5], direction="reverse", init=True)),
    ("clip", dict(clip=0.7, direction="bidirectional")),
    ("acts", dict(activations=["HardSigmoid", "Relu", "Tanh"], activation_alpha=[0.3], activation_beta=[0.4])),
]


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("case", ORT_CASES, ids=[c[0] for c in ORT_CASES])
def test_rnn_matches_onnxruntime(case, op):
    kwargs = dict(case[1])
    if op != "LSTM" and "activations" in kwargs:
        kwargs["activations"] = kwargs["activations"][: {"GRU": 2, "RNN": 1}[op]]
    node, values = make_case(op, **kwargs)
    got = run_native(node, values, 14)
    assert_close(got, run_ort(node, values, 14), np.float32)
    check_packed(node, values, got)


def test_gru_linear_before_reset_with_seqlens_matches_onnxruntime():
    node, values = make_case("GRU", seq_lens=[2, 5, 4], direction="bidirectional", linear_before_reset=1, init=True)
    assert_close(run_native(node, values, 14), run_ort(node, values, 14), np.float32)


def test_only_y_output_and_old_opset():
    node, values = make_case("LSTM")
    node = make_node("LSTM", list(node.input), ["Y"], hidden_size=6)
    got = run_native(node, values, 7)
    assert len(got) == 1
    assert_close(got, run_reference(node, values, 7)[:1], np.float32)


def _kernel(node, opset=14):
    return lookup("", node.op_type, opset)(node, KernelContext(opset, {"": opset}))


def test_input_forget_is_native():
    """input_forget=1 runs on the native kernel (it used to fall back to onnx.reference, which
    ignores it); its arithmetic is checked against onnxruntime in test_lstm_gates_match_onnxruntime."""
    node, _ = make_case("LSTM", input_forget=1)
    assert _kernel(node).input_forget


def test_packed_layouts():
    """W/R become per-direction transposes (nd, I, G*H) float32; GRU's B keeps Rb_h apart."""
    node, values = make_case("GRU", direction="bidirectional", dtype=np.float16)
    k = _kernel(node)
    w, r, b = values[1], values[2], values[3]
    for i, arr in ((1, w), (2, r)):
        info = TensorInfo("w", arr.dtype, arr.shape, onnx.TensorProto.FLOAT16)
        (buf,) = k.prepack(i, arr)
        assert k.expected_packed(i, info) == [(np.dtype(np.float32), buf.shape)]
        assert buf.flags.c_contiguous
        np.testing.assert_array_equal(buf, arr.astype(np.float32).transpose(0, 2, 1))
    (bb,) = k.prepack(3, b)
    h = 6
    bf = b.astype(np.float32)
    np.testing.assert_array_equal(bb[:, : 2 * h], bf[:, : 2 * h] + bf[:, 3 * h : 5 * h])
    np.testing.assert_array_equal(bb[:, 2 * h : 3 * h], bf[:, 2 * h : 3 * h])
    np.testing.assert_array_equal(bb[:, 3 * h :], bf[:, 5 * h :])
    info = TensorInfo("b", b.dtype, b.shape, onnx.TensorProto.FLOAT16)
    assert k.check_packed(3, info, (bb,)) is None
    assert k.pack_spec(4, info) is None


@pytest.mark.parametrize("case", [("fwd", dict()), ("rev", dict(direction="reverse")),
                                  ("bidi-init", dict(direction="bidirectional", init=True)),
                                  ("layout1", dict(layout=1, direction="bidirectional", init=True)),
                                  ("seq1", dict(batch=1, seq=1, hidden=128, inp=128)),
                                  ("small-bidi", dict(seq=2, batch=2, layout=1, direction="bidirectional", init=True)),
                                  ("long", dict(seq=40, batch=2, hidden=33))], ids=lambda c: c[0])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_lstm_jit_recurrence_equals_numpy_loop(case, pack, monkeypatch):
    """The default-activation LSTM's numba recurrence (_rnn_jit) against the numpy loop: every
    output within float32 rounding of the step loop's (rtol 1e-5 / atol 1e-6 over up to 40
    steps), packed and unpacked weights, both directions, batch-first layout."""
    from onnxpack.session.kernels import _act

    if _act.load_jit("_rnn_jit", "test") is None:
        pytest.skip("numba is not installed")
    node, values = make_case("LSTM", **case[1])
    packable = [i for i in (1, 2, 3) if i < len(values) and values[i] is not None] if pack else []
    calls = []
    mod = _act.load_jit("_rnn_jit", "test")
    for fn in ("lstm_standard", "lstm_small"):
        monkeypatch.setattr(mod, fn, lambda *a, _real=getattr(mod, fn), _fn=fn: calls.append(_fn) or _real(*a))
    jit = run_native(node, values, 14, pack=packable)
    # The JIT ran: the projection made in it for a few (step, batch row) pairs, else by BLAS.
    seq, batch = values[0].shape[:2]
    assert set(calls) == {"lstm_small" if seq * batch <= 4 else "lstm_standard"}
    monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    ref = run_native(node, values, 14, pack=packable)
    assert len(jit) == len(ref) == 3
    for a, b in zip(jit, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("outputs", [1, 2, 3])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_a_small_lstm_repeated_takes_its_fast_path_with_the_same_results(direction, outputs):
    """A one-direction LSTM on a short input with packed weights and both initial states (Silero
    VAD's): after a first call through the general plumbing, calls with the same shapes take
    LSTM.run's fast path, whose outputs equal a fresh kernel's general path bit for bit and
    onnx.reference's within float32 rounding; other shapes, a missing state or another
    dtype take the general path."""
    from onnxpack.session.kernels import _act

    if _act.load_jit("_rnn_jit", "test") is None:
        pytest.skip("numba is not installed")
    node, values = make_case("LSTM", direction=direction, seq=2, batch=1, inp=8, hidden=16, init=True)
    del node.output[outputs:]

    def packed_kernel():
        k = _kernel(node)
        for i in (1, 2, 3):
            k.use_prepacked(i, k.prepack(i, values[i]))
        return k

    k = packed_kernel()
    rng = np.random.default_rng(1)
    for step in range(4):  # the first call general, the next ones fast; new states each time
        feeds = [values[0] if step == 0 else rng.standard_normal(values[0].shape).astype(np.float32), None, None, None,
                 None, rng.standard_normal(values[5].shape).astype(np.float32),
                 rng.standard_normal(values[6].shape).astype(np.float32)]
        got = k.run(*feeds)
        assert k._fast is not None and len(got) == outputs  # (armed by the first call)
        if step == 0:
            general = k._run
            k._run = lambda *a, **kw: pytest.fail("the general path ran")  # the fast path from here on
        want = packed_kernel().run(*feeds)  # a fresh kernel: the general path
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and a.flags.c_contiguous
            np.testing.assert_array_equal(a, b)
        ref = run_reference(node, [feeds[0]] + values[1:4] + [None] + feeds[5:], 14)
        assert_close(list(got), ref[:outputs], np.float32)
    k._run = general
    longer = rng.standard_normal((3,) + values[0].shape[1:]).astype(np.float32)  # another shape
    feeds = [longer, None, None, None, None, values[5], values[6]]
    for a, b in zip(k.run(*feeds), packed_kernel().run(*feeds)):
        np.testing.assert_array_equal(a, b)
    no_c = k.run(values[0], None, None, None, None, values[5])  # no initial_c: zeros, the general path
    for a, b in zip(no_c, packed_kernel().run(values[0], None, None, None, None, values[5])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", [0, 1])
def test_bidirectional_lstm_directions_on_two_threads(layout, monkeypatch):
    """A bidirectional LSTM's two JIT recurrences split over two threads (the split forced): each
    direction on its own thread, outputs bit for bit those of the directions one after the other,
    and within float32 rounding of the numpy loop."""
    import threading

    from onnxpack.session.kernels import _act

    mod = _act.load_jit("_rnn_jit", "test")
    if mod is None:
        pytest.skip("numba is not installed")
    node, values = make_case("LSTM", seq=12, batch=3, hidden=40, inp=24, layout=layout,
                             direction="bidirectional", init=True)
    idents = []
    real = mod.lstm_standard

    def recorded(*a):
        idents.append(threading.get_ident())
        import time

        time.sleep(0.01)  # both directions in flight at once when split
        return real(*a)

    monkeypatch.setattr(mod, "lstm_standard", recorded)
    monkeypatch.setattr(_act, "threads", lambda: 2)
    outs = {}
    for split in (True, False):
        tuner = _act.SplitTuner()
        tuner.threads, tuner.choice = 2, split
        monkeypatch.setattr(_act, "tuner", lambda key, _t=tuner: _t)
        idents.clear()
        outs[split] = run_native(node, values, 14, pack=[1, 2, 3])
        assert len(idents) == 2 and (len(set(idents)) == 2) == split
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    ref = run_native(node, values, 14, pack=[1, 2, 3])
    for a, b in zip(outs[True], ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _mlas_inputs() -> np.ndarray:
    """Both tails, the clamps (9, 18) and around them, zeros, normal draws, NaN and infinities."""
    grid = np.linspace(-25, 25, 100001, dtype=np.float32)
    draws = (np.random.default_rng(3).standard_normal(20000) * 4).astype(np.float32)
    edges = np.array([0.0, -0.0, 9.0, -9.0, 18.0, -18.0, 1e-30, -1e-30, np.inf, -np.inf, np.nan], np.float32)
    return np.concatenate([grid, draws, edges])


@pytest.mark.parametrize("op", ["Sigmoid", "Tanh"])
def test_mlas_activations_are_onnxruntimes(op):
    """rnn.mlas_logistic / mlas_tanh (the quantized LSTM's gates) give onnxruntime's Sigmoid and
    Tanh bit for bit (its x86 MLAS kernels), NaN included; the JIT cell's scalar versions too."""
    from onnxpack.session.kernels import rnn

    x = _mlas_inputs()
    node = make_node(op, ["x"], ["y"])
    (want,) = run_ort(node, [x], 17)
    got = (rnn.mlas_logistic if op == "Sigmoid" else rnn.mlas_tanh)(x)
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.array_equal(np.isnan(got), np.isnan(want))


def test_lstm_cell_mlas_equals_the_numpy_cell():
    """The JIT cell of the quantized LSTM (_rnn_jit.lstm_cell_mlas) == the numpy formulas it
    replaces (MLAS logistic and tanh, ``c * f + i * g``, ``tanh(c) * o``), bit for bit."""
    from onnxpack.session.kernels import _act, rnn

    jit = _act.load_jit("_rnn_jit", "LSTM")
    if jit is None:
        pytest.skip("numba is not available")
    rng = np.random.default_rng(4)
    gates = (rng.standard_normal((3, 4 * 50)) * 6).astype(np.float32)
    gates[0, :8] = [np.nan, np.inf, -np.inf, 18.5, -18.5, 9.5, -9.5, 0.0]
    c = (rng.standard_normal((3, 50)) * 2).astype(np.float32)
    h_jit, c_jit = np.empty_like(c), c.copy()
    jit.lstm_cell_mlas(gates, c_jit, h_jit)
    i, o, f = (rnn.mlas_logistic(gates[:, k * 50:(k + 1) * 50]) for k in range(3))
    g = rnn.mlas_tanh(gates[:, 150:])
    c_np = c * f
    c_np += g * i
    h_np = rnn.mlas_tanh(c_np) * o
    np.testing.assert_array_equal(c_jit, c_np)
    np.testing.assert_array_equal(h_jit, h_np)


# -- LSTM gate variants against onnxruntime (unoptimized), numba and numpy ----------------------------

@pytest.fixture(params=["numba", "numpy"])
def jit_mode(request, monkeypatch):
    """Both paths: the numba kernels where they apply, and ``ONNXPACK_DISABLE_JIT=1``."""
    from onnxpack.session.kernels import _act

    if request.param == "numpy":
        monkeypatch.setenv("ONNXPACK_DISABLE_JIT", "1")
    elif _act.load_jit("_rnn_jit", "test") is None:
        pytest.skip("numba is not installed")
    return request.param


GATE_VARIANTS = [
    # clip crossed by the peephole terms (P scaled up): onnxruntime clips after adding them
    ("clip-peep", dict(clip=0.5, peep=True), 4.0),
    ("forget", dict(input_forget=1), 1.0),  # default activations: would be the JIT's
    ("forget-peep-clip", dict(input_forget=1, clip=0.8, peep=True), 4.0),
    ("forget-acts", dict(input_forget=1, activations=["HardSigmoid", "Tanh", "Softsign"] * 2,
                         activation_alpha=[0.3, 0.3], activation_beta=[0.4, 0.4]), 1.0),
]


@pytest.mark.parametrize("seq_lens", [None, [5, 2, 0]], ids=["full", "seqlens"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("variant", GATE_VARIANTS, ids=lambda v: v[0])
def test_lstm_gates_match_onnxruntime(variant, direction, seq_lens, jit_mode, monkeypatch):
    """clip with peepholes (each gate clipped after its peephole term) and input_forget=1 (the
    forget gate 1 - i, its peephole unused) as onnxruntime computes them, without graph
    optimizations: every direction, with and without sequence_lens (a zero length included),
    packed and unpacked weights; the numba recurrence does not take these (the numpy loop does)."""
    from onnxpack.session.kernels import _act

    _, attrs, p_scale = variant
    attrs = dict(attrs)
    if direction != "bidirectional" and "activations" in attrs:
        attrs["activations"] = attrs["activations"][:3]
        attrs["activation_alpha"], attrs["activation_beta"] = [0.3], [0.4]
    node, values = make_case("LSTM", direction=direction, seq_lens=seq_lens, init=True, seq=5, batch=3, **attrs)
    if attrs.get("peep"):
        values[7] = values[7] * np.float32(p_scale)
    if jit_mode == "numba":
        mod = _act.load_jit("_rnn_jit", "test")
        for fn in ("lstm_standard", "lstm_small"):
            monkeypatch.setattr(mod, fn, lambda *a, _fn=fn: pytest.fail(f"{_fn} ran"))
    got = run_native(node, values, 14)
    assert_close(got, run_ort(node, values, 14, optimize=False), np.float32)
    check_packed(node, values, got)


# -- shapes refused: fed and constant inputs, onnxruntime refusing them too ----------------------------

def _bad(op, case):
    """(node, values, name in the message, whether onnxruntime's CPU kernel refuses the same): a
    case of make_case with one input's shape wrong."""
    g = GATES[op]
    kw = dict(direction="bidirectional" if case in ("W-dirs", "R-dirs") else "forward", seq=4, batch=3, inp=5,
              hidden=4, init=True, seq_lens=[4, 2, 3], peep=op == "LSTM")
    if case == "layout1-h0":
        kw.update(layout=1, batch=3)
    node, values = make_case(op, **kw)
    x, w, r, b, lens, h0 = values[:6]
    names = {"X": 0, "W": 1, "R": 2, "B": 3, "sequence_lens": 4, "initial_h": 5, "initial_c": 6, "P": 7}
    bad = {
        "X-2d": ("X", x[0]),
        "W-rows": ("W", w[:, :-1]),
        "W-input": ("W", w[:, :, :-1]),
        "W-dirs": ("W", w[:1]),
        "R-dirs": ("R", r[:1]),
        "R-rows": ("R", r[:, : (g - 1) * 4] if g > 1 else r[:, :3]),  # e.g. (1, 12, 4) for an LSTM of 4
        "R-hidden": ("R", r[:, :, :-1]),
        "B-short": ("B", b[:, :-1]),
        "B-3d": ("B", b[None]),
        "seqlens-short": ("sequence_lens", lens[:-1]),
        "seqlens-2d": ("sequence_lens", lens[:, None]),
        "h0-tiny": ("initial_h", np.zeros((1, 1, 1), np.float32)),
        "h0-batch": ("initial_h", h0[:, :-1]),
        "c0-tiny": ("initial_c", np.zeros((1, 1, 1), np.float32)),
        "P-short": ("P", values[7][:, :-1] if op == "LSTM" else None),
        "layout1-h0": ("initial_h", h0.transpose(1, 0, 2)),  # (num_dir, batch, H) under layout 1
    }[case]
    values = list(values)
    values[names[bad[0]]] = np.ascontiguousarray(bad[1])
    return node, values, bad[0], case != "layout1-h0"


BAD_CASES = ["X-2d", "W-rows", "W-input", "W-dirs", "R-dirs", "R-rows", "R-hidden", "B-short", "B-3d",
             "seqlens-short", "seqlens-2d", "h0-tiny", "h0-batch", "c0-tiny", "P-short", "layout1-h0"]
LSTM_ONLY = {"c0-tiny", "P-short"}


def _bad_cases():
    return [(op, c) for op in ("LSTM", "GRU", "RNN") for c in BAD_CASES if op == "LSTM" or c not in LSTM_ONLY]


@pytest.mark.parametrize("op,case", _bad_cases(), ids=lambda v: v)
def test_wrong_shapes_are_refused(op, case, jit_mode):
    """A fed input of the wrong shape (initial states, B, R, W, P, sequence_lens, X) is the
    node's InvalidArgument naming the input, expected vs got, before any arithmetic (the numba
    recurrence read and wrote past short state and bias buffers: heap corruption); onnxruntime
    refuses the same inputs."""
    node, values, name, ort_refuses = _bad(op, case)
    with pytest.raises(InvalidArgument, match=rf"\({op}\): input {name} must"):
        run_native(node, values, 14)
    if ort_refuses:
        with pytest.raises(Exception, match=rf"{name}|X must"):
            run_ort(node, values, 14, optimize=False)


def _session(node, values, constants=("W", "R", "B")):
    """An onnxpack session of ``node`` with the inputs named in ``constants`` as initializers
    (packed at creation when they fit), the others fed; (session, feeds)."""
    from onnx import helper, numpy_helper

    ins, inits, feeds = [], [], {}
    for n, v in zip(node.input, values):
        if not n or v is None:
            continue
        if n in constants:
            inits.append(numpy_helper.from_array(v, n))
        else:
            ins.append(helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), None))
            feeds[n] = v
    graph = helper.make_graph([node], "g", ins, [helper.make_value_info(o, onnx.TypeProto()) for o in node.output],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=10)
    return onnxpack.InferenceSession(model.SerializeToString()), feeds


CONSTANT_CASES = ["W-rows", "W-input", "R-rows", "R-hidden", "B-short", "B-3d", "h0-tiny"]


@pytest.mark.parametrize("op,case", [(op, c) for op in ("LSTM", "GRU", "RNN") for c in CONSTANT_CASES],
                         ids=lambda v: v)
def test_wrong_shapes_of_constant_weights_are_refused(op, case, jit_mode):
    """Constant W, R, B of the wrong shape: not packed (pack_spec declines them, prepack refuses
    them with InvalidGraph), and the run refuses them as fed ones (onnxruntime creates such a
    session and refuses at run too); a bad fed state beside packed weights is refused the same."""
    node, values, name, _ = _bad(op, case)
    index = {"W": 1, "R": 2, "B": 3}.get(name)
    if index is not None:
        k = _kernel(node)
        v = values[index]
        info = TensorInfo(name, v.dtype, v.shape, onnx.TensorProto.FLOAT)
        if case != "W-input":  # X's input size is known at run only: W packs, the run refuses it
            assert k.pack_spec(index, info) is None
            with pytest.raises(InvalidGraph, match=rf"input {name} must have shape"):
                k.prepack(index, v)
    sess, feeds = _session(node, values)
    with pytest.raises(RuntimeFailure) as err:
        sess.run(None, feeds)
    assert isinstance(err.value.__cause__, InvalidArgument)
    assert f"input {name} must have shape" in str(err.value)
    good, good_values, _, _ = _bad(op, "X-2d")  # the same node with every input right
    good_values[0] = make_case(op, seq=4, batch=3, inp=5, hidden=4)[1][0]
    sess, feeds = _session(good, good_values)
    assert_close(sess.run(None, feeds), run_ort(good, good_values, 14, optimize=False), np.float32)


def test_lstm_state_of_the_wrong_shape_is_refused_after_the_fast_path_armed(jit_mode):
    """Silero VAD's shape of LSTM (one direction, packed weights, both states: LSTM.run's fast
    path after a first call), then states of (1, 1, 1) for a hidden size of 256 (the reported
    heap corruption): InvalidArgument with onnxruntime's expected shape, and the next good call
    still gives onnxruntime's outputs."""
    node, values = make_case("LSTM", seq=2, batch=1, inp=8, hidden=256, init=True)
    sess, feeds = _session(node, values)
    want = run_ort(node, values, 14, optimize=False)
    assert_close(sess.run(None, feeds), want, np.float32)
    assert_close(sess.run(None, feeds), want, np.float32)
    for bad in ("initial_h", "initial_c"):
        wrong = dict(feeds, **{bad: np.zeros((1, 1, 1), np.float32)})
        with pytest.raises(RuntimeFailure, match=rf"input {bad} must have shape \{{1,1,256\}}.*got \{{1,1,1\}}") as err:
            sess.run(None, wrong)
        assert isinstance(err.value.__cause__, InvalidArgument)
    assert_close(sess.run(None, feeds), want, np.float32)


def test_sequence_lens_values_and_type_are_checked():
    """sequence_lens out of [0, seq_length] or not integers: InvalidArgument (onnxruntime refuses
    out-of-range lengths too)."""
    node, values = make_case("GRU", seq_lens=[4, 2, 3], seq=4)
    for lens in (np.array([5, 2, 3], np.int32), np.array([4, -1, 3], np.int32)):
        bad = values[:4] + [lens] + values[5:]
        with pytest.raises(InvalidArgument, match="sequence_lens"):
            run_native(node, bad, 14)
        with pytest.raises(Exception, match="sequence_lens"):
            run_ort(node, bad, 14, optimize=False)
    with pytest.raises(InvalidArgument, match="sequence_lens must be int32"):
        run_native(node, values[:4] + [np.array([4.0, 2.0, 3.0], np.float32)] + values[5:], 14)


def test_missing_weights_and_bad_hidden_size_are_the_graphs_errors():
    """A node without W or R, or with hidden_size 0: InvalidGraph at kernel creation (onnxruntime
    refuses such a model too)."""
    node, _ = make_case("LSTM")
    for inputs, attrs in ((["X", "W"], {}), (["X", "", "R"], {}), (list(node.input), {"hidden_size": 0})):
        bad = make_node("LSTM", inputs, ["Y"], **dict({"hidden_size": 6}, **attrs))
        with pytest.raises(InvalidGraph):
            _kernel(bad)
