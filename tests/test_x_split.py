"""x in two 16-bit parts (fm_plan.x_split): a network of at most 5 input features computes the layers that read x
from [x_hi | x_lo | x_hi] against [W_hi | W_hi | W_lo], W x to about float32's rounding, where one rounded product
left a phase error in a sine first layer (SIREN's 30 x, Fourier features 2 pi x B) that the whole network carried.
The plan rule and the packed weights on the CPU, ahead-of-time compiles of every fused form, and (marked `gpu`) the
error against float64 with the split and without it."""

import re

import numpy as np
import pytest

import fusedmlp
from fusedmlp import _api
from conftest import rel_l2

H100 = dict(smem_per_block=232448, sm_count=132, smem_per_sm=233472)


def fourier(rng, inputs=2, sigma=10.0, width=64, concat=None, dtype="float16", device="cpu"):
    """Fourier features of x (sin and cos of 2 pi x B, B ~ N(0, sigma^2): one sine layer of B's rows twice, the cos
    copy's bias pi / 2), then a relu layer (reading x again where concat) and a linear head."""
    b = rng.normal(0.0, sigma, (width // 2, inputs)) * 2 * np.pi
    w0 = np.concatenate([b, b]).astype(np.float32)
    b0 = np.concatenate([np.zeros(width // 2), np.full(width // 2, np.pi / 2)]).astype(np.float32)
    k1 = width + (inputs if concat else 0)
    w1 = rng.uniform(-1, 1, (width, k1)).astype(np.float32) / np.sqrt(k1)
    w2 = rng.uniform(-1, 1, (3, width)).astype(np.float32) / np.sqrt(width)
    return fusedmlp.FusedMLP([w0, w1, w2], [b0, rng.uniform(-0.1, 0.1, width).astype(np.float32), None],
                             activation=["sin", "relu", "none"], concat={1: concat} if concat else None,
                             dtype=dtype, device=device)


def siren(rng, device="cpu", dtype="float16"):
    """SIREN as its paper initialises it: sin(30 (W x + b)) first (here the 30 inside W and b), 256 wide."""
    n = 256
    ws = [rng.uniform(-0.5, 0.5, (n, 2)) * 30] + [rng.uniform(-1, 1, (n, n)) * np.sqrt(6 / n) for _ in range(2)]
    ws.append(rng.uniform(-1, 1, (3, n)) * np.sqrt(6 / n))
    bs = [rng.uniform(-0.5, 0.5, n) * 30] + [rng.uniform(-0.1, 0.1, n) for _ in range(2)] + [None]
    return fusedmlp.FusedMLP([w.astype(np.float32) for w in ws], [None if b is None else b.astype(np.float32)
                                                                   for b in bs],
                             activation=["sin", "sin", "sin", "none"], dtype=dtype, device=device)


def weight_rows(plan, layer, rows, cols):
    """Layer `layer`'s stored weights (an mma.sync plan's blob: rows of K + 8 halves from the layer's offset) as
    float64, rows x cols."""
    src = _api._source_of(plan)
    offset = int(re.findall(r"W_OFF = (\d+)", src)[layer])
    k = int(re.findall(r"static constexpr int K = (\d+)", src)[layer])
    dtype = np.float16 if plan.info["precision"] == "float16" else None
    blob = np.frombuffer(plan.packed_weights(), np.uint16)
    bits = blob[offset:offset + rows * (k + 8)].reshape(rows, k + 8)[:, :cols]
    if dtype is None:  # bfloat16: the high half of a float32
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("concat", ["after", "before"])
def test_the_layers_reading_x_store_w_hi_w_hi_w_lo(rng, dtype, concat):
    mlp = fourier(rng, inputs=3, concat=concat, dtype=dtype)
    plan = mlp._net.plan(80, precision=dtype)
    assert plan.info["x_split"] == 1
    w0 = weight_rows(plan, 0, 64, 9)
    want = mlp._w[0].astype(np.float64)
    assert np.array_equal(w0[:, :3], w0[:, 3:6])  # W_hi at x_hi's and at x_lo's columns
    step = 2.0 ** -11 if dtype == "float16" else 2.0 ** -8
    assert np.max(np.abs(w0[:, :3] - want) / np.abs(want)) <= step  # hi alone: one rounding
    assert np.max(np.abs(w0[:, :3] + w0[:, 6:9] - want) / np.abs(want)) <= step ** 2  # hi + lo: two
    w1 = mlp._w[1].astype(np.float64)
    x_part = w1[:, 64:] if concat == "after" else w1[:, :3]
    stored = weight_rows(plan, 1, 64, 128)
    at = 64 if concat == "after" else 0  # the x part's first stored column (h's 64 columns are one padded part)
    assert np.array_equal(stored[:, at:at + 3], stored[:, at + 3:at + 6])
    assert np.max(np.abs(stored[:, at:at + 3] + stored[:, at + 6:at + 9] - x_part)) <= step ** 2 * np.abs(
        x_part).max() * 2
    h_part = w1[:, :64] if concat == "after" else w1[:, 3:]
    h_at = 0 if concat == "after" else 16
    assert np.max(np.abs(stored[:, h_at:h_at + 64] - h_part)) <= step * np.abs(h_part).max()  # h's: one part


def test_where_x_splits(rng):
    """16-bit plans of at most 5 input features whose x is no residual operand; x_split=-1 turns it off, x_split=1
    names why it cannot be."""
    assert fourier(rng)._net.plan(90, **H100).info["x_split"] == 1
    assert fourier(rng)._net.plan(90, **H100, x_split=-1).info["x_split"] == 0
    assert fourier(rng, dtype="tf32")._net.plan(80, precision="tf32").info["x_split"] == 0
    six = fourier(rng, inputs=6)
    assert six._net.plan(90, **H100).info["x_split"] == 0
    with pytest.raises(fusedmlp.LimitError, match="x has more than 5 features"):
        six._net.plan(90, **H100, x_split=1)
    ws = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2)]
    res = fusedmlp.FusedMLP(ws, [None, None], activation=["relu", "none"], residual={1: ("add", "none", "input")},
                            device="cpu")
    with pytest.raises(fusedmlp.LimitError, match="adds or multiplies x itself"):
        res._net.plan(90, **H100, x_split=1)
    with pytest.raises(fusedmlp.ArgumentError, match="x_split=2"):
        fourier(rng)._net.plan(90, x_split=2)


FORMS = [(80, {}), (90, {"wgmma": 1, "cluster": -1}), (90, {"wgmma": 1, "resident": 0}), (90, {"cluster": 2}),
         (90, {"wgmma": 1, "cluster": -1, "kpipe": 1, "warps": 4})]


@pytest.mark.parametrize("arch, options", FORMS, ids=lambda v: str(v))
def test_split_kernels_compile_ahead_of_time(rng, tmp_path, arch, options):
    from test_lowbit import nvrtc_or_skip

    nvrtc_or_skip()
    cache = fusedmlp._cache.KernelCache(tmp_path)
    for io, concat in (("float32", "after"), ("float16", None), ("bfloat16", "before")):
        if options.get("kpipe") or options.get("cluster", 0) > 0:
            concat = None  # (neither the K-pipelined nor the cluster form takes a concat)
        mlp = fourier(rng, inputs=3, concat=concat)
        plan, source = mlp._render(arch, H100["smem_per_block"], H100["sm_count"], io, io, H100["smem_per_sm"],
                                   **options)
        assert plan.info["x_split"] == 1 and "constexpr int X_PARTS = 3;" in source
        fusedmlp._api.compile_cubin(source, arch, cache, plan.info["wgmma"])


# ------------------------------------------------------------------------------------------------ on the GPU

GPU_FORMS = [{"wgmma": 0}, {"wgmma": 1, "cluster": -1}, {"wgmma": 1, "resident": 0}, {"cluster": 2}]


@pytest.mark.gpu
@pytest.mark.parametrize("io, dtype", [("float32", "float16"), ("float16", "float16"), ("float32", "bfloat16")])
def test_gpu_split_x_carries_a_sine_first_layer_to_float32_accuracy(rng, io, dtype):
    """Against float64, the same kernel with x whole (x_split=-1) and split, in each fused form that takes it: the
    split is well inside the whole form's error, and float16 x (exact in the kernel: x_lo = 0) still gains W_lo.
    bfloat16: two 8-bit parts, x to 2^-16 where one part is 2^-8; its bound is bfloat16's own."""
    from test_gpu import graph_reference, run_io_kernel

    arch = fusedmlp._api._gpu(0).info["arch"]
    bound = 2e-3 if dtype == "float16" else fusedmlp.CHECK_TOLERANCES["bfloat16"]
    report = []
    for name, mlp in (("fourier sigma=10", fourier(rng, device="cuda", concat="after", dtype=dtype)),
                      ("siren w0=30", siren(rng, device="cuda", dtype=dtype))):
        x = rng.uniform(-1, 1, (4099, mlp.widths[0])).astype(np.float32)
        for form in GPU_FORMS if arch == 90 else [{}]:
            errs = []
            for split in (-1, 0):
                try:
                    kernel, plan = mlp._build(io, x_split=split, **form)[:2]
                except fusedmlp.LimitError:
                    break
                x_seen, y = run_io_kernel(kernel, x, io)
                errs.append(rel_l2(y, graph_reference(x_seen, mlp._w, mlp._b, mlp)))
                assert plan.info["x_split"] == (split == 0)
            if len(errs) == 2:
                report.append(f"{name} {form} {io} {dtype}: whole {errs[0]:.2e}, split {errs[1]:.2e}")
                assert errs[1] <= 0.5 * errs[0] and errs[1] <= bound, report[-1]
    print("\n" + "\n".join(report))
    assert report

