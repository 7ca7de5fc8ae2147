"""A fairscale user changes one import: same constructor, same methods; unbuilt options refuse loudly."""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import pickle
import re
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
from torch import nn

import fsdp
from fsdp import FSDP, FullyShardedDataParallel, ProcessGroupName, TrainingState
from fsdp.wrapper.torch_methods import InstanceOrStatic

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fairscale.nn import FullyShardedDataParallel as FairscaleFSDP

FAIRSCALE_METHODS = [
    "summon_full_params",
    "state_dict",
    "load_state_dict",
    "local_state_dict",
    "load_local_state_dict",
    "clip_grad_norm_",
    "no_sync",
    "gather_full_optim_state_dict",
    "get_shard_from_optim_state_dict",
    "consolidate_shard_weights",
    "local_metadata_dict",
    "assert_state",
    "set_gradient_divide_factors",
    "apply",
    "forward",
    "reset_parameters",
]


def _params(fn: object) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def test_alias_and_public_names() -> None:
    assert FSDP is FullyShardedDataParallel
    assert {"FSDP", "FullyShardedDataParallel", "ProcessGroupName", "TrainingState"} <= set(fsdp.__all__)
    assert [s.name for s in TrainingState] == [
        "IDLE",
        "FORWARD",
        "BACKWARD_PRE",
        "BACKWARD_POST",
        "SUMMON_FULL_PARAMS",
    ]


def test_constructor_matches_fairscale_names_order_and_defaults() -> None:
    ours, theirs = _params(FullyShardedDataParallel.__init__), _params(FairscaleFSDP.__init__)
    # fairscale's arguments first, in order; ours adds torch-FSDP style ones after them
    assert [n for n, _ in ours][: len(theirs)] == [n for n, _ in theirs]
    assert [n for n, _ in ours][len(theirs) :] == [
        "sharding_strategy",
        "param_init_fn",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "auto_wrap_policy",
        "sync_module_states",
        "device_id",
        "use_orig_params",
        "ignored_modules",
        "ignored_states",
    ]
    for (name, default), (_, ref_default) in zip(ours, theirs):
        if name == "process_group_reduce_scatter":
            assert default.value == ref_default.value == "reduce_scatter"
        else:
            assert default == ref_default, name


# fairscale's state_dict and local_state_dict take (*args, **kwargs) and pass them on to
# nn.Module.state_dict: ours must take the calls that one takes
FORWARDED_TO_MODULE_STATE_DICT = ("state_dict", "local_state_dict")


@pytest.mark.parametrize("name", FAIRSCALE_METHODS)
def test_methods_take_fairscale_arguments(name: str) -> None:
    # (an instance's method: where torch has a static function of the same name, the class gives torch's)
    attr = inspect.getattr_static(FullyShardedDataParallel, name)
    method = attr.method if isinstance(attr, InstanceOrStatic) else getattr(FullyShardedDataParallel, name)
    ours = [n for n, _ in _params(method)]
    theirs = [n for n, _ in _params(getattr(FairscaleFSDP, name))]
    if name in FORWARDED_TO_MODULE_STATE_DICT:
        assert theirs == ["self", "args", "kwargs"], f"fairscale's {name} is no longer a plain forwarder"
        module_keywords = [
            (p.name, p.default)
            for p in inspect.signature(nn.Module.state_dict).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        assert [n for n, _ in module_keywords] == ["destination", "prefix", "keep_vars"]
        sig = inspect.signature(getattr(FullyShardedDataParallel, name))
        # every keyword, with nn.Module's default; and the old positional form, which fairscale passes on
        assert [(n, sig.parameters[n].default) for n, _ in module_keywords if n in sig.parameters] == (
            module_keywords
        ), name
        sig.bind(None, **dict(module_keywords))
        sig.bind(None, None, "", False)
    else:
        assert ours[: len(theirs)] == theirs, name


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"move_params_to_cpu": True, "move_grads_to_cpu": False},
            "move_grads_to_cpu must equal move_params_to_cpu",
        ),
        ({"move_grads_to_cpu": True}, "move_grads_to_cpu must equal move_params_to_cpu"),
    ],
)
def test_offload_options_must_agree(single_rank_group: None, kwargs: dict, match: str) -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        FSDP(module, **kwargs)
    # nothing was flattened: the module is intact
    assert [n for n, _ in module.named_parameters()] == ["weight", "bias"]


