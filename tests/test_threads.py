"""Python threads calling the CPU path at once: shared and separate FusedMLP objects give the single-thread results,
errors stay with the thread that caused them, and the C forward lets other threads run (it releases the GIL)."""

import threading
import time

import numpy as np
import pytest

import fusedmlp
from fusedmlp import FusedMLP, ShapeError

THREADS = 8
ROUNDS = 25


def model(seed, widths=(24, 64, 48, 10), activation="silu"):
    rng = np.random.default_rng(seed)
    ws = [rng.uniform(-1 / np.sqrt(i), 1 / np.sqrt(i), (o, i)).astype(np.float32) for i, o in zip(widths, widths[1:])]
    bs = [rng.uniform(-0.1, 0.1, o).astype(np.float32) for o in widths[1:]]
    return ws, bs


def run_threads(work):
    """Runs work(index) in THREADS threads released together; returns their results, re-raising the first failure."""
    barrier = threading.Barrier(THREADS)
    results, failures = [None] * THREADS, []

    def body(index):
        try:
            barrier.wait(timeout=30)
            results[index] = work(index)
        except BaseException as e:  # reported below, in the main thread
            failures.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a thread hung"
    if failures:
        raise failures[0]
    return results


def test_one_shared_model_from_eight_threads_gives_the_single_thread_results():
    ws, bs = model(1)
    mlp = FusedMLP(ws, bs, "silu", device="cpu")
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((int(rng.integers(1, 300)), 24)).astype(np.float32) for _ in range(THREADS)]
    expected = [mlp(x) for x in inputs]

    def work(index):
        return [mlp(inputs[(index + r) % THREADS]) for r in range(ROUNDS)]

    for index, outputs in enumerate(run_threads(work)):
        for r, y in enumerate(outputs):
            np.testing.assert_array_equal(y, expected[(index + r) % THREADS])


def test_separate_models_built_and_called_in_eight_threads_match_their_own_results():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((200, 24)).astype(np.float64)
    activations = ["relu", "tanh", "gelu", "x * sigmoid(1.702 * x)", "softplus", "elu", "mish", "hardswish"]
    expected = [FusedMLP(*model(10 + i), activations[i], device="cpu")(x) for i in range(THREADS)]

    def work(index):
        outputs = []
        for _ in range(ROUNDS // 5):  # each round builds its own model too: construction runs concurrently as well
            mlp = FusedMLP(*model(10 + index), activations[index], device="cpu")
            outputs.append(mlp(x))
        return outputs

    for index, outputs in enumerate(run_threads(work)):
        for y in outputs:
            assert y.dtype == np.float64
            np.testing.assert_array_equal(y, expected[index])


def test_shared_and_separate_models_mixed_with_errors_in_other_threads():
    ws, bs = model(4)
    shared = FusedMLP(ws, bs, "tanh", device="cpu")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 24)).astype(np.float32)
    expected = shared(x)
    wrong = np.ones((3, 23), np.float32)

    def work(index):
        seen = []
        own = FusedMLP(ws, bs, "tanh", device="cpu")
        for r in range(ROUNDS):
            if (index + r) % 3 == 0:
                with pytest.raises(ShapeError, match=r"x has shape \(3, 23\); the network takes \(batch, 24\)"):
                    (shared if r % 2 else own)(wrong)
                seen.append(None)
            else:
                seen.append((shared if r % 2 else own)(x))
        return seen

    for outputs in run_threads(work):
        assert sum(y is None for y in outputs) >= ROUNDS // 3
        for y in outputs:
            if y is not None:
                np.testing.assert_array_equal(y, expected)


def test_the_cpu_forward_lets_other_threads_run():
    # A forward of ~0.3 s: if it held the GIL throughout, the main thread could not run a single loop iteration
    # meanwhile and would see a gap as long as the call.
    ws, bs = model(6, widths=(256, 256, 256, 256, 256))
    mlp = FusedMLP(ws, bs, "relu", device="cpu")
    x = np.random.default_rng(7).standard_normal((1, 256)).astype(np.float32)
    start = time.perf_counter()
    mlp(x)
    per_row = time.perf_counter() - start
    rows = int(min(max(0.3 / max(per_row, 1e-6), 500), 200_000))
    x = np.random.default_rng(7).standard_normal((rows, 256)).astype(np.float32)
    start = time.perf_counter()
    expected = mlp(x)
    alone = time.perf_counter() - start

    result, began, started, done = [], [], threading.Event(), threading.Event()

    def call():
        began.append(time.perf_counter())
        started.set()
        result.append(mlp(x))
        began.append(time.perf_counter())
        done.set()

    thread = threading.Thread(target=call)
    thread.start()
    started.wait()
    gaps, last = [], began[0]  # the first gap runs from the moment the call began
    while not done.is_set():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    np.testing.assert_array_equal(result[0], expected)
    during = began[1] - began[0]  # the threaded call's own duration: a loaded machine stretches it and gaps alike
    assert len(gaps) > 100
    assert max(gaps) < during / 2, f"the main thread stalled {max(gaps):.3f} s during a {during:.3f} s forward " \
        f"({alone:.3f} s alone)"


def test_evaluate_fused_mlp_from_threads():
    ws, bs = model(8)
    rng = np.random.default_rng(9)
    inputs = [rng.standard_normal((50, 24)).astype(np.float32) for _ in range(THREADS)]
    expected = [fusedmlp.evaluate_fused_mlp(x, ws, bs, "gelu", device="cpu") for x in inputs]
    results = run_threads(lambda i: [fusedmlp.evaluate_fused_mlp(inputs[i], ws, bs, "gelu", device="cpu")
                                     for _ in range(5)])
    for i, outputs in enumerate(results):
        for y in outputs:
            np.testing.assert_array_equal(y, expected[i])
