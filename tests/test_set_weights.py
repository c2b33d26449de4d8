"""FusedMLP.set_weights: new weights of the same architecture taken in place (the kernels' device buffers rewritten,
their code kept), and FusedModule's rebuilds after an optimizer step through it. On the CPU: the outputs, the blobs
every plan made before packs (what Network.assign uploads into a loaded kernel), and the rule that the source stays
exactly where the call says it took the weights in place. tests/test_set_weights_gpu.py runs the kernels."""

import numpy as np
import pytest

import fusedmlp
from conftest import graph_weights, torch_init
from test_graphs import random_graph

H100 = (90, 232448, 132, 233472)  # arch, shared memory per block, SMs, per SM


def random_case(seed):
    """A random graph (residuals, concats) with random norms, softmax heads and biases left out, as FusedMLP kwargs."""
    rng = np.random.default_rng(seed)
    widths, ws, bs, acts, residual, concat = random_graph(rng)
    bs = [None if rng.random() < 0.2 else b for b in bs]
    norm = {}
    for l in range(len(ws) - 1):
        if residual[l] is None and rng.random() < 0.3:
            affine = rng.random() < 0.6
            norm[l] = (str(rng.choice(["layernorm", "rmsnorm"])),
                       rng.uniform(0.5, 1.5, widths[l + 1]).astype(np.float32) if affine else None,
                       rng.normal(0, 0.2, widths[l + 1]).astype(np.float32) if affine and rng.random() < 0.7 else None)
    if widths[-1] > 1 and residual[-1] is None and rng.random() < 0.3:
        acts[-1] = "softmax"
    kwargs = dict(activation=acts[:-1] if len(acts) > 1 else [], output_activation=acts[-1],
                  residual={l: r for l, r in enumerate(residual) if r is not None} or None, concat=concat or None,
                  norm=norm or None)
    if len(acts) == 1:
        kwargs.pop("activation")
    return rng, widths, ws, bs, concat, kwargs


def new_arrays(rng, model, concat):
    """Other random weights, biases and norm gammas / betas for `model`'s architecture."""
    ws, _ = graph_weights(rng, model.widths, concat, 1.5)
    bs = [None if old is None else rng.uniform(-0.2, 0.2, old.shape).astype(np.float32) for old in model._b]
    norm = {}
    for l, entry in enumerate(model._norm):
        if entry is not None and fusedmlp._norm.NAMES[entry[0]] not in fusedmlp._norm.SOFTMAX:
            n = model.widths[l + 1]
            norm[l] = {"kind": fusedmlp._norm.NAMES[entry[0]], "eps": entry[1],
                       "weight": rng.uniform(0.5, 1.5, n).astype(np.float32),
                       "bias": rng.normal(0, 0.2, n).astype(np.float32) if rng.random() < 0.5 else None}
    return ws, bs, norm or None


def plans(model):
    """Plans of `model` as a GPU would load them: the fused sm_80 / sm_90 kernels where the network fits one, each
    layer's GEMM on an H100 (a norm layer's of its cut network) and its row pass."""
    out = []
    for arch in (80, 90):
        try:
            out.append(model._net.plan(arch, H100[1], H100[2], "float16", "float16", smem_per_sm=H100[3]))
        except fusedmlp.LimitError:
            pass
    for l in range(len(model._w)):
        if model._concat[l] and model.widths[0] % 8:  # (an x part no GEMM copies as it is: the pad pass's job)
            continue
        a1 = "float16" if model._concat[l] else None
        res = None if model._residual[l] is None else "float16"
        try:
            out.append(model._gemm_plan(l, *H100, "float16", a1, res, "float16"))
        except fusedmlp.LimitError:
            continue
        if model._norm[l] is not None:
            out.append(model._norm_plan(l, *H100, "float16", res, "float16"))
    return out


@pytest.mark.parametrize("seed", range(16))
def test_new_weights_give_the_new_networks_outputs_and_every_plan_packs_them(seed):
    rng, widths, ws, bs, concat, kwargs = random_case(seed)
    model = fusedmlp.FusedMLP(ws, bs, device="cpu", **kwargs)
    before = plans(model)
    x = rng.standard_normal((33, widths[0])).astype(np.float32)
    y_old = model(x)
    ws2, bs2, norm2 = new_arrays(rng, model, concat)
    assert model.set_weights(ws2, bs2, norm=norm2) in (True, False)
    fresh_kwargs = dict(kwargs)
    if norm2:
        fresh_kwargs["norm"] = {**{l: v for l, v in (kwargs["norm"] or {}).items()}, **norm2}
    fresh = fusedmlp.FusedMLP(ws2, bs2, device="cpu", **fresh_kwargs)
    y = model(x)
    np.testing.assert_array_equal(y, fresh(x))
    assert not np.array_equal(y, y_old)
    after = plans(fresh)
    assert len(before) == len(after) > 0
    for old, new in zip(before, after):  # the plans made before now pack the new arrays, as a fresh model's do
        assert old.packed_weights() == new.packed_weights()
        assert old.packed_floats() == new.packed_floats()