def test_offload_flags_are_visible_under_fairscale_names(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2), cpu_offload=True)
    assert model.move_params_to_cpu and model.move_grads_to_cpu and model.cpu_offload


def test_equal_dtypes_are_accepted(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2), compute_dtype=torch.float32, buffer_dtype=torch.float32)
    assert model(torch.ones(1, 2)).dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reshard_after_forward": "yes"}, TypeError, "reshard_after_forward"),
        ({"gradient_predivide_factor": -2.0}, ValueError, "gradient_predivide_factor"),
        ({"process_group_reduce_scatter": "nope"}, TypeError, "process_group_reduce_scatter"),
    ],
)
def test_invalid_values(single_rank_group: None, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FSDP(nn.Linear(2, 2), **kwargs)


def test_parameters_on_two_devices_are_refused(single_rank_group: None) -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"several devices.*cpu.*meta"):
        FSDP(module)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"compute_device": "cuda:99"},
            ValueError,
            r"`compute_device`=cuda:99 is not available in this process",
        ),
        ({"state_dict_device": "cuda:99"}, ValueError, r"`state_dict_device`=cuda:99 is not available"),
        ({"compute_device": "meta"}, ValueError, "`compute_device` cannot be the meta device"),
        ({"compute_device": 3.5}, TypeError, "must be a torch.device or a string"),
        ({"move_params_to_cpu": "yes"}, TypeError, "`move_params_to_cpu` must be a bool"),
        ({"cpu_offload": 2}, TypeError, "`cpu_offload` must be a bool"),
    ],
)
def test_devices_and_offload_flags_are_checked_at_construction(
    single_rank_group: None, kwargs: dict, error: type, match: str
) -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(error, match=match):
        FSDP(module, **kwargs)
    assert isinstance(module.weight, nn.Parameter), "the module is left as it was"


@pytest.mark.parametrize(
    ("kwargs", "on"),
    [
        ({"cpu_offload": None}, False),
        ({"move_params_to_cpu": None, "cpu_offload": 1}, True),
        ({"move_params_to_cpu": 0, "move_grads_to_cpu": None}, False),
        ({"move_params_to_cpu": 1, "move_grads_to_cpu": 1}, True),
        ({"cpu_offload": fsdp.CPUOffload(offload_params=True)}, True),  # torch FSDP's spelling
        ({"cpu_offload": fsdp.CPUOffload()}, False),
    ],
)
def test_offload_flags_take_what_fairscale_takes(single_rank_group: None, kwargs: dict, on: bool) -> None:
    model = FSDP(nn.Linear(2, 2), **kwargs)  # fairscale resolves them with `or`: None and 0/1 work there
    assert model.move_params_to_cpu is on and model.move_grads_to_cpu is on


def test_not_a_module(single_rank_group: None) -> None:
    with pytest.raises(TypeError, match=r"wraps an nn\.Module"):
        FSDP(lambda x: x)  # type: ignore[arg-type]


def test_default_process_group_names(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2), process_group_reduce_scatter=ProcessGroupName.default)
    assert model.fsdp_config.comm.process_group_reduce_scatter is model.process_group


def test_attribute_and_item_forwarding_and_repr(single_rank_group: None) -> None:
    inner = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    inner.custom_flag = 7  # type: ignore[assignment]
    model = FSDP(inner, verbose=True)
    assert model.custom_flag == 7
    assert model[1] is inner[1] and model.module.module is inner  # fairscale's FlattenParamsWrapper level
    text = repr(model)
    assert (
        "world_size=1" in text and "flat_params=1" in text and "numel=16" in text and "is_root=None" in text
    )
    with pytest.raises(AttributeError):
        model.does_not_exist  # noqa: B018


