"""LocalShardAdamW: torch's AdamW over FSDP2's DTensor parameters, stepped on the local shards: bit-identical
parameters and state to torch's AdamW, no DTensor dispatch after the first step, hooks fired once per step."""

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from veomni.compat.torch import unhooked_step
from veomni.optim import build_optimizer
from veomni.optim.local_shards import LocalShardAdamW


def sharded_model():
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)) for _ in range(3)
    ]
    model = torch.nn.Sequential(*blocks)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def groups(model):
    return [
        {"params": [p for p in model.parameters() if p.ndim == 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]


def dtensor_dispatches(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "PythonSubclass" for e in prof.events())


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}])
def test_equal_to_torch_adamw_bit_for_bit(one_process_group, kernel):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    results, fired = [], []
    for cls in (torch.optim.AdamW, LocalShardAdamW):
        model = sharded_model()
        optimizer = cls(groups(model), lr=1e-2, **kernel)
        optimizer.register_step_pre_hook(lambda *_, cls=cls: fired.append(cls))
        dispatches = []
        for _ in range(3):
            model(x).square().mean().backward()
            dispatches.append(dtensor_dispatches(optimizer.step))
            optimizer.zero_grad(set_to_none=True)
        results.append((model, optimizer, dispatches))
    (ref, ref_opt, ref_dispatches), (ours, opt, ours_dispatches) = results
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(full(a), full(b))
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for key in ref_state:
        for name, value in ref_state[key].items():
            assert type(value) is type(state[key][name])  # the moments stay DTensors (DCP saves them as torch's)
            assert torch.equal(full(value), full(state[key][name]))
    assert min(ref_dispatches) > 0 and ours_dispatches[1:] == [0, 0], (ref_dispatches, ours_dispatches)
    assert fired.count(LocalShardAdamW) == 3  # the step hooks ran once per step, not once more inside it
    assert all(p.grad is None for p in (p._local_tensor for p in ours.parameters()))


def test_resumed_state_steps_on_local_shards(one_process_group):
    """A state loaded back (DCP / load_state_dict) is stepped as if never saved."""
    x = torch.randn(4, 16)
    model = sharded_model()
    optimizer = LocalShardAdamW(groups(model), lr=1e-2, fused=True)
    model(x).sum().backward()
    optimizer.step()
    twin = sharded_model()
    with torch.no_grad():
        for a, b in zip(model.parameters(), twin.parameters()):
            b.copy_(a)
    saved = optimizer.state_dict()
    saved = {**saved, "state": {k: {n: v.clone() for n, v in s.items()} for k, s in saved["state"].items()}}
    twin_opt = LocalShardAdamW(groups(twin), lr=1e-2, fused=True)
    twin_opt.load_state_dict(saved)
    for m, opt in ((model, optimizer), (twin, twin_opt)):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        assert dtensor_dispatches(opt.step) == 0
    assert all(torch.equal(full(a), full(b)) for a, b in zip(model.parameters(), twin.parameters()))


def test_build_optimizer_uses_it(one_process_group):
    assert type(build_optimizer(sharded_model(), optimizer_type="adamw")) is LocalShardAdamW


def test_canary_torch_step_hook_wrapper():
    """veomni.compat.torch.unhooked_step relies on torch's step wrapper being marked `hooked` and wrapping with
    functools.wraps: if torch changes that, LocalShardAdamW would fire every step hook twice (this fails first)."""
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])  # the first instance wraps the class's step
    assert getattr(torch.optim.AdamW.step, "hooked", False)
    assert not getattr(unhooked_step(torch.optim.AdamW), "hooked", False)
