"""fairscale 0.4.13's state-dict, optimizer-state, shared-parameter and expert (MoE) scenarios,
run on CPU ranks with our wrapper: the scenarios of fairscale's ``test_fsdp_state_dict.py``,
``test_fsdp_optimizer_utils.py``, ``test_fsdp_shared_weights*.py`` and its MoE users (an expert
unit per rank on a one-rank process group inside a root over every rank), each checked against a
plain model or against fairscale's own functions."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from fsdp.comm.collectives import hybrid_groups
from tests.checkpointing import scramble_
from tests.rank_pool import RankPool


# ---------------------------------------------------------------------- experts (MoE)
class MoE(nn.Module):
    """Shared input and output layers around one expert per rank (fairscale's MoE layout): rank r
    holds expert r alone, drawn from seed ``100 + r``; the shared layers are the same everywhere."""

    def __init__(self, expert_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.out = nn.Linear(8, 3)
        torch.manual_seed(expert_seed)
        self.expert = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.expert(self.inp(x))))


def _per_rank_groups() -> list[dist.ProcessGroup]:
    """One process group per rank (every rank takes part in creating each)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())]


def _moe(groups: list[dist.ProcessGroup], **kwargs: Any) -> FSDP:
    rank = dist.get_rank()
    net = MoE(100 + rank)
    net.expert = FSDP(net.expert, process_group=groups[rank], **kwargs)
    return FSDP(net, **kwargs)


def _batch(rank: int) -> torch.Tensor:
    """Larger inputs on later ranks, so that the last rank's expert holds the largest gradients."""
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(7 + rank)) * (1 + 2 * rank)


def _plain_moe_grads(world: int) -> tuple[nn.Module, list[nn.Linear]]:
    """The plain model of every rank's expert, with the gradients the wrapped model holds: the
    shared layers' averaged over the ranks, each expert's its own rank's (a one-rank group)."""
    shared = MoE(0)
    experts = [MoE(100 + r).expert for r in range(world)]
    for p in shared.parameters():
        p.grad = torch.zeros_like(p)
    for r, expert in enumerate(experts):
        shared.expert = expert
        loss = shared(_batch(r)).pow(2).sum()
        grads = torch.autograd.grad(
            loss, [*shared.inp.parameters(), *shared.out.parameters(), *expert.parameters()]
        )
        n_shared = len([*shared.inp.parameters(), *shared.out.parameters()])
        for p, g in zip([*shared.inp.parameters(), *shared.out.parameters()], grads[:n_shared]):
            p.grad += g / world
        for p, g in zip(expert.parameters(), grads[n_shared:]):
            p.grad = g.clone()
    return shared, experts


def _clip_experts(norm_type: float, strategy: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs: dict[str, Any] = {}
    if strategy == "HYBRID_SHARD":  # the shared layers 2 x 2; the experts on their own groups
        kwargs = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "process_group": hybrid_groups(2)}
    groups = _per_rank_groups()
    net = MoE(100 + rank)
    net.expert = FSDP(net.expert, process_group=groups[rank])
    model = FSDP(net, **kwargs)
    model(_batch(rank)).pow(2).sum().backward()
    shared, experts = _plain_moe_grads(world)
    params = [
        *shared.inp.parameters(),
        *shared.out.parameters(),
        *(p for e in experts for p in e.parameters()),
    ]
    max_norm = 0.5
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type).item()
    norm = model.clip_grad_norm_(max_norm, norm_type).item()
    errors = []
    with model.summon_full_params(with_grads=True):
        ours = dict(model.named_parameters())
        theirs = {
            **dict(shared.named_parameters()),
            **{f"expert.{n}": p for n, p in experts[rank].named_parameters()},
        }
        for name, p in ours.items():
            errors.append((p.grad - theirs[name].grad).abs().max().item())
    return {"norm": norm, "ref_norm": ref_norm, "grad_error": max(errors), "names": sorted(ours)}


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_with_an_expert_per_rank_is_the_plain_models_norm(
    pool: RankPool, norm_type: float
) -> None:
    results = pool.run(_clip_experts, norm_type, "FULL_SHARD")
    for r in results:
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), r
        assert r["norm"] > 0.5, "the test must actually clip"
        assert r["grad_error"] <= 1e-6, "every rank scales its shards and its expert by the same factor"
    assert len({r["norm"] for r in results}) == 1


