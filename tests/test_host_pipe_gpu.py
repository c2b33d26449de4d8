"""Large host-array calls in pieces (csrc/host_pipe.c): each worker thread's pieces through page-locked staging must
give the bits of one copy each way (a row's outputs do not depend on the other rows), land every row exactly once,
and stay correct when two models run such calls at once on one GPU."""

import threading

import numpy as np
import pytest

import fusedmlp
from conftest import graph_weights, reference, rel_l2, torch_init
from test_gpu import graph_reference

pytestmark = pytest.mark.gpu

SLOT_BYTES = 8 << 20  # FM_PIPE_SLOT_BYTES (csrc/fm.h): a piece's x and y together


def piece_rows(n_in, n_out, itemsize):
    return (SLOT_BYTES - 256) // ((n_in + n_out) * itemsize)


def model(rng, widths, activation="relu"):
    ws, bs = torch_init(rng, widths)
    return fusedmlp.FusedMLP(ws, bs, activation, device="cuda"), ws, bs


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("widths, pieces", [((32, 64, 64, 16), 13), ((3, 128, 96, 5), 3), ((61, 256, 256, 7), 9)])
def test_pieces_give_one_copys_bits(rng, monkeypatch, dtype, widths, pieces):
    """Rows of several pieces plus a part piece (more pieces than workers, or fewer), odd row widths: the pipelined
    call's outputs are bit for bit one copy's, and near the float64 forward."""
    mlp, ws, bs = model(rng, widths, "silu")
    itemsize = np.dtype(dtype).itemsize
    rows = piece_rows(widths[0], widths[-1], itemsize) * pieces + 37
    x = rng.standard_normal((rows, widths[0])).astype(dtype)
    monkeypatch.setenv("FUSEDMLP_HOST_PIPE", "1")
    y_pieces = mlp(x)
    monkeypatch.setenv("FUSEDMLP_HOST_PIPE", "-1")
    y_one = mlp(x)
    assert y_pieces.dtype == dtype and y_pieces.shape == (rows, widths[-1])
    assert np.array_equal(y_pieces.view(np.uint8), y_one.view(np.uint8))
    ref, _ = reference(x, ws, bs, mlp.activations)
    assert rel_l2(y_pieces, ref) < 5e-3


def test_every_row_is_written_once(rng, monkeypatch):
    """Outputs poisoned with NaN on the device before each piece's launch: none left, and each row's output is its
    own row's (rows of x that differ give outputs in the same order as one copy's)."""
    mlp, ws, bs = model(rng, (16, 64, 64, 4))
    rows = piece_rows(16, 4, 4) * 20 + 5
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    kernel = mlp._kernel("float32", rows=rows)
    y = kernel.run(x, poison=True, pipeline=1)
    assert not np.isnan(y).any()
    y_one = kernel.run(x, poison=True, pipeline=0)
    assert np.array_equal(y, y_one)
    # the same rows in reverse give the outputs in reverse: no piece landed at another piece's place
    assert np.array_equal(kernel.run(np.ascontiguousarray(x[::-1]), pipeline=1), y[::-1])


def test_out_and_repeated_calls(rng, monkeypatch):
    """Into a caller's array (filled with NaN first), and again with new inputs into the same array: each call's
    outputs are its own."""
    mlp, ws, bs = model(rng, (32, 64, 64, 16))
    rows = piece_rows(32, 16, 4) * 10 + 11
    out = np.full((rows, 16), np.nan, np.float32)
    monkeypatch.setenv("FUSEDMLP_HOST_PIPE", "auto")
    for _ in range(2):
        x = rng.standard_normal((rows, 32)).astype(np.float32)
        assert mlp(x, out=out) is out
        ref, _ = reference(x, ws, bs, mlp.activations)
        assert rel_l2(out, ref) < 5e-3


def test_two_models_at_once(rng):
    """Two threads, each with its own model, calling at once on one GPU (one pipelined call at a time on the device,
    the other waits): each gets what it gets alone."""
    models = [model(rng, (32, 64, 64, 16))[0], model(rng, (24, 128, 8))[0]]
    xs = [rng.standard_normal((piece_rows(m.widths[0], m.widths[-1], 4) * 12 + 3, m.widths[0])).astype(np.float32)
          for m in models]
    alone = [m(x) for m, x in zip(models, xs)]
    results, errors = [None, None], []

    def call(i):
        try:
            for _ in range(3):
                results[i] = models[i](xs[i])
                assert np.array_equal(results[i], alone[i])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("concat", [None, {2: "before"}])
def test_a_segmented_network_in_pieces(rng, monkeypatch, dtype, concat):
    """A chain (768-wide layers run as GEMMs: a workspace per staging slot), with the input concatenated past the
    first cut or not: pieces give one copy's bits, every row written (poisoned first), near the float64 forward."""
    widths = [40, 768, 256, 768, 12]
    ws, bs = graph_weights(rng, widths, concat or {}, 1.0)
    mlp = fusedmlp.FusedMLP(ws, bs, "gelu", concat=concat, device="cuda")
    rows = piece_rows(40, 12, np.dtype(dtype).itemsize) * 5 + 19
    x = rng.standard_normal((rows, 40)).astype(dtype)
    monkeypatch.setenv("FUSEDMLP_HOST_PIPE", "1")
    y_pieces = mlp(x)
    assert mlp.segments is not None
    chain = mlp._kernel("float16" if dtype == np.float16 else "float32", rows=rows)
    assert np.array_equal(chain.run(x, poison=True, pipeline=1).view(np.uint8), y_pieces.view(np.uint8))
    monkeypatch.setenv("FUSEDMLP_HOST_PIPE", "-1")
    y_one = mlp(x)
    assert np.array_equal(y_pieces.view(np.uint8), y_one.view(np.uint8))
    assert rel_l2(y_pieces, graph_reference(x, ws, bs, mlp)) < 1e-2


def test_timing_drops_its_staging_and_a_small_call_makes_it_again(rng):
    """Kernel.time frees the rows it staged (up to the tuner's 2^21); the small calls after it stage theirs afresh
    and give the bits of before."""
    mlp, ws, bs = model(rng, (32, 64, 64, 16))
    kernel = mlp._kernel("float32", rows=4096)
    x = rng.standard_normal((4096, 32)).astype(np.float32)
    before = kernel.run(x, pipeline=0)
    assert kernel.time(1 << 16, 2) > 0
    assert np.array_equal(kernel.run(x, poison=True, pipeline=0), before)
    assert np.array_equal(kernel.run(x[:100], pipeline=0), before[:100])
