"""Count what one DeepSeek V4 decoder layer costs a decode step, the way a device sees it: kernel
launches and host syncs, counted at the dispatcher on the CPU (pure torch; imported by the engine
runner `dsv4_step_audit.py` in the CPU-wheel venv and by the counter's own unit test).

A `TorchDispatchMode` sees every aten op that reaches the dispatcher (after autograd and after
CompositeImplicit decompositions). Classified:
  * view / metadata / allocation ops (`func.is_view`, `detach`, `empty*`, `set_`, ...): not launches;
  * host syncs: `_local_scalar_dense` / `item` (`.item()`, `bool(t)`, `int(t)`; under
    inference_mode `item` and `is_nonzero` (`bool(t)`) reach the dispatcher themselves),
    `nonzero` (and `nonzero_numpy`: `as_tuple=True`), `masked_select`, `unique*`,
    `equal`, `repeat_interleave` with tensor repeats and no `output_size`, `bincount`, boolean-mask
    `index` / `index_put`, and the Python-level `Tensor.tolist()` / `.cpu()` / `.numpy()` (counted
    by a wrapper while a layer is open: on the CPU they do not reach the dispatcher);
  * every other op: one launch.
vLLM custom ops (`vllm::*`) are Python wrappers around torch chains (attention, MoE, indexer):
they are expanded (their registered implementation runs under the counter), EXCEPT fused kernels,
named `gfx936_fused_*` by convention: one op, one device launch (their CPU implementation is the
PyTorch twin, whose insides are not the device's launches), or as many as `DEVICE_KERNELS` says
for the three that are more than one kernel on gfx936. A fused op's implementation still
runs under the counter for its host syncs: a sync inside a twin is counted (and its site named),
only its launches are not, so wrapping a twin in a fused op cannot hide a sync. Compiled ops of
other namespaces (`_C::*`) count as one launch each.
"""
from __future__ import annotations

import sys
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

FUSED_PREFIX = "gfx936_fused_"

NO_LAUNCH = {
    "detach", "alias", "lift_fresh", "lift_fresh_copy", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "set_", "resize_", "_unsafe_view", "_reshape_alias",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
    "record_stream", "_nested_tensor_size",
}
SYNC = {
    "_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "equal", "bincount", "argwhere",
    # `bool(t)` / `if t:` under inference_mode reaches the dispatcher as `is_nonzero` (its
    # `item` inside is not seen again); `nonzero(as_tuple=True)` as `nonzero_numpy`
    "is_nonzero", "nonzero_numpy",
}

# Fused ops that are more than one device kernel on gfx936 with the csrc_gfx936 extension (the
# kernels tier the audit models), as the H200 stage of the same kernels counts them per op
# (docs/bench/layer-step-h200.md, "Launches per layer by step part"):
# - the MXFP4 MoE op is route + gate/up + down + reduce, the reduce folded into down up to 4
#   tokens (csrc_gfx936/moe_mxfp4.cu, kFoldTokens; docs/bench/moe-r2-h200.md), and gate/up +
#   down alone where the direct path takes the shape (direct_ok: up to the op's `direct_max_m`
#   tokens, gfx936_kernel_select.moe_direct_max_m: 64 unless VLLM_GFX936_MOE_DIRECT_MAX_M
#   lowers it);
# - the W8A16 linear is one GEMV up to the op's `gemv_max_m` tokens
#   (gfx936_kernel_select.w8a16_gemv_max_m: 16 eagerly, 4 under graphs) and a dequantize + the
#   platform GEMM above (scaled_mm/gfx936_w8a16_kernel.py).
# Every other fused op is one kernel (the Sparse MLA decode too: sparse_mla_decode.cu merges its
# split-K partials in the last block).
def _tokens(x: torch.Tensor) -> int:
    """Rows of an activation (every dim but the last)."""
    return x.numel() // max(x.shape[-1], 1)


def _w8a16_kernels(args) -> int:
    # args: (x, weight, scale, block_n, block_k, out_dtype, gemv_max_m, cached_weight); a kept
    # BF16 weight copy is one GEMM
    gemv_max_m, cached = args[6], args[7] if len(args) > 7 else None
    return 1 if cached is not None or _tokens(args[0]) <= gemv_max_m else 2


def _moe_kernels(args) -> int:
    # args: (output, hidden_states, w1 [E, 2I, H/2], w1_scale, w2, w2_scale, topk_weights,
    # topk_ids, expert_map, on_input, alpha, limit, on_kernels, direct_max_m); the product's own
    # rule picks the direct path (two kernels, no routing)
    from vllm.model_executor.layers.fused_moe.experts.gfx936_mxfp4_moe_kernel import direct_ok

    m = _tokens(args[1])
    if direct_ok(m, args[7].shape[-1], args[1].shape[-1], args[2].shape[1] // 2, args[13]):
        return 2
    return 3 if m <= 4 else 4


DEVICE_KERNELS = {
    "gfx936_fused_mxfp4_moe": _moe_kernels,
    "gfx936_fused_w8a16_mm": _w8a16_kernels,
}

# qualified name ("vllm::op") -> Python implementation, filled by `capture_custom_op_impls()`
# before vLLM is imported, so that wrapper ops can be expanded under the counter.
CUSTOM_IMPLS: dict[str, object] = {}


def capture_custom_op_impls() -> None:
    """Record the Python implementations registered through `torch.library.Library.impl` (how
    vLLM's `direct_register_custom_op` registers them). Call before importing vLLM."""
    lib_cls = torch.library.Library
    if getattr(lib_cls.impl, "_step_counter", False):
        return
    orig = lib_cls.impl

    def impl(self, op_name, fn=None, dispatch_key="", *args, **kwargs):
        name = op_name if isinstance(op_name, str) else getattr(op_name, "__name__", str(op_name))
        if callable(fn):
            CUSTOM_IMPLS.setdefault(f"{self.ns}::{name.split('.')[0]}", fn)
        return orig(self, op_name, fn, dispatch_key, *args, **kwargs)

    impl._step_counter = True
    lib_cls.impl = impl


def _bool_index(indices) -> bool:
    return any(t is not None and isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
               for t in indices)


def classify(func, args, kwargs) -> str:
    """'view' | 'sync' | 'launch' for one dispatched op."""
    name = func._schema.name.split("::")[-1]
    ns = func.namespace
    if ns == "aten":
        if func.is_view or name in NO_LAUNCH:
            return "view"
        if name in SYNC:
            return "sync"
        if (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
                and kwargs.get("output_size") is None):
            return "sync"  # the output length is the sum of a tensor of repeats
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args[1]):
            return "sync"
    return "launch"