@pytest.mark.parametrize("pool", [4], indirect=True)
def test_clip_grad_norm_with_experts_beside_hybrid_sharding(pool: RankPool) -> None:
    for r in pool.run(_clip_experts, 2.0, "HYBRID_SHARD"):
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), r
        assert r["grad_error"] <= 1e-6


# ---------------------------------------------------------------------- local state dicts
class Tied(nn.Module):
    """An embedding tied to the output layer, a middle layer (wrapped on its own), a buffer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 5)
        self.head = nn.Linear(5, 7)
        self.proj = nn.Linear(4, 7, bias=False)
        self.proj.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        return (self.head(torch.relu(self.mid(h))) + self.proj(h)) * self.scale


def _ours(flatten: bool, seed: int = 0, **kwargs: Any) -> FSDP:
    net = Tied(seed)
    net.mid = FSDP(net.mid, flatten_parameters=flatten, **kwargs)
    return FSDP(net, flatten_parameters=flatten, **kwargs)


def _fairscales(flatten: bool, seed: int = 0) -> nn.Module:
    """The same model wrapped by fairscale 0.4.13 itself (its state-dict code runs on CPU ranks)."""
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    cpu = torch.device("cpu")
    net = Tied(seed)
    net.mid = FairscaleFSDP(net.mid, flatten_parameters=flatten, compute_device=cpu)
    return FairscaleFSDP(net, flatten_parameters=flatten, compute_device=cpu)


def _idx(rank: int) -> torch.Tensor:
    return torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(rank))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(_idx(dist.get_rank())).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _through_a_file(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _local_roundtrip(flatten: bool, mixed: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    model = _ours(flatten, mixed_precision=mixed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _step(model, opt)
    local = model.local_state_dict()
    saved = _through_a_file({k: v.cpu().clone() for k, v in local.items()})  # fairscale users' idiom
    whole = _through_a_file(local)  # torch.save of the dict itself keeps its _metadata, the identity
    full_at_save = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt)
    changed = [k for k, v in model.local_state_dict().items() if not torch.equal(v, saved[k])]
    model.load_local_state_dict(saved)
    restored = all(torch.equal(v, full_at_save[k]) for k, v in model.state_dict().items())
    theirs = _fairscales(flatten).local_state_dict()  # (fairscale's mixed precision needs CUDA)
    others: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(others, whole)
    refused = ""
    try:
        model.load_local_state_dict(others[1 - rank])  # another rank's file
    except ValueError as e:
        refused = str(e)
    return {
        "types": sorted({type(v).__name__ for v in local.values()}),
        "keys": sorted(local),
        "fairscale_keys": sorted(theirs),
        "same_shards_as_fairscale": all(
            torch.equal(_ours(flatten).local_state_dict()[k], v) for k, v in theirs.items()
        ),
        "changed": sorted(changed),
        "restored": restored,
        "refused": refused,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize(("flatten", "mixed"), [(True, True), (False, False), (True, False)])
def test_local_state_dict_is_fairscales_tensors_and_keeps_its_identity_check(
    pool: RankPool, flatten: bool, mixed: bool
) -> None:
    for r in pool.run(_local_roundtrip, flatten, mixed):
        assert r["types"] == ["Tensor"], "tensors only: the {k: v.cpu()} idiom works"
        assert r["keys"] == r["fairscale_keys"], "fairscale's keys and nothing else (parameters and buffers)"
        assert r["same_shards_as_fairscale"], "and the same shard in each"
        if not flatten:
            assert {"mid.weight", "embed.weight", "proj.weight"} <= set(r["keys"]), "tied: under each name"
        trained = [k for k in r["keys"] if k != "scale"]
        assert sorted(set(trained) - set(r["changed"])) == [], (
            "training changed every shard (fairscale's check)"
        )
        assert r["restored"], "the saved dict, copied to the CPU and through a file, loads back exactly"
        assert "holds the shards of rank" in r["refused"], (
            "another rank's file is refused (identity in _metadata)"
        )


def _as_version_1(local: dict[str, Any], meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A local state dict and its metadata in the layout earlier versions saved: the identity as a
    dict, and every shard named ``flat_param_<i>``, unflattened ones too (no tied names)."""
    ident = local._metadata[""]["_fsdp_local_state"]  # type: ignore[attr-defined]
    old_local: dict[str, Any] = {"_fsdp_local_state": {**ident, "version": 1}}
    old_units = []
    for unit in meta["param_metadata"]:
        path, params = unit["fsdp_path"], {}
        for i, (backing, entry) in enumerate(unit["params"].items()):
            old_local[f"{path}.flat_param_{i}" if path else f"flat_param_{i}"] = local[
                f"{path}.{backing}" if path else backing
            ]
            params[f"flat_param_{i}"] = entry
        old_units.append({**unit, "params": params})
    old_local.update((k, local[k]) for k in meta["buffer_names"])
    return old_local, {**meta, "version": 1, "param_metadata": old_units}