def test_assert_state(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2))
    model.assert_state(TrainingState.IDLE)
    model.assert_state([TrainingState.FORWARD, TrainingState.IDLE])
    with pytest.raises(RuntimeError, match="expected training state FORWARD"):
        model.assert_state(TrainingState.FORWARD)


def test_frozen_integer_parameters_are_kept_and_trainable_ones_refused(single_rank_group: None) -> None:
    m = nn.Linear(2, 2)
    m.register_parameter("idx", nn.Parameter(torch.arange(3), requires_grad=False))
    model = FSDP(m)
    with model.summon_full_params():
        assert torch.equal(model.module.idx, torch.arange(3))


def test_without_process_group_the_error_says_how_to_fix() -> None:
    code = "import torch; from fsdp import FSDP; FSDP(torch.nn.Linear(2, 2))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "init_process_group" in proc.stderr


def test_a_wrapper_around_a_wrapper_owns_nothing(single_rank_group: None) -> None:
    """fairscale accepts ``FSDP(FSDP(m))``: the outer wrapper owns nothing, the inner one everything."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 3)
    model = FSDP(FSDP(copy.deepcopy(ref)))
    assert model.handles == [] and len(model.module.handles) == 1
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    sd = model.state_dict()
    assert list(sd) == ["weight", "bias"] and all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def test_fairscale_attributes_are_readable(single_rank_group: None) -> None:
    model = FSDP(
        nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
        mixed_precision=True,
        compute_dtype=torch.bfloat16,
        fp32_reduce_scatter=True,
        bucket_cap_mb=-1,  # fairscale: <= 0 disables bucketing
        reshard_after_forward=False,
    )
    assert model.mixed_precision and model.compute_dtype == torch.bfloat16
    assert model.buffer_dtype == torch.bfloat16 and model.fp32_reduce_scatter
    assert model.flatten_parameters and not model.reshard_after_forward and model.disable_reshard_on_root
    assert model.bucket_cap_mb == 0
    assert model.gradient_predivide_factor * model.gradient_postdivide_factor == model.world_size == 1
    assert model.numel_padded_per_param == [0] and model.non_shared_params() == model.params
    assert model.state_dict_device == model.compute_device and model.process_group_reduce_scatter is not None
    model(torch.ones(2, 3)).float().sum().backward()
    assert model.params_with_grad == model.params
    plain = FSDP(nn.Linear(2, 2))
    assert (
        not plain.mixed_precision and plain.compute_dtype == torch.float32 and not plain.fp32_reduce_scatter
    )
    assert fsdp.get_fsdp_instances(FSDP(FSDP(nn.Linear(2, 2))), skip_empty=True)[0].handles


def test_fairscale_state_flags_and_print_r0(
    single_rank_group: None, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """``_require_backward_grad_sync`` (False inside no_sync, on every wrapper of the tree) and
    ``_print_r0``, which logs at INFO instead of printing. ``has_full_params``: tests/distributed/test_state.py."""
    model = FSDP(nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 1)))
    inner = model.module[0]
    assert model._require_backward_grad_sync and inner._require_backward_grad_sync
    model(torch.ones(2, 3)).sum().backward()
    with model.no_sync():
        assert not model._require_backward_grad_sync and not inner._require_backward_grad_sync
        model(torch.ones(2, 3)).sum().backward()
    assert model._require_backward_grad_sync and inner._require_backward_grad_sync
    with pytest.raises(AttributeError):
        model._require_backward_grad_sync = False

    model._tstart -= 100.0  # constructed 100 s ago
    with caplog.at_level(logging.INFO, logger="fsdp"):
        model._print_r0("since construction")
        model._print_r0("restarted", restart=True)
    assert [(r.name, r.levelno) for r in caplog.records] == [
        ("fsdp.wrapper.fairscale_attrs", logging.INFO)
    ] * 2
    first, second = (r.getMessage() for r in caplog.records)
    assert re.fullmatch(
        r"since construction unsharded cur= ?\d+\.\d{4} GB, max= ?\d+\.\d{4} GB, t=10\d\.\d s", first
    )
    assert second.startswith("restarted unsharded cur=") and second.endswith("t=0.0 s"), second
    assert capsys.readouterr() == ("", "")


def test_a_wrapped_module_keeps_its_config_attribute(single_rank_group: None) -> None:
    class WithConfig(nn.Linear):
        config = {"vocab_size": 11}  # as a Hugging Face model carries its config

    assert FSDP(WithConfig(2, 2)).config == {"vocab_size": 11}


def test_unflattened_parameters_are_named_like_the_module(single_rank_group: None) -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2, bias=False)))
    module[1] = FSDP(module[1], flatten_parameters=False)
    model = FSDP(module, flatten_parameters=False)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.0.weight"], names
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    assert len(decay) == 2


def test_local_state_dict_takes_fairscale_arguments(single_rank_group: None) -> None:
    model = FSDP(nn.Linear(2, 2))
    out: dict = {}
    assert model.local_state_dict(out, prefix="model.") is out
    assert "model.flat_param_0" in out
    assert model.local_state_dict(keep_vars=True)["flat_param_0"] is model.params[0]


def test_a_number_first_to_the_scaler_is_refused_with_the_keyword() -> None:
    from fsdp import ShardedGradScaler

    with pytest.raises(TypeError, match=r"init_scale=1024"):
        ShardedGradScaler(1024)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"flatten_parameters": 1}, TypeError),
        ({"fp32_reduce_scatter": True}, ValueError),
        ({"gradient_predivide_factor": -2.0}, ValueError),
    ],
)
def test_options_are_checked_before_a_meta_module_is_materialized(
    single_rank_group: None, kwargs: dict, error: type
) -> None:
    with torch.device("meta"):
        module = nn.Linear(2, 2)
    initialized: list[nn.Module] = []
    with pytest.raises(error):
        FSDP(module, param_init_fn=initialized.append, **kwargs)
    assert initialized == [] and module.weight.is_meta, "nothing was materialized"


def test_no_sync_sum_is_reduced_in_the_reduce_dtype(single_rank_group: None) -> None:
    """fp16 compute, fp32 reduction: a sum beyond fp16's range (65504) survives the accumulation."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    model = FSDP(Scale(), mixed_precision=True, fp32_reduce_scatter=True)
    x = torch.full((1,), 40000.0)
    with model.no_sync():
        for _ in range(2):
            model(x).float().sum().backward()
    model(x).float().sum().backward()
    assert model.params[0].grad.tolist() == [120000.0]


