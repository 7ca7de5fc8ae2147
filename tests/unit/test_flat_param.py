"""Grouping and layout of flat parameters."""

from __future__ import annotations

import torch
from torch import nn

from fsdp.core.flat_param import group_params, make_meta, unflatten_views


def _model() -> nn.Module:
    m = nn.Module()
    m.a = nn.Linear(3, 2)
    m.b = nn.Linear(2, 2)
    m.c = nn.Linear(2, 3, bias=False)
    m.b.weight.requires_grad_(False)
    return m


def test_groups_by_requires_grad_and_dtype_in_first_seen_order() -> None:
    m = _model()
    m.d = nn.Linear(2, 2).double()
    groups = group_params(m.named_parameters(remove_duplicate=False), flatten=True)
    names = [[e.fqn for e in entries] for entries, _ in groups]
    assert names == [["a.weight", "a.bias", "b.bias", "c.weight"], ["b.weight"], ["d.weight", "d.bias"]]


def test_tied_parameter_is_stored_once() -> None:
    m = nn.Module()
    m.emb = nn.Embedding(5, 3)
    m.head = nn.Linear(3, 5, bias=False)
    m.head.weight = m.emb.weight
    ((entries, shared),) = group_params(m.named_parameters(remove_duplicate=False), flatten=True)
    meta = make_meta(entries, shared)
    assert meta.fqns == ("emb.weight",) and meta.numel == 15
    assert [(s.fqn, s.primary) for s in meta.shared] == [("head.weight", 0)]


def test_no_flatten_gives_one_group_per_parameter() -> None:
    groups = group_params(_model().named_parameters(remove_duplicate=False), flatten=False)
    assert [len(entries) for entries, _ in groups] == [1, 1, 1, 1, 1]


def test_views_round_trip_with_scalar() -> None:
    tensors = [torch.randn(2, 3), torch.tensor(4.0), torch.randn(5)]
    m = nn.Module()
    for i, t in enumerate(tensors):
        m.register_parameter(f"p{i}", nn.Parameter(t))
    ((entries, shared),) = group_params(m.named_parameters(remove_duplicate=False), flatten=True)
    meta = make_meta(entries, shared)
    assert [i.offset for i in meta.params] == [0, 6, 7] and meta.numel == 12
    flat = torch.cat([e.param.detach().reshape(-1) for e in entries])
    for view, t in zip(unflatten_views(flat, meta), tensors):
        assert view.shape == t.shape and torch.equal(view, t)
        assert view.data_ptr() >= flat.data_ptr()  # a view, not a copy
