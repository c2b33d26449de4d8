"""FUSEDMLP_HOST_PIPE: how a GPU call moves host arrays (csrc/host_pipe.c; the GPU side is test_host_pipe_gpu.py)."""

import pytest

from fusedmlp import _env
from conftest import set_env


@pytest.mark.parametrize("value, form", [(None, -1), ("", -1), ("auto", -1), ("0", -1), ("1", 1), ("ON", 1),
                                         ("-1", 0), ("off", 0)])
def test_the_environment_picks_pieces_one_copy_or_by_size(monkeypatch, value, form):
    set_env(monkeypatch, "FUSEDMLP_HOST_PIPE", value)
    assert _env.host_pipeline() == form


def test_another_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("FUSEDMLP_HOST_PIPE", "2")
    with pytest.raises(ValueError, match=r"FUSEDMLP_HOST_PIPE='2' is not a host copy form; use 1 \(in pieces\)"):
        _env.host_pipeline()