def test_fairscale_attributes_give_way_to_the_wrapped_modules(single_rank_group: None) -> None:
    lstm = FSDP(nn.LSTM(2, 2))
    lstm.flatten_parameters()  # nn.LSTM's method, called in many forwards, is still reached
    assert FSDP(nn.Linear(2, 2)).flatten_parameters is True


def test_a_wrapper_around_a_wrapper_leaves_the_buffers_to_the_inner_one(single_rank_group: None) -> None:
    inner = FSDP(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    FSDP(inner, mixed_precision=True)  # the outer wrapper's buffer dtype is not the inner one's
    assert inner.module[1].running_mean.dtype == torch.float32


def test_a_module_wrapped_twice_is_refused(single_rank_group: None) -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    first = FSDP(m)
    with pytest.raises(
        ValueError, match="'0' \\(Linear\\) is already wrapped by another FullyShardedDataParallel"
    ):
        FSDP(m)  # it owned nothing, and its forward failed on meta placeholders
    with pytest.raises(ValueError, match="already wrapped"):
        FSDP(m[2])
    assert isinstance(FSDP(first).module, FSDP), "a wrapper around the wrapper stays allowed"
    seq = nn.Sequential(FSDP(nn.Linear(2, 2)), FSDP(nn.Linear(2, 2)))  # all parameters in inner wrappers
    outer = FSDP(seq)
    again = FSDP(seq)  # fairscale's re-wrapping (inference after training): it owns nothing of its own
    assert outer.handles == again.handles == []


def test_inner_wrappers_of_a_deleted_root_that_ran_go_under_a_new_root(single_rank_group: None) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ref = copy.deepcopy(net)
    net[0], net[1] = FSDP(net[0]), FSDP(net[1])
    x = torch.randn(2, 4)
    outer = FSDP(net)
    outer(x).sum().backward()  # the inner wrappers now belong to this root's context
    ref(x).sum().backward()  # (its gradients stay, as the inner wrappers' do)
    gone = weakref.ref(outer)
    del outer
    gc.collect()
    assert gone() is None, "nested wrappers do not keep their deleted root alive"
    outer = FSDP(net, reshard_after_forward=False)
    opt, ref_opt = torch.optim.SGD(outer.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for m, o in ((outer, opt), (ref, ref_opt)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(outer(x), ref(x), rtol=0, atol=1e-6)


def test_memory_stats_count_what_is_held_after_a_new_root(single_rank_group: None) -> None:
    options = {"mixed_precision": True, "reshard_after_forward": False}
    a, b = FSDP(nn.Linear(8, 8), **options), FSDP(nn.Linear(8, 8), **options)
    x = torch.randn(4, 8)
    root = FSDP(nn.Sequential(a, b), **options)
    root(x)  # no backward: both inner units keep their fp16 full parameters
    unit = 72 * 2  # a 8x8 layer's weight and bias in fp16
    assert root.memory_stats()["unsharded"] == 2 * unit
    del root
    gc.collect()
    assert a.memory_stats()["unsharded"] == unit, "an inner wrapper counts what its own handles hold"
    a.reset_memory_stats()
    root = FSDP(nn.Sequential(a, b), **options)
    root(x).float().sum().backward()
    assert root.memory_stats()["unsharded"] == 0, "the new root starts from the bytes really held"
    assert root.memory_stats()["unsharded_peak"] == 2 * unit


def test_the_root_context_owns_the_counters_and_bucketer_of_its_tree(single_rank_group: None) -> None:
    options = {"mixed_precision": True, "reshard_after_forward": False}
    inner = FSDP(nn.Linear(8, 8), **options)
    root = FSDP(nn.Sequential(inner, nn.Linear(8, 8)), **options)
    handles = [h for w in (root, inner) for h in w.handles]
    x = torch.randn(4, 8)

    def shared() -> list[tuple[object, ...]]:
        return [(h.stats, h.memory, h.rs_bucketer) for h in handles]

    with root.summon_full_params():
        assert root.memory_stats()["unsharded"] == 2 * 72 * 4, "the fp32 masters are gathered"
    assert all(stats is None and bucketer is None for stats, _, bucketer in shared()), "no root yet"
    assert root.memory_stats()["unsharded_peak"] == 0, "before the first forward nothing is counted"
    root(x)
    ctx = root._ctx
    assert ctx is not None and ctx.rs_bucketer is not None
    assert shared() == [(ctx.stats, ctx.memory, ctx.rs_bucketer)] * len(handles), "one of each, the root's"
    assert root.memory_stats()["unsharded"] == 2 * 72 * 2, "both units keep their fp16 full parameters"
    root._reset_lazy_init()
    assert all(stats is None and bucketer is None for stats, _, bucketer in shared()), "released"
    root(x)
    assert (
        root._ctx is not ctx and shared() == [(root._ctx.stats, root._ctx.memory, root._ctx.rs_bucketer)] * 2
    )
    assert root.memory_stats()["unsharded"] == 2 * 72 * 2, "the new root counts from the bytes held"


def test_a_constructor_that_raised_leaves_the_inner_wrappers_free(
    single_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 2))

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise MemoryError("no room for the flat parameter")

    with monkeypatch.context() as patch:
        patch.setattr(fsdp.wrapper.fully_sharded, "FlatParamHandle", out_of_memory)
        with pytest.raises(MemoryError) as failed:  # its traceback keeps the half-built wrapper alive
            FSDP(net)
    assert failed.value.__traceback__ is not None
    model = FSDP(net)  # a retry (in a notebook, say) is not told the inner wrapper belongs to another
    model(torch.ones(1, 2)).sum().backward()


def test_parameters_added_after_wrapping_are_refused_at_the_first_forward(single_rank_group: None) -> None:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 2)))
    model.module[1] = nn.Linear(2, 3)  # a replaced head: its parameters would train unreduced
    with pytest.raises(
        RuntimeError, match=r"\['1.weight', '1.bias'\] inside the wrapper at '<root>' were added"
    ):
        model(torch.ones(1, 2))


