"""The private PyTorch APIs fastpt.plan depends on, all in one place: a torch upgrade that moves or
renames one fails tests/test_plan.py::test_private_torch_apis_resolve, which names it (PRIVATE),
before a plan comes out quietly wrong.

- DTensor's shape propagation runs ops on global-shape fake tensors in
  ShardingPropagator._propagate_tensor_meta_non_cached (torch 2.11 and 2.13 alike; 2.13 also has a
  lock around it, 2.11 none): memory.MemoryTrace wraps it to record nothing there;
- torch.UntypedStorage.resize_, which FSDP2 uses to free and refill unsharded parameters and no
  dispatch mode sees: patched while a trace records;
- FSDP2's records of its parameters (module._get_fsdp_state()._fsdp_param_group.fsdp_params, each
  one's unsharded_accumulated_grad) and its copy-out op torch.ops.fsdp.split_with_sizes_copy;
- the fake process group (torch.testing._internal.distributed.fake_pg.FakeStore, the "fake"
  backend) and the c10d functional collectives' fakes (torch.distributed._tools.fake_collectives);
- autograd's current graph task (torch._C._current_graph_task_id: inside a backward or not), the
  dispatch mode stack;
- Inductor: compile_fx's inner_compile hook, its lowering's realize thresholds
  (torch._inductor.config), and the FX graph and AOTAutograd caches' switches.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch


def attr(module: str, path: str = "") -> object:
    """module.attr.attr... (the module itself for no path): ImportError or AttributeError when
    torch moved it."""
    obj = importlib.import_module(module)
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name)
    return obj


def annotated(module: str, cls: str, field: str) -> object:
    """A field a class declares (set per instance, so not on the class itself)."""
    return attr(module, cls).__annotations__[field]


FSDP = "torch.distributed.fsdp._fully_shard."
# What test_private_torch_apis_resolve looks up, by the name it reports when one has moved.
PRIVATE = {
    "ShardingPropagator._propagate_tensor_meta_non_cached": lambda: attr(
        "torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_non_cached"
    ),
    "torch.UntypedStorage.resize_": lambda: attr("torch", "UntypedStorage.resize_"),
    "FSDPModule._get_fsdp_state": lambda: attr("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"),
    # set in __init__ in torch 2.11, a property over _fsdp_param_groups in 2.13
    "FSDPState._fsdp_param_group": lambda: "self._fsdp_param_group" in inspect_source(FSDP + "_fsdp_state"),
    "FSDPParamGroup.fsdp_params": lambda: "self.fsdp_params" in inspect_source(FSDP + "_fsdp_param_group"),
    "FSDPParam.unsharded_accumulated_grad": lambda: annotated(
        FSDP + "_fsdp_param", "FSDPParam", "unsharded_accumulated_grad"
    ),
    "torch.ops.fsdp.split_with_sizes_copy": lambda: (
        attr(FSDP + "_fsdp_collectives") and torch.ops.fsdp.split_with_sizes_copy.default
    ),
    "fake_pg.FakeStore": lambda: attr("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    "torch.distributed._tools.fake_collectives": lambda: attr("torch.distributed._tools.fake_collectives"),
    "torch._C._current_graph_task_id": lambda: attr("torch._C", "_current_graph_task_id"),
    "_get_current_dispatch_mode_stack": lambda: attr(
        "torch.utils._python_dispatch", "_get_current_dispatch_mode_stack"
    ),
    "compile_fx(inner_compile=)": lambda: (
        "inner_compile" in attr("torch._inductor.compile_fx", "compile_fx").__code__.co_varnames
    ),
    "torch._inductor.config realize thresholds": lambda: realize_thresholds("cuda") and realize_thresholds("cpu"),
    "torch._inductor.config.fx_graph_cache": lambda: attr("torch._inductor.config", "fx_graph_cache") is not None,
    "torch._functorch.config.enable_autograd_cache": lambda: (
        attr("torch._functorch.config", "enable_autograd_cache") is not None
    ),
    "FSDPMemTracker": lambda: attr("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),
}


def inspect_source(module: str) -> str:
    import inspect

    return inspect.getsource(attr(module))


def missing() -> list[str]:
    """The private APIs of PRIVATE this torch lacks, each named with what failed."""
    out = []
    for name, check in PRIVATE.items():
        try:
            found = check()
        except (ImportError, AttributeError, KeyError, RuntimeError, TypeError) as e:
            out.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if not found:
            out.append(f"{name}: not found")
    return out


# ---- the APIs, as fastpt.plan uses them


def pause_in_sharding_propagation(pause: Callable[[], AbstractContextManager]) -> Callable[[], None]:
    """Run DTensor's shape propagation on fake tensors inside `pause()`; returns the undo."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def paused(self, op_schema):
        with pause():
            return propagate(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = paused
    return lambda: setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate)


def in_backward() -> bool:
    """Inside an autograd backward (its graph task running)."""
    return torch._C._current_graph_task_id() != -1


def dispatch_mode_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def fsdp_params(model: torch.nn.Module) -> Iterator:
    """FSDP2's records of every sharded parameter (its private FSDPParam objects); none without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        yield from group.fsdp_params if group else ()


def fsdp_split_copy() -> object:
    """The op FSDP2 copies each all-gathered parameter out of the flat buffer with (registered when
    torch.distributed.fsdp is imported, which fastpt.train's start-up leaves out)."""
    importlib.import_module("torch.distributed.fsdp")
    return torch.ops.fsdp.split_with_sizes_copy.default


def fake_store() -> object:
    """A store for the "fake" process group (collectives that return at once), its collectives'
    fakes for the c10d functional ops registered."""
    import torch.distributed._tools.fake_collectives  # noqa: F401  (c10d collectives on fake tensors)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def realize_thresholds(target: str) -> tuple[int, int, int]:
    """Inductor's lowering's realize thresholds for a device (ir.py's rules, read from
    torch._inductor.config): (reads, accumulated reads, op count). A value is stored when several ops
    read it and it reads more than `reads` buffers or inlines more than `op count` ops; always when
    it reads more than `accumulated reads` or inlines more than `op count`."""
    import torch._inductor.config as c

    cpu = target == "cpu"
    opcount = c.realize_opcount_threshold
    if opcount is None:  # torch >= 2.12: None means the device's default
        opcount = c.realize_cpu_opcount_threshold if cpu else c._realize_opcount_threshold_default
    acc = c.realize_acc_reads_threshold
    if acc is None:
        acc = c.realize_cpu_acc_reads_threshold if cpu else c._realize_acc_reads_threshold_default
    return c.realize_reads_threshold, acc, opcount
