"""Crash safety: SIGKILL a saving process at random points; the output is the previous one or
the new one complete, and the input is untouched byte for byte."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from onnxpack.graph import load_model, save_model

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

TRIALS = 4  # a few in CI; each is one subprocess save of ~32 MB
_CHILD = textwrap.dedent("""
    import sys
    from onnxpack.graph import load_model, save_model
    src, out = sys.argv[1], sys.argv[2]
    model = load_model(src)
    print("ready", flush=True)
    save_model(model, out, min_size=1024)
    print("done", flush=True)
""")


def _hashes(folder) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(folder)) if not f.startswith(".")}


def _weights(path) -> dict[str, bytes]:
    model = load_model(path)
    return {k: hashlib.sha256(bytes(t.raw())).hexdigest()
            for s in model.scopes() for k, t in s.initializers.items()}


def _run_child(src, out, delay: float | None) -> bool:
    """Runs one save; kills it ``delay`` seconds after it starts saving.  Returns whether it
    finished (or, with ``delay=None``, how long the save took)."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    if delay is None:
        t0 = time.perf_counter()
        assert proc.stdout.readline().strip() == "done", proc.stderr.read()
        elapsed = time.perf_counter() - t0
        proc.wait(timeout=120)
        return elapsed
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return proc.returncode == 0


def test_sigkill_during_save(tmp_path, build_module):
    src_dir = tmp_path / "in"
    out_dir = tmp_path / "out"
    src_dir.mkdir()
    out_dir.mkdir()
    src = src_dir / "chain.onnx"
    build_module.make_matmul_chain(str(src), n_layers=8, dim=1024, seed=0)  # 32 MB
    prev_src = tmp_path / "prev.onnx"
    build_module.make_matmul_chain(str(prev_src), n_layers=8, dim=1024, seed=1)
    new_weights = _weights(src)
    prev_weights = _weights(prev_src)
    assert new_weights != prev_weights
    input_hashes = _hashes(src_dir)

    # Measure how long one save takes (from "ready"), to spread kill points over it.
    duration = max(_run_child(src, out_dir / "probe.onnx", None), 0.02)
    rng = random.Random(20240601)
    outcomes = []
    for trial in range(TRIALS):
        in_place = trial % 2 == 1
        if in_place:  # output path == input path: a copy of the input is the "previous" output
            work = tmp_path / f"inplace{trial}"
            work.mkdir()
            for f in os.listdir(src_dir):
                shutil.copy(src_dir / f, work / f)
            target = work / "chain.onnx"
            child_src = target
            previous = new_weights
            before = _hashes(work)
        else:
            save_model(load_model(prev_src), out_dir / "model.onnx")  # the previous output
            target = out_dir / "model.onnx"
            child_src = src
            previous = prev_weights
            before = _hashes(out_dir)
        delay = rng.uniform(0, duration * 1.6)  # some kills land after the end
        finished = _run_child(child_src, target, delay)
        got = _weights(target)  # loads completely (bounds checked) or raises
        assert got in (previous, new_weights), f"trial {trial}: torn output after {delay:.3f}s"
        if in_place:
            # the previous files are untouched: every file that existed is byte-identical
            after = _hashes(target.parent)
            assert all(after[f] == h for f, h in before.items() if f != "chain.onnx")
        outcomes.append((round(delay, 3), finished, got == previous))
        assert _hashes(src_dir) == input_hashes  # the input never changes
    print(f"save takes {duration:.3f}s; kill outcomes (delay, finished, previous):", outcomes)