def test_parameters_and_wrappers_added_after_the_first_forward_are_refused(single_rank_group: None) -> None:
    head = nn.Linear(2, 3)  # built before the first forward: its registration is not what is seen
    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 2)))
    x = torch.ones(1, 2)
    model(x).sum().backward()
    assert model._ctx is not None
    looked = model._ctx.registrations
    model(x).sum().backward()
    assert model._ctx.registrations == looked, "a training step registers nothing, so nothing is rescanned"
    model.module[1] = head  # a replaced head after training started
    with pytest.raises(
        RuntimeError, match=r"\['1.weight', '1.bias'\] inside the wrapper at '<root>' were added"
    ):
        model(x)
    model.module[1] = nn.ReLU()
    model(x).sum().backward()  # nothing added any more: training goes on
    model.module[1].extra = nn.Parameter(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"\['1.extra'\] inside the wrapper at '<root>' were added"):
        model(x)
    del model.module[1].extra
    model.module[0] = FSDP(nn.Linear(2, 2))
    with pytest.raises(
        RuntimeError, match=r"wrappers under this root changed after its first forward \(new: \['0'\]\)"
    ):
        model(x)
    model.module[0] = nn.Identity()
    with pytest.raises(RuntimeError, match="changed after its first forward \\(one was removed\\)"):
        model(x)