@pytest.mark.parametrize("seed", range(24))
def test_the_kernel_source_stays_exactly_where_the_weights_were_taken_in_place(seed):
    """set_weights' True promises that every loaded kernel's code is still right: the rendered source of the model's
    plans is the same. Sine networks (the bound on a sine's arguments picks its form) and parallel stacks (their zero
    blocks) are where it changes; each case draws weights that keep or break them."""
    rng = np.random.default_rng(1000 + seed)
    widths = [3] + [int(rng.choice([32, 64, 128]))] * 3 + [2]
    ws, bs = torch_init(rng, widths)
    stacks = seed % 3 == 0
    if stacks:  # two parallel stacks: zero off-diagonal blocks in the hidden layers
        for l in (1, 2):
            h = widths[l + 1] // 2
            ws[l][:h, h:] = 0
            ws[l][h:, :h] = 0
    model = fusedmlp.FusedMLP(ws, bs, activation=["sin(30 * x)", "sin(x)", "tanh"], device="cpu")
    source = model._render(*H100[:3], "float16", "float16", H100[3])[1]
    ws2 = [w * rng.choice([1.0, 0.5, 150.0, 400.0]) for w in ws]  # (sine arguments over 400: another form)
    if stacks and rng.random() < 0.5:
        ws2[1] = ws2[1] + 0.01  # dense: no longer two stacks
    in_place = model.set_weights(ws2, bs)
    model._kernels["built before"] = None
    assert in_place == (model._render(*H100[:3], "float16", "float16", H100[3])[1] == source)
    same = model.set_weights(ws2, bs)  # the same arrays again: always in place
    assert same and "built before" in model._kernels


def test_a_source_change_drops_the_built_kernels():
    rng = np.random.default_rng(7)
    ws, bs = torch_init(rng, [2, 64, 64, 1])
    model = fusedmlp.FusedMLP(ws, bs, activation=["sin(30 * x)", "sin(x)"], device="cpu")
    model._kernels["built before"] = None
    assert model.set_weights([ws[0], ws[1] * 100.0, ws[2]], bs) is False
    assert model._kernels == {}
    x = rng.standard_normal((9, 2)).astype(np.float32)
    fresh = fusedmlp.FusedMLP([ws[0], ws[1] * 100.0, ws[2]], bs, activation=["sin(30 * x)", "sin(x)"], device="cpu")
    np.testing.assert_array_equal(model(x), fresh(x))


@pytest.mark.parametrize("dtype", ["int8", "float8"])
def test_an_8bit_models_weight_scales_follow_and_its_activation_scales_stay(dtype):
    rng = np.random.default_rng(11)
    widths = [16, 64, 300, 64, 8]  # (300: a GEMM layer, its float16 z emulated)
    ws, bs = torch_init(rng, widths)
    kwargs = dict(activation="gelu", norm={1: "layernorm"}, dtype=dtype, device="cpu")
    model = fusedmlp.FusedMLP(ws, bs, **kwargs).calibrate(rng.standard_normal((256, 16)).astype(np.float32))
    gemm = model._gemm_plan(1, *H100, "float16", None, None, "float16")  # (the prenorm network's, made now)
    scales = model.act_scales.copy()
    ws2, bs2 = torch_init(rng, widths)
    assert model.set_weights(ws2, bs2)
    fresh = fusedmlp.FusedMLP(ws2, bs2, **kwargs)
    fresh._set_act_scales(scales)
    np.testing.assert_array_equal(model.act_scales, scales)
    for mine, theirs in zip(model.weight_scales, fresh.weight_scales):
        np.testing.assert_array_equal(mine, theirs)
    x = rng.standard_normal((40, 16)).astype(np.float32)
    np.testing.assert_array_equal(model(x), fresh(x))
    new_gemm = fresh._gemm_plan(1, *H100, "float16", None, None, "float16")
    assert gemm.packed_weights() == new_gemm.packed_weights()  # codes of the new weights
    assert gemm.packed_floats() == new_gemm.packed_floats()  # their dequantisation factors