def _fairscale_shards(flatten: bool) -> dict[str, Any]:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    world = dist.get_world_size()
    theirs = _fairscales(flatten, seed=3)
    fs_local = {k: v.clone() for k, v in theirs.local_state_dict().items()}
    fs_meta = theirs.local_metadata_dict()
    expected = Tied(3).state_dict()
    model = _ours(flatten, seed=0)
    model.load_local_state_dict(fs_local)  # fairscale's own file: no identity entry
    loaded = {k: torch.equal(v, expected[k]) for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _step(model, opt)  # and it trains from there
    ours_local = copy.deepcopy(model.local_state_dict())  # (a copy that keeps the identity in _metadata)
    ours_meta = model.local_metadata_dict()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    old_local, old_meta = _as_version_1(ours_local, ours_meta)
    files: list[Any] = [None] * world
    dist.all_gather_object(files, (fs_local, fs_meta, ours_local, ours_meta, old_local, old_meta))

    def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
        """Keys of ``want`` that ``got`` lacks or holds other values under."""
        return sorted(k for k, v in want.items() if k not in got or not torch.equal(got[k], v))

    fresh = _ours(flatten, seed=5)
    fresh.load_local_state_dict(old_local)  # a file of an earlier version still loads
    old_loaded = same(fresh.state_dict(), trained)
    return {
        "loaded": loaded,
        # our consolidator over fairscale's files, fairscale's over ours, and ours over both our forms
        "ours_of_fairscales": same(
            FSDP.consolidate_shard_weights([f[0] for f in files], [f[1] for f in files]), expected
        ),
        "fairscales_of_ours": same(
            FairscaleFSDP.consolidate_shard_weights([f[2] for f in files], [f[3] for f in files]), trained
        ),
        "ours_of_ours": same(
            FSDP.consolidate_shard_weights([f[2] for f in files], [f[3] for f in files]), trained
        ),
        "ours_of_old": same(
            FSDP.consolidate_shard_weights([f[4] for f in files], [f[5] for f in files]), trained
        ),
        "old_loaded": old_loaded,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("flatten", [True, False])
def test_fairscales_local_shards_load_and_consolidate(pool: RankPool, flatten: bool) -> None:
    for r in pool.run(_fairscale_shards, flatten):
        assert all(r["loaded"].values()) and len(r["loaded"]) == 7, r["loaded"]
        # fairscale records no tie of an unflattened wrapper in its metadata, so no consolidator
        # can name proj.weight from its files; its own copies the ties of its last wrapper only
        assert r["ours_of_fairscales"] == ([] if flatten else ["proj.weight"])
        assert r["fairscales_of_ours"] == ["proj.weight"]
        assert r["ours_of_ours"] == [] and r["ours_of_old"] == [] and r["old_loaded"] == []


# ---------------------------------------------------------------------- fairscale's optimizer-state form
class Stack(nn.Module):
    """Three layers, the middle two wrapped on their own; ``aux`` never reaches the loss, so its unit
    has no optimizer state (fairscale's ``param_id_map`` maps its ids to None)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 6)
        self.mid = nn.Linear(6, 6)
        self.aux = nn.Linear(6, 2)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _stack(wrapper: Any, **kwargs: Any) -> nn.Module:
    net = Stack()
    net.mid, net.aux = wrapper(net.mid, **kwargs), wrapper(net.aux, **kwargs)
    return wrapper(net, **kwargs)


def _fairscale_wrapper(module: nn.Module, **kwargs: Any) -> nn.Module:
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

    return FairscaleFSDP(module, compute_device=torch.device("cpu"), **kwargs)


def _local_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in opt.state_dict()["state"].items()
    }


def _same_local_state(got: dict[Any, dict[str, Any]], want: dict[int, dict[str, Any]]) -> list[str]:
    """Differences between two optimizer states keyed by local id (``step`` compared as a number)."""
    diffs = [f"ids {sorted(got)} != {sorted(want)}"] if set(got) != set(want) else []
    for i in set(got) & set(want):
        for key, value in want[i].items():
            mine = got[i].get(key)
            if key == "step":
                ok = mine is not None and float(mine) == float(value)
            else:
                ok = isinstance(mine, torch.Tensor) and mine.shape == value.shape and torch.equal(mine, value)
            if not ok:
                diffs.append(f"{i}.{key}")
    return diffs


def _step_types(state: dict[Any, dict[str, Any]]) -> list[Any]:
    return [
        (type(s["step"]), getattr(s["step"], "dtype", None)) for _, s in sorted(state.items()) if "step" in s
    ]


OPTIMIZERS = {  # fairscale's test_consolidate_optimizer uses these three
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adadelta": lambda params: torch.optim.Adadelta(params),
}


def _gather_for_fairscale(optimizer: str) -> dict[str, Any]:
    import copy

    from fairscale.nn.data_parallel import FullyShardedDataParallel as FairscaleFSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _stack(FSDP)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    full = model.gather_full_optim_state_dict(opt)
    box = [full]
    dist.broadcast_object_list(box, src=0)
    theirs = _stack(_fairscale_wrapper)  # the same wrap plan, built by fairscale on this CPU rank
    assert isinstance(theirs, FairscaleFSDP)
    given_to_fairscale = copy.deepcopy(box[0])
    shard = theirs.get_shard_from_optim_state_dict(given_to_fairscale)
    fs_opt = OPTIMIZERS[optimizer](theirs.parameters())
    fs_opt.load_state_dict(shard)  # and a torch optimizer over fairscale's flat parameters takes it
    saved = copy.deepcopy(box[0])
    full_state = box[0]["state"]
    ours_back = model.get_shard_from_optim_state_dict(box[0])
    return {
        "world": world,
        "keys": sorted(saved),
        "param_id_map": saved["param_id_map"],
        "names": saved["param_names"],
        "uncollected": saved["uncollected_local_ids"],
        "fairscale_reads_it": _same_local_state(shard["state"], _local_state(opt)),
        "fairscale_groups": [g["params"] for g in shard["param_groups"]],
        "loaded": _same_local_state(_local_state(fs_opt), _local_state(opt)),
        "ours_reads_it": _same_local_state(ours_back["state"], _local_state(opt)),
        "full_is_none_elsewhere": full is None if rank else full is not None,
        # fairscale's reader turns its argument into the shard it returns (the full state is
        # dropped from it, the dicts inside it are left as they were; it keeps the keys it does not
        # know, our "param_names" and "step_dtype"); ours does the same, and drops those too, so that
        # the shard has the keys of the optimizer's own state dict, as fairscale's test asserts
        "fairscale_consumes": shard is given_to_fairscale
        and sorted(shard)
        == ["param_groups", "param_names", "state"] + (["step_dtype"] if optimizer != "sgd" else []),
        # the full dict holds fairscale's numbers; the shard ours reads from it holds the steps as
        # the optimizer's own state dict does (fairscale's test_consolidate_optimizer compares types)
        "steps": [type(s["step"]) for s in saved["state"].values() if "step" in s],
        "step_types": _step_types(ours_back["state"]) == _step_types(opt.state_dict()["state"]),
        "ours_consumes": ours_back is box[0] and sorted(box[0]) == sorted(opt.state_dict()),
        "inner_unchanged": _same_local_state(full_state, saved["state"]) == [],
    }


@pytest.mark.parametrize(("pool", "optimizer"), [(2, "sgd"), (2, "adadelta"), (3, "adam")], indirect=["pool"])
def test_gathered_optimizer_state_is_read_by_fairscales_get_shard(pool: RankPool, optimizer: str) -> None:
    for r in pool.run(_gather_for_fairscale, optimizer):
        assert r["full_is_none_elsewhere"] and r["inner_unchanged"]
        assert r["fairscale_consumes"] and r["ours_consumes"], (
            "the argument becomes the shard, as in fairscale"
        )
        assert {"param_id_map", "uncollected_local_ids", "param_names", "state", "param_groups"} <= set(
            r["keys"]
        )
        # ids in the unwrapped model's order (inp, mid, aux, out); local ids: the optimizer's flat
        # parameters (root: inp + out, then mid, then aux), aux without state
        assert r["names"] == [
            "inp.weight",
            "inp.bias",
            "mid.weight",
            "mid.bias",
            "aux.weight",
            "aux.bias",
            "out.weight",
            "out.bias",
        ]
        assert r["param_id_map"] == {0: 0, 1: 0, 6: 0, 7: 0, 2: 1, 3: 1, 4: None, 5: None}
        assert r["uncollected"] == []
        assert r["fairscale_reads_it"] == [], "fairscale's reader gives each rank its own flat state"
        assert r["fairscale_groups"] == [[0, 1, 2]]
        assert r["loaded"] == [] and r["ours_reads_it"] == []
        assert set(r["steps"]) <= {float}, r["steps"]
        assert r["step_types"], "the shard's steps are tensors of the optimizer's dtype again"


def _gather_experts() -> dict[str, Any]:
    import copy
    import warnings

    rank = dist.get_rank()
    groups = _per_rank_groups()
    model = _moe(groups)
    flags_before = (model.no_broadcast_optim_state, model.expert.no_broadcast_optim_state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(_batch(rank)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    flags = (model.no_broadcast_optim_state, model.expert.no_broadcast_optim_state)
    mine = _local_state(opt)
    full = model.gather_full_optim_state_dict(opt)
    box = [full]
    dist.broadcast_object_list(box, src=0)
    owners: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(owners, mine)
    # fairscale's reader on fairscale's build of the same tree: shared state sharded, experts' kept
    net = MoE(100 + rank)
    net.expert = _fairscale_wrapper(net.expert, process_group=groups[rank])
    theirs = _fairscale_wrapper(net)
    shard = theirs.get_shard_from_optim_state_dict(copy.deepcopy(box[0]))
    saved = {k: box[0][k] for k in ("uncollected_local_ids", "param_id_map")}  # (the reader consumes box[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = model.get_shard_from_optim_state_dict(box[0])
    sharded_refusal = ""
    try:
        model.sharded_optim_state_dict(opt)
    except RuntimeError as e:
        sharded_refusal = str(e)
    return {
        "flags_before": flags_before,
        "flags": flags,
        "uncollected": saved["uncollected_local_ids"],
        "param_id_map": saved["param_id_map"],
        # the root's flat parameter (local id 0) is gathered; the expert's (1) is rank 0's own
        "fairscale_shared": _same_local_state({0: shard["state"][0]}, {0: mine[0]}),
        "fairscale_expert_is_rank0s": _same_local_state({1: shard["state"][1]}, {1: owners[0][1]}),
        "ours_shared": _same_local_state({0: ours["state"][0]}, {0: mine[0]}),
        "ours_expert_is_rank0s": _same_local_state({1: ours["state"][1]}, {1: owners[0][1]}),
        "warned": [str(w.message) for w in caught],
        "sharded_refusal": sharded_refusal,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_experts_are_flagged_and_gathered_as_fairscale_does(pool: RankPool) -> None:
    for r in pool.run(_gather_experts):
        assert r["flags_before"] == (False, False)
        assert r["flags"] == (False, True), "set for the one-rank child at the root's first forward"
        assert r["uncollected"] == [1]
        assert r["param_id_map"] == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}  # inp, out (the root), expert
        assert r["fairscale_shared"] == [] and r["fairscale_expert_is_rank0s"] == []
        assert r["ours_shared"] == [] and r["ours_expert_is_rank0s"] == []
        assert any("saving rank's own experts'" in w for w in r["warned"])
        assert "no_broadcast_optim_state=True" in r["sharded_refusal"]


# ---------------------------------------------------------------------- parameters shared across wrappers
class Siblings(nn.Module):
    """fairscale's shared-weights model: four 4x4 layers, l1 sharing its weight and/or bias with l3;
    with ``wrapped``, l1, l2 and l3 are wrapped on their own (l1 and l3 unflattened, as fairscale
    needs) and l3 declares the shared ones with ``append_shared_param``."""

    def __init__(self, bias: bool, sharing: str, wrapped: bool = False, inner_flat: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(4, 4, bias=bias) for _ in range(4))
        if sharing in ("weight", "both"):
            self.l1.weight = self.l3.weight
        if sharing in ("bias", "both") and bias:
            self.l1.bias = self.l3.bias
        if wrapped:
            self.l1 = FSDP(self.l1, flatten_parameters=False)
            self.l2 = FSDP(self.l2, flatten_parameters=inner_flat)
            self.l3 = FSDP(self.l3, flatten_parameters=False)
            if sharing in ("weight", "both"):
                self.l3.append_shared_param(self.l1.module.weight)
            if sharing in ("bias", "both") and bias:
                self.l3.append_shared_param(self.l1.module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.l2(self.l1(self.l0(x))))


class TiedOutput(nn.Module):
    """A MEVO-style output: the vocabulary projection and the cross-entropy in one module,
    holding the embedding's weight as its own parameter (fairscale's MEVO takes it the same way)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.proj_weight = weight

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = x @ self.proj_weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class Mevo(nn.Module):
    """fairscale's MEVO test model: embedding, norm, middle layer, norm, MEVO output tied to the
    embedding; wrapped, the embedding and the output are sibling units."""

    def __init__(self, wrapped: bool = False, wrap_middle: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0 = nn.Embedding(13, 6)
        self.l1 = TiedOutput(self.l0.weight)
        self.middle = nn.Linear(6, 6)
        self.ln1, self.ln2 = nn.LayerNorm(6), nn.LayerNorm(6)
        if wrapped:
            self.l0 = FSDP(self.l0, flatten_parameters=False)
            self.l1 = FSDP(self.l1, flatten_parameters=False)
            self.l1.append_shared_param(self.l0.module.weight)
            if wrap_middle != "none":
                self.middle = FSDP(self.middle, flatten_parameters=wrap_middle == "flat")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.l1(self.ln2(self.middle(self.ln1(self.l0(idx)))), (idx + 1) % 13)


class LM(nn.Module):
    """An embedding tied to the output projection; wrapped, the embedding is in an inner unit and
    the projection belongs to the outer one (the brief's MEVO-style layout)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.front = nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6))
        self.blocks = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.front[0].weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.blocks(self.front(idx))))


def _lm(how: str, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """The plain model, and the same wrapped with the tie crossing a wrapper boundary."""
    from fsdp import lambda_auto_wrap_policy

    ref = LM()
    if how == "meta":  # built on the meta device: each unit materializes its own modules
        with torch.device("meta"):
            net = LM()
        net.front[0], net.blocks[0] = FSDP(net.front[0], **kwargs), FSDP(net.blocks[0], **kwargs)
        model = FSDP(net, **kwargs)
        ref.load_state_dict(model.state_dict())  # the reference starts from the wrapped model's draws
        return ref, model
    net = LM()
    if how == "policy":  # torch's calling style: the policy wraps the embedding, the root keeps the output
        policy = lambda_auto_wrap_policy(lambda m: isinstance(m, (nn.Embedding, nn.Tanh)))
        return ref, FSDP(net, auto_wrap_policy=policy, **kwargs)
    net.front[0] = FSDP(net.front[0], **kwargs)
    if how == "loaded":  # the inner unit's values change after wrapping: the outer one takes those
        with torch.no_grad():
            ref.front[0].weight.mul_(2.0)
        net.front[0].load_state_dict(ref.front[0].state_dict())
    if how == "deep":  # and its parent in a unit of its own: the root is the first around both users
        net.front = FSDP(net.front, **kwargs)
    return ref, FSDP(net, **kwargs)


def _train_beside(
    ref: nn.Module,
    model: nn.Module,
    data: torch.Tensor,
    steps: int = 3,
    loss: Any = lambda y: y.pow(2).mean(),
) -> dict[str, float]:
    """SGD on the whole batch for the plain model, on this rank's slice for the wrapped one; the
    largest difference of each state-dict entry after ``steps`` (a missing key: inf)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = data.shape[0] // world
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for _ in range(steps):
        loss(model(data[rank * per : (rank + 1) * per])).backward()
        loss(ref(data)).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    ours, theirs = model.state_dict(), ref.state_dict()
    diffs = {k: (ours[k] - v).abs().max().item() if k in ours else math.inf for k, v in theirs.items()}
    diffs["(same keys)"] = 0.0 if list(ours) == list(theirs) else math.inf
    return diffs


def _tied_lm(how: str, flatten: bool) -> dict[str, Any]:
    ref, model = _lm(how, flatten_parameters=flatten)
    data = torch.randint(0, 11, (4 * dist.get_world_size(), 5), generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    diffs = _train_beside(ref, model, data)
    sd = model.state_dict()
    return {
        "diffs": diffs,
        "trained": not torch.equal(before["out.weight"], ref.state_dict()["out.weight"]),
        "one_tensor": torch.equal(sd["out.weight"], sd["front.0.weight"]),
        "owners": sorted(
            w.module.__class__.__name__
            for w in model.modules()
            if isinstance(w, FSDP)
            and any(n in ("front.0.weight", "out.weight") for h in w.handles for n in h.meta.fqns)
        ),
    }


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("how", ["inner", "loaded", "deep", "policy", "meta"])
def test_embedding_tied_to_the_outer_units_output_trains_like_the_plain_model(
    pool: RankPool, how: str
) -> None:
    for flatten in (True, False):
        for r in pool.run(_tied_lm, how, flatten):
            assert max(r["diffs"].values()) <= 1e-5, r["diffs"]
            assert r["trained"] and r["one_tensor"]
            assert r["owners"] == ["LM"], (
                "the root, the first wrapper around both users, owns the tied weight"
            )


def _siblings(outer_flat: bool, inner_flat: bool) -> dict[str, dict[str, float]]:
    data = torch.rand(2 * dist.get_world_size(), 4, generator=torch.Generator().manual_seed(3))
    out = {}
    for bias in (True, False):
        for sharing in ("none", "weight", "bias", "both"):
            if sharing == "bias" and not bias:
                continue  # (fairscale skips it too)
            model = FSDP(Siblings(bias, sharing, True, inner_flat), flatten_parameters=outer_flat)
            ref = Siblings(bias, sharing)
            scramble_(model)  # then the plain model's state loaded, as fairscale's test does
            model.load_state_dict(ref.state_dict())
            out[f"{sharing}, bias={bias}"] = _train_beside(ref, model, data)
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("outer_flat", [True, False])
@pytest.mark.parametrize("inner_flat", [True, False])
def test_fairscales_shared_weights_between_sibling_wrappers(
    pool: RankPool, outer_flat: bool, inner_flat: bool
) -> None:
    for r in pool.run(_siblings, outer_flat, inner_flat):
        for case, diffs in r.items():
            assert max(diffs.values()) <= 1e-6, (case, diffs)


def _mevo(wrap_middle: str) -> dict[str, float]:
    data = torch.randint(0, 13, (2 * dist.get_world_size(), 4), generator=torch.Generator().manual_seed(5))
    model = FSDP(Mevo(True, wrap_middle), flatten_parameters=False)
    ref = Mevo()
    scramble_(model)  # then the plain model's state loaded, as fairscale's test does
    model.load_state_dict(ref.state_dict())
    return _train_beside(ref, model, data, loss=lambda y: y)  # (the model returns its loss)


@pytest.mark.parametrize("pool", [2], indirect=True)
@pytest.mark.parametrize("wrap_middle", ["none", "flat", "nonflat"])
def test_fairscales_mevo_model_with_shared_embedding(pool: RankPool, wrap_middle: str) -> None:
    for diffs in pool.run(_mevo, wrap_middle):
        assert max(diffs.values()) <= 1e-5, diffs


def _tied_state_forms(tmp: str) -> dict[str, Any]:
    import fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    _, model = _lm("inner", flatten_parameters=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    data = torch.randint(0, 11, (2 * world, 5), generator=torch.Generator().manual_seed(1))
    model(data[2 * rank : 2 * rank + 2]).pow(2).mean().backward()
    opt.step()
    full = model.state_dict()
    local = {k: v.clone() for k, v in model.local_state_dict().items()}
    files: list[Any] = [None] * world
    dist.all_gather_object(files, (local, model.local_metadata_dict()))
    consolidated = FSDP.consolidate_shard_weights([f[0] for f in files], [f[1] for f in files])
    optim_full = model.gather_full_optim_state_dict(opt)
    box = [optim_full]
    dist.broadcast_object_list(box, src=0)
    fsdp.save_checkpoint(f"{tmp}/ckpt", model, opt)
    _, fresh = _lm("inner", flatten_parameters=False)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fsdp.load_checkpoint(f"{tmp}/ckpt", fresh, fresh_opt)
    _, again = _lm("inner", flatten_parameters=False)
    again.load_local_state_dict(local)
    again_opt = torch.optim.Adam(again.parameters(), lr=0.1)
    optim_names = box[0]["param_names"]  # (before the reader consumes box[0], as fairscale's does)
    again_opt.load_state_dict(again.get_shard_from_optim_state_dict(box[0]))

    def same(sd: dict[str, torch.Tensor]) -> bool:
        return list(sd) == list(full) and all(torch.equal(sd[k], v) for k, v in full.items())

    misuse = {}
    sib = Siblings(True, "weight", wrapped=True)
    try:
        sib.l2.append_shared_param(sib.l1.module.weight)  # l2 does not use it
    except ValueError as e:
        misuse["not_used"] = str(e)
    try:
        sib.l3(torch.randn(2, 4))  # no wrapper around l1 and l3 yet
    except ValueError as e:
        misuse["no_parent"] = str(e)
    return {
        "keys": list(full),
        "local_keys": sorted(k for k in local if not k.startswith("_")),
        "consolidated": same(consolidated),
        "checkpoint": same(fresh.state_dict()),
        "local": same(again.state_dict()),
        "optim_names": optim_names,
        "optim": _same_local_state(_local_state(again_opt), _local_state(opt)) == [],
        "checkpoint_optim": _same_local_state(_local_state(fresh_opt), _local_state(opt)) == [],
        "misuse": misuse,
    }


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_tied_parameters_across_wrappers_in_every_state_form(pool: RankPool, tmp_path: Any) -> None:
    for r in pool.run(_tied_state_forms, str(tmp_path)):
        assert r["keys"] == list(LM().state_dict()), "the plain model's keys, the tied one under both names"
        unflattened = [
            "blocks.0.bias",
            "blocks.0.weight",
            "blocks.2.bias",
            "blocks.2.weight",
            "front.0.weight",
        ]
        assert r["local_keys"] == [*unflattened, "front.1.bias", "front.1.weight", "out.weight"]
        assert r["consolidated"] and r["checkpoint"] and r["local"], r
        assert r["optim_names"][0] == "front.0.weight" and "out.weight" not in r["optim_names"]
        assert r["optim"] and r["checkpoint_optim"]
        assert "not one this wrapper's modules share" in r["misuse"]["not_used"]
        assert "common parent" in r["misuse"]["no_parent"]