def test_an_optimizer_built_before_wrapping_is_refused_at_its_step(single_rank_group: None) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    model = FSDP(net)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(
        RuntimeError, match=r"SGD holds parameters that FullyShardedDataParallel flattened.*0\.weight"
    ):
        early.step()  # the originals never get a gradient: it would do nothing, silently
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    late.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "the right optimizer steps"
    unrelated = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    unrelated.step()  # other optimizers in the process are untouched


def test_a_tie_across_the_wrapper_boundary_is_refused_at_the_step(single_rank_group: None) -> None:
    embed = nn.Embedding(5, 4)
    head = nn.Linear(4, 5, bias=False)
    head.weight = embed.weight  # tied, but only the embedding gets wrapped
    parent = nn.Sequential(nn.Sequential(embed), head)
    parent[0] = FSDP(parent[0])
    optim = torch.optim.SGD(parent.parameters(), lr=0.1)  # built after wrapping
    parent(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"(?s)0\.weight.*tied \(shared\) with a wrapped module"):
        optim.step()  # the head would train a copy the embedding no longer shares


def test_a_sharded_parameter_refuses_operations_on_values_and_keeps_its_metadata(
    single_rank_group: None,
) -> None:
    model = FSDP(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    model(torch.ones(2, 4)).sum().backward()
    weight = model.module[0].weight
    assert (weight.shape, weight.dtype, weight.requires_grad) == ((3, 4), torch.float32, True)
    assert (weight.ndimension(), torch.numel(weight), torch.is_floating_point(weight)) == (2, 12, True)
    assert weight.type().endswith("FloatTensor")
    attempts = {
        "type()": lambda: weight.type(torch.float64),  # a cast, not a name
        "zero_()": lambda: nn.init.zeros_(weight),  # would have been ignored silently
        "requires_grad_()": lambda: weight.requires_grad_(False),
        "setting .requires_grad": lambda: setattr(weight, "requires_grad", False),
        "reading .data": lambda: weight.data,
        "linear()": lambda: nn.functional.linear(torch.ones(2, 4), weight),  # outside any call of a module
    }
    for what, attempt in attempts.items():
        with pytest.raises(RuntimeError, match=rf"{re.escape(what)} on '0.weight', which is sharded"):
            attempt()
    with model.summon_full_params():  # the way to write values
        nn.init.zeros_(model.module[0].weight)
    with model.summon_full_params():
        assert torch.count_nonzero(model.module[0].weight) == 0


def test_sharded_parameters_show_requires_grad_set_on_the_root(single_rank_group: None) -> None:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 2)))
    model(torch.ones(1, 2)).sum().backward()
    for flag in (False, True):
        model.requires_grad_(flag)  # reaches the flat parameters; the stand-ins follow at the next reshard
        model(torch.ones(1, 2))
        assert [model.module[0].module.weight.requires_grad, model.module[1].bias.requires_grad] == [
            flag,
            flag,
        ]
        with model.summon_full_params():
            assert {p.requires_grad for p in model.parameters()} == {flag}