def test_bad_weights_name_the_layer_and_rule_and_leave_the_model_as_it_was():
    rng = np.random.default_rng(3)
    ws, bs = torch_init(rng, [5, 16, 16, 2])
    model = fusedmlp.FusedMLP(ws, bs, activation="relu", norm={0: "layernorm"}, device="cpu")
    x = rng.standard_normal((4, 5)).astype(np.float32)
    y = model(x)
    ws2, bs2 = torch_init(rng, [5, 16, 16, 2])
    cases = [
        ((ws2[:2], bs2), fusedmlp.ArgumentError, "a list of 3"),
        ((np.stack([ws2[1], ws2[1]]), bs2), fusedmlp.ArgumentError, "a list of 3"),
        (([ws2[0].T, ws2[1], ws2[2]], bs2), fusedmlp.ShapeError, r"weights\[0\] has shape \(5, 16\).*\(16, 5\)"),
        ((ws2, [bs2[0], None, bs2[2]]), fusedmlp.ArgumentError, r"biases\[1\] is None.*layer 1 has one"),
        ((ws2, [bs2[0], bs2[1][:3], bs2[2]]), fusedmlp.ShapeError, r"biases\[1\] has shape \(3,\)"),
        (([ws2[0], ws2[1] * np.inf, ws2[2]], bs2), fusedmlp.ArgumentError, r"weights\[1\] holds a non-finite"),
    ]
    for (args, error, match) in cases:
        with pytest.raises(error, match=match):
            model.set_weights(*args)
    for norm, match in [({0: "rmsnorm"}, "layer 0 gets rmsnorm.*has layernorm"),
                        ({0: ("layernorm", None, None, 1e-3)}, "eps 0.001.*eps 1e-05"),
                        ({1: "layernorm"}, "layer 0 gets none")]:
        with pytest.raises(fusedmlp.ArgumentError, match=match):
            model.set_weights(ws2, bs2, norm=norm)
    np.testing.assert_array_equal(model(x), y)


def test_an_8bit_scale_that_underflows_is_named_and_changes_nothing():
    rng = np.random.default_rng(5)
    ws, bs = torch_init(rng, [8, 32, 4])
    model = fusedmlp.FusedMLP(ws, bs, dtype="int8", device="cpu").calibrate(rng.standard_normal((64, 8)))
    x = rng.standard_normal((6, 8)).astype(np.float32)
    y = model(x)
    tiny = [ws[0], ws[1].copy()]
    tiny[1][2] *= 1e-36  # (its scale times the activation scale below float32's smallest normal)
    with pytest.raises(ValueError, match="channel 2.*underflows"):
        model.set_weights(tiny, bs)
    np.testing.assert_array_equal(model(x), y)


def test_an_optimizer_step_and_a_loaded_state_dict_reach_the_same_fused_model():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    import fusedmlp.torch as ft

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.SiLU(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 3), nn.Softmax(-1))
    fused = ft.FusedModule(model)
    mlp = fused._mlp
    x = torch.randn(20, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        with torch.no_grad():
            assert (fused(x) - model(x)).abs().max().item() <= 1e-6
    fused.load_state_dict({k: v * 1.5 for k, v in model.state_dict().items()})
    with torch.no_grad():
        assert (fused(x) - model(x)).abs().max().item() <= 1e-6
    assert fused._mlp is mlp  # the arrays alone changed: set_weights, not a new model
    fused._modules["4"] = nn.ReLU()  # another activation: a new model
    fused.refresh()
    with torch.no_grad():
        assert fused._mlp is not mlp and (fused(x) - fused._wrapped()(x)).abs().max().item() <= 1e-6


def test_a_multi_device_model_gives_every_device_the_new_weights():
    from fusedmlp.multi_gpu import MultiDeviceMLP

    rng = np.random.default_rng(9)
    ws, bs = torch_init(rng, [5, 64, 64, 3])
    split = MultiDeviceMLP(ws, bs, activation="tanh", devices=["cpu"] * 3, min_rows_per_device=100)
    ws2, bs2 = torch_init(rng, [5, 64, 64, 3])
    assert split.set_weights(ws2, bs2)
    x = rng.standard_normal((1000, 5)).astype(np.float32)
    np.testing.assert_array_equal(split(x), fusedmlp.FusedMLP(ws2, bs2, activation="tanh", device="cpu")(x))


def test_the_core_refuses_another_architecture_naming_what_differs():
    """Network.assign's own check (FusedMLP.set_weights checks first; the core does not rely on it)."""
    rng = np.random.default_rng(13)
    ws, bs = torch_init(rng, [4, 16, 2])
    core = fusedmlp._core
    net = core.Network(ws, bs, ["relu", "none"])
    for other, match in [(core.Network(ws, bs, ["tanh", "none"]), "another activation"),
                         (core.Network(ws, [bs[0], None], ["relu", "none"]), "a bias present"),
                         (core.Network(*torch_init(rng, [4, 8, 2]), ["relu", "none"]), "another layer shape"),
                         (core.Network(ws, bs, ["relu", "none"], None, None, [(1, 1e-5, None, None), None]),
                          "another norm")]:
        with pytest.raises(ValueError, match=match):
            net.assign(other)
    assert net.assign(core.Network(*torch_init(rng, [4, 16, 2]), ["relu", "none"])) is True
