"""Threads and processes: one session run from many threads, sessions created and closed from
many threads on one shared container, processes sharing one cache file and one optimized model.

Counts here are the CI form; ``benchmarks/fuzz_campaign.py`` runs 8 threads x 200 runs, 8 threads
x 25 sessions and 4 processes.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import warnings

import numpy as np
import onnx
import pytest

from onnxpack import InferenceSession, PrepackedWeightsContainer
from onnxpack.prepack import cache_file as cf

import reliability_harness as harness

THREADS = 8


def run_threads_one_session(path: str, feeds: dict, expected: list, threads: int, runs: int) -> int:
    """``threads`` threads x ``runs`` runs on one session; returns the number of runs checked."""
    with InferenceSession(path) as s:
        def work(_):
            for _ in range(runs):
                for got, want in zip(s.run(None, feeds), expected):
                    np.testing.assert_array_equal(got, want)
            return runs

        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            return sum(ex.map(work, range(threads)))


def run_threads_shared_container(path: str, feeds: dict, expected: list, threads: int, sessions: int) -> int:
    container = PrepackedWeightsContainer()

    def work(_):
        for _ in range(sessions):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with InferenceSession(path, prepacked_weights_container=container) as s:
                    for got, want in zip(s.run(None, feeds), expected):
                        np.testing.assert_array_equal(got, want)
        return sessions

    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        done = sum(ex.map(work, range(threads)))
    assert len(container) == 0, f"container still holds {len(container)} entries"
    return done


def test_threads_on_one_session(bases, tmp_path):
    base = bases["transformer"]
    for name, data in base["files"].items():
        (tmp_path / name).write_bytes(data)
    n = run_threads_one_session(str(tmp_path / base["entry"]), base["feeds"], base["expected"], THREADS, 25)
    assert n == THREADS * 25


@pytest.mark.parametrize("sample", ["mlp", "subgraphs"])
def test_threads_sharing_one_container(bases, tmp_path, sample):
    base = bases[sample]
    for name, data in base["files"].items():
        (tmp_path / name).write_bytes(data)
    n = run_threads_shared_container(str(tmp_path / base["entry"]), base["feeds"], base["expected"], THREADS, 4)
    assert n == THREADS * 4


def test_file_checks_from_other_threads_while_the_table_changes():
    """A session guards the data files its shared blobs map, which another session (another
    thread) may be closing: ``DataFiles.check`` / ``paths`` must not iterate the file table while
    it changes.  With the interpreter switching threads every microsecond, the table rewritten in
    one thread and checked in another; iterating the table itself raised "dictionary changed size
    during iteration" here within a few thousand checks (and once in CI, in
    test_threads_sharing_one_container)."""
    import sys
    import threading

    from onnxpack.graph._external import DataFiles, _MappedFile

    files = DataFiles(None)
    mapped = [_MappedFile(f"/nowhere/{i}", 0, (0, i, 0, 0), None, -1) for i in range(64)]
    for i, m in enumerate(mapped):
        files._files[f"l{i}"] = m
    errors: list[BaseException] = []
    stop = threading.Event()

    def rewrite():
        i = 0
        while not stop.is_set():
            key = f"l{i % 64}"
            m = files._files.pop(key, None)
            files._files[key] = m if m is not None else mapped[i % 64]
            i += 1

    def check():
        try:
            for _ in range(20000):
                files.check()
                assert files.paths() <= {m.path for m in mapped}
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        writer, reader = threading.Thread(target=rewrite), threading.Thread(target=check)
        writer.start()
        reader.start()
        reader.join()
        stop.set()
        writer.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors


def run_processes(bases: dict, folder: str, processes: int, repeats: int) -> tuple[int, set[str], int]:
    """``processes`` spawned processes share one optimized model and one (initially absent) cache
    file; returns (sessions run, distinct output digests, cache entries)."""
    base = bases["fuzzmix"]
    for name, data in base["files"].items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    plain = os.path.join(folder, "plain.onnx")  # in-proto weights: one content key per weight
    onnx.save_model(harness.model_proto(harness.FUZZMIX), plain)
    cache = os.path.join(folder, "shared.cache")
    ctx = multiprocessing.get_context("spawn")
    args = (os.path.join(folder, base["entry"]), plain, cache, base["feeds"], repeats)
    with ctx.Pool(processes) as p:
        results = p.starmap(harness.process_job, [args] * processes)
    digests = {d for r in results for d in r}
    entries = len(cf.info(cache).entries)  # raises if the file is not valid
    return sum(len(r) for r in results), digests, entries


def test_processes_share_one_cache_file_and_one_optimized_model(bases, tmp_path):
    sessions, digests, entries = run_processes(bases, str(tmp_path), 4, 2)
    assert sessions == 4 * 2 * 2
    assert len(digests) == 1  # every process, both models: identical outputs
    assert entries == 3  # Wg, Wh, Wg2 packed once, whoever appended first