def test_a_parameter_replaced_after_the_first_forward_is_refused(single_rank_group: None) -> None:
    model = FSDP(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    model(torch.ones(2, 4))
    model.module[2].bias = nn.Parameter(torch.zeros(2))  # the flat parameter would ignore it
    with pytest.raises(RuntimeError, match=r"'2\.bias' was replaced after wrapping"):
        model(torch.ones(2, 4))


def test_an_optimizer_step_inside_no_sync_is_refused(single_rank_group: None) -> None:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with model.no_sync():
        model(torch.ones(1, 2)).sum().backward()
        other.step()  # an optimizer over other parameters is not concerned
        with pytest.raises(RuntimeError, match=r"SGD\.step\(\) inside FullyShardedDataParallel\.no_sync\(\)"):
            opt.step()  # the accumulated gradients are not reduced yet, nor in .grad
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def test_a_state_dict_with_an_extra_prefix_gets_a_hint(single_rank_group: None) -> None:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(2, 2)), nn.Linear(2, 1)))
    prefixed = {f"module.{k}": v for k, v in model.state_dict().items()}  # saved from a DDP-wrapped model
    with pytest.raises(RuntimeError, match=r"missing ones with the prefix 'module\.'.*removeprefix"):
        model.load_state_dict(prefixed)
    model.load_state_dict({k.removeprefix("module."): v for k, v in prefixed.items()})  # the hint works


def test_a_deleted_wrapper_is_freed(single_rank_group: None) -> None:
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Linear(4, 2)))
    model(torch.ones(2, 4)).sum().backward()
    torch.optim.Adam(model.parameters()).step()
    refs = [weakref.ref(w) for w in fsdp.get_fsdp_instances(model)]
    shard = weakref.ref(model.params[0])
    del model
    gc.collect()
    assert all(r() is None for r in refs) and shard() is None, (
        "a hook kept the wrappers and their shards alive"
    )


def test_the_stale_optimizer_check_follows_later_wraps_and_meta_models(single_rank_group: None) -> None:
    net = nn.Linear(4, 4)
    warm = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.ones(1, 4)).sum().backward()
    warm.step()  # scanned once, before wrapping
    model = FSDP(net)
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="SGD holds parameters that FullyShardedDataParallel flattened"):
        warm.step()  # same parameter count, but a wrap since the last scan

    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    early = torch.optim.SGD(meta.parameters(), lr=0.1)  # over the meta parameters
    deferred = FSDP(meta)
    deferred(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"flattened \(e\.g\. \['0\.weight'"):
        early.step()

    fresh = nn.Linear(2, 2)
    kept = fresh.weight
    FSDP(fresh)
    loaded = copy.deepcopy(pickle.loads(pickle.dumps(kept)))  # the values, saved and loaded elsewhere
    torch.optim.SGD([loaded], lr=0.1).step()  # not a flattened parameter: no refusal