def sync_site() -> str:
    """file:line of the innermost vLLM frame on the stack (where a sync comes from)."""
    for fr in reversed(traceback.extract_stack()):
        f = fr.filename.replace("\\", "/")
        if "/vllm/" in f and "/torch/" not in f and fr.name != "__torch_function__":
            return f"{f.rsplit('/vllm/', 1)[1]}:{fr.lineno}"
    return "?"


def launch_site() -> str:
    """`sync_site()` without reading source lines (cheap enough for every launch)."""
    fr = sys._getframe(1)
    while fr is not None:
        f = fr.f_code.co_filename.replace("\\", "/")
        # (a vLLM parameter's `__torch_function__` is not where an op comes from)
        if "/vllm/" in f and "/torch/" not in f and fr.f_code.co_name != "__torch_function__":
            return f"{f.rsplit('/vllm/', 1)[1]}:{fr.f_lineno}"
        fr = fr.f_back
    return "?"


class StepCounter(TorchDispatchMode):
    """Counts launches and syncs (and which ops) while entered; `sites` counts each sync's
    "op @ file:line" (innermost vLLM frame). `launches=False`: syncs only (inside a fused op)."""

    def __init__(self, counts: Counter | None = None, ops: Counter | None = None,
                 sites: Counter | None = None, launches: bool = True,
                 launch_sites: Counter | None = None):
        super().__init__()
        self.counts = counts if counts is not None else Counter()
        self.ops = ops if ops is not None else Counter()
        self.sites = sites if sites is not None else Counter()
        self.launches = launches
        # "file:line" (innermost vLLM frame) -> launches from there
        self.launch_sites = launch_sites if launch_sites is not None else Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        qual = func._schema.name
        ns, name = qual.split("::", 1)
        if ns == "vllm" and qual in CUSTOM_IMPLS:
            fused = name.startswith(FUSED_PREFIX)
            if fused and self.launches:  # its device kernels (one, or DEVICE_KERNELS')
                n = DEVICE_KERNELS[name](args) if name in DEVICE_KERNELS else 1
                self.counts["launch"] += n
                self.ops[f"launch:{qual}"] += n
                self.launch_sites[launch_site()] += n
            # a Python wrapper op: count what it runs, not the wrapper; a fused op: only the
            # host syncs of what it runs
            with StepCounter(self.counts, self.ops, self.sites, self.launches and not fused,
                             self.launch_sites):
                return CUSTOM_IMPLS[qual](*args, **kwargs)
        kind = classify(func, args, kwargs)
        if kind != "sync" and not self.launches:
            return func(*args, **kwargs)
        self.counts[kind] += 1
        if kind != "view":
            self.ops[f"{kind}:{qual}"] += 1
        if kind == "sync":
            self.sites[f"{name} @ {sync_site()}"] += 1
        elif kind == "launch":
            self.launch_sites[launch_site()] += 1
        return func(*args, **kwargs)


class HostCopyWatch:
    """`.tolist()`, `.cpu()`, `.numpy()` do not reach the dispatcher for a CPU tensor; on the device
    each is a device-to-host copy and a sync. While `active` is set they count as syncs."""

    METHODS = ("tolist", "cpu", "numpy")

    def __init__(self):
        self.active: StepCounter | None = None
        self._orig = {}

    def install(self) -> None:
        for m in self.METHODS:
            orig = getattr(torch.Tensor, m)
            self._orig[m] = orig

            def wrapped(t, *a, _orig=orig, _m=m, **k):
                c = self.active
                if c is not None:
                    c.counts["sync"] += 1
                    c.ops[f"sync:Tensor.{_m}"] += 1
                    c.sites[f"Tensor.{_m} @ {sync_site()}"] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, m, wrapped)

    def uninstall(self) -> None:
        for m, orig in self._orig.items():
            setattr(torch.Tensor, m, orig)
        self._orig.clear()


def count_call(impls: dict, fn, *args, **kwargs):
    """(result, launches, syncs, ops) of one call under a StepCounter, with the fused ops'
    implementations ``impls`` ("vllm::op" -> function) known to it, as in the engine run, so
    host syncs inside them count."""
    CUSTOM_IMPLS.update(impls)
    c = StepCounter()
    with c:
        out = fn(*args, **kwargs)
    return out, c.counts["launch"], c.counts["sync"], dict(c.ops)


def fake_call(op, *args):
    """(``op``'s result, the fake args) of ``op`` under FakeTensorMode on fake copies of
    ``args``: its registered fake runs (what torch.compile and graph capture see)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        return op(*fargs), fargs


def layer_kind(ratio: int) -> str:
    return {0: "SWA", 4: "C4", 128: "C128"}.get(int(ratio), f"C{ratio}")
