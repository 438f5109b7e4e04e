"""Weight precision at load: keep a checkpoint's own precision, dequantize, or quantize with MLX.

`--dtype` and `--quantization` resolve here into a `WeightPlan`:
- `auto`: weights stay as stored (bf16 / fp16 / float32 / MLX affine 8- or 4-bit, GGUF Q8_0 / Q4_0 /
  Q4_1 as 8- or 4-bit affine with group 32, other GGUF types as the float32 the reader dequantized them
  to); everything else (norms, biases) computes in the model's compute dtype (float32 on the CPU).
- `float32` / `bfloat16` / `float16`: every weight in that float type (a quantized checkpoint is
  dequantized, in float32); `float32` is the exactness reference on the CPU.
- `quantization` q8 / q4: the weights quantized at load by MLX's own quantizer (`nn.quantize`, group
  64), from `--dtype`'s floats (a quantized checkpoint is dequantized first: two roundings, logged).

On MLX's CPU backend the linear layers and embedding tables are swapped for modules that multiply
through engine/cpu/qgemm.c on the engine's thread (MLX's CPU matmuls for bf16 and quantized weights are
slow, and its float32 ones run OpenMP from MLX's own thread: docs/cpu-backend.md); where that kernel
cannot run, low-precision weights are dequantized to float32 instead, with a log line. On a GPU MLX's
own modules stay (Metal has fast quantized kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_flatten, tree_map_with_path

logger = logging.getLogger(__name__)

QUANTIZATIONS = {"q8": 8, "q4": 4}
DEFAULT_GROUP_SIZE = 64  # mlx_lm.convert's default
# mlx's tensor-parallel linears (engine/distributed.py) are linears too; *ToAll ones all-sum their output.
_SHARDED_QUANT = (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)
_SHARDED_TO_ALL = (ShardedToAllLinear, QuantizedShardedToAllLinear)
_QUANT = (nn.QuantizedLinear, nn.QuantizedEmbedding, *_SHARDED_QUANT)
_LINEAR = (nn.Linear, nn.QuantizedLinear, AllToShardedLinear, ShardedToAllLinear, *_SHARDED_QUANT)
_EMBED = (nn.Embedding, nn.QuantizedEmbedding)
_DTYPE_NAME = {mx.float32: "float32", mx.bfloat16: "bf16", mx.float16: "f16"}


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu or not mx.is_available(mx.gpu)


def precision_name(model: nn.Module) -> str:
    """What the matmul weights are, e.g. "q4 (group 32)", "bf16", "float32", "q4 (group 64) + bf16"."""
    kinds: set[str] = set()
    for _, m in model.named_modules():
        if isinstance(m, (CpuLinear, CpuEmbedding)):
            kinds.add(m.precision)
        elif isinstance(m, _QUANT):
            kinds.add(f"q{m.bits} (group {m.group_size})")
        elif isinstance(m, _LINEAR + _EMBED):
            kinds.add(_DTYPE_NAME.get(m.weight.dtype, str(m.weight.dtype)))
    return " + ".join(sorted(kinds)) or "none"


def _weights_module(m: Any) -> bool:
    return isinstance(m, _LINEAR + _EMBED + (CpuLinear, CpuEmbedding))


def cast_except_weights(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every float parameter to `dtype` except the matrices of linear and embedding layers (and
    their quantization scales / biases), which keep their precision."""
    modules = dict(model.named_modules())
    updates = []
    for path, a in tree_flatten(model.parameters()):
        owner, _, name = path.rpartition(".")
        if name in ("weight", "scales", "biases") and _weights_module(modules.get(owner)):
            continue
        if mx.issubdtype(a.dtype, mx.floating) and a.dtype != dtype:
            updates.append((path, a.astype(dtype)))
    if updates:
        model.load_weights(updates, strict=False)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def quantize(model: nn.Module, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """MLX's affine quantizer over every linear and embedding layer whose input size the group divides."""
    def predicate(path: str, m: nn.Module) -> bool:
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)


@dataclass(frozen=True, slots=True)
class WeightPlan:
    dtype: str  # the --dtype asked for
    quantization: str | None  # "q8" | "q4" | None


def apply_plan(model: nn.Module, plan: WeightPlan, compute_dtype: mx.Dtype,
               shard: Callable[[nn.Module], None] | None = None) -> None:
    """Bring a loaded model's weights to the plan (see the module docstring); evaluates them. `shard`
    (tensor parallelism) splits the layers once their precision is settled, before the CPU modules
    are swapped in."""
    from mlx_lm.utils import dequantize_model

    quantized = is_quantized(model)
    if plan.dtype != "auto" or (plan.quantization and quantized):
        if plan.quantization and quantized:
            logger.warning("--quantization %s over a quantized checkpoint (%s): dequantized, then quantized "
                           "again (two roundings)", plan.quantization, precision_name(model))
        model.set_dtype(mx.float32)  # scales and biases first: dequantized weights get no fp16 rounding
        if quantized:
            dequantize_model(model)
        if plan.dtype not in ("auto", "float32"):
            model.set_dtype(getattr(mx, plan.dtype))
    if plan.quantization:
        quantize(model, QUANTIZATIONS[plan.quantization])
    if shard is not None:
        shard(model)
    if not on_cpu():  # MLX's own (Metal / CUDA) kernels read every precision
        model.set_dtype(compute_dtype)
        mx.eval(model.parameters())
        return
    # CPU: the matmul weights keep their precision, everything else computes in `compute_dtype`.
    cast_except_weights(model, compute_dtype)
    mx.eval(model.parameters())
    from engine.cpu import qgemm

    why = qgemm.unsupported_reason()
    if why is None:
        swap_cpu_modules(model, compute_dtype)
        return
    if precision_name(model) == _DTYPE_NAME[mx.float32]:
        return  # MLX's float32 matmuls (the BLAS)
    logger.warning("weights dequantized to float32: the low-precision CPU kernel cannot run here (%s)", why)
    model.set_dtype(mx.float32)
    if is_quantized(model):
        dequantize_model(model)
    mx.eval(model.parameters())


class CpuLinear(nn.Module):
    """A linear layer whose weight stays as stored (float32, bf16, fp16, affine 8/4-bit), multiplied by
    engine/cpu/qgemm.c on the calling thread."""

    def __init__(self, packed: Any, bias: mx.array | None, params: dict[str, mx.array],
                 group: mx.distributed.Group | None = None) -> None:
        """`group`: a tensor-parallel slice of the input features, whose partial products are summed
        over the group (mlx's ShardedToAllLinear) before the bias."""
        super().__init__()
        for k, v in params.items():  # the stored arrays stay parameters (memory accounting, state dicts)
            setattr(self, k, v)
        if bias is not None:
            self.bias = bias
        self._packed = packed
        self._group = group
        self.precision = _packed_name(packed)

    def __call__(self, x: mx.array) -> mx.array:
        from engine.cpu.qgemm import qgemm

        y = qgemm(x, self._packed)
        if self._group is not None:
            y = mx.distributed.all_sum(y, group=self._group)
        return y + self["bias"] if "bias" in self else y


class CpuEmbedding(nn.Module):
    """An embedding table kept in its stored precision: rows gathered and dequantized by MLX, and used as
    the tied output layer through engine/cpu/qgemm.c (the same table, read once per step)."""

    def __init__(self, packed: Any, params: dict[str, mx.array], compute_dtype: mx.Dtype,
                 group_size: int = 0, bits: int = 0) -> None:
        super().__init__()
        for k, v in params.items():
            setattr(self, k, v)
        self._packed = packed
        self._dtype = compute_dtype
        self._f32 = SimpleNamespace(table=None)  # not a parameter: float32_table()'s copy
        self.group_size, self.bits = group_size, bits
        self.precision = _packed_name(packed)

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self.rows(np.asarray(ids))
        return mx.array(rows).reshape(*ids.shape, self._packed.k).astype(self._dtype)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` as float32 on the host [len(ids), hidden], dequantized in C as the head's product
        reads them (MLX's gather-and-dequantize cost ~0.2 ms a step)."""
        from engine.cpu.qgemm import rows_host

        return rows_host(ids, self._packed)

    def as_linear(self, x: mx.array) -> mx.array:
        from engine.cpu.qgemm import qgemm

        return qgemm(x, self._packed)

    def float32_table(self) -> mx.array:
        """The whole table in float32, for readers of raw rows (the MTP assistant's C pass): the stored
        array itself when it is float32, else a dequantized copy made once (vocab x hidden x 4 bytes)."""
        if self._packed.fmt == "f32":
            return self["weight"]
        if self._f32.table is None:
            if self.bits:
                table = mx.dequantize(self["weight"], self["scales"], self["biases"],
                                      group_size=self.group_size, bits=self.bits)
            else:
                table = self["weight"]
            self._f32.table = mx.contiguous(table.astype(mx.float32))
            mx.eval(self._f32.table)
        return self._f32.table


def _packed_name(packed: Any) -> str:
    if packed.group:
        return f"{packed.fmt} (group {packed.group})"
    return "float32" if packed.fmt == "f32" else packed.fmt


def swap_cpu_modules(model: nn.Module, compute_dtype: mx.Dtype = mx.float32) -> int:
    """Replace low-precision linear / embedding layers by the C-kernel modules; returns how many."""
    from engine.cpu.qgemm import PackedWeights

    count = 0

    def swap(path: str, m: Any) -> Any:
        nonlocal count
        packed: PackedWeights | None = None
        if isinstance(m, _QUANT):
            if getattr(m, "mode", "affine") != "affine" or m.bits not in (4, 8) or "biases" not in m:
                return m
            packed = PackedWeights.affine(m["weight"], m["scales"], m["biases"], m.group_size, m.bits)
            params = {k: m[k] for k in ("weight", "scales", "biases")}
        elif isinstance(m, (*_LINEAR, nn.Embedding)) and m.weight.dtype in (mx.bfloat16, mx.float16,
                                                                                mx.float32):
            # float32 too: every matmul then runs on the caller's thread. An OpenMP region opened from
            # MLX's own thread (its float32 matmuls reach the small-M GEMM there) starts a second
            # libgomp pool, and with more pool threads than CPUs libgomp stops spinning for good:
            # every later parallel region waits for sleeping workers (single stream fell from 80 to 42).
            packed = PackedWeights.floats(m.weight)
            params = {"weight": m.weight}
        if packed is None or not packed.supported():
            return m
        count += 1
        if isinstance(m, _EMBED):
            quant = isinstance(m, nn.QuantizedEmbedding)
            return CpuEmbedding(packed, params, compute_dtype, m.group_size if quant else 0,
                                m.bits if quant else 0)
        return CpuLinear(packed, m.get("bias"), params, m.group if isinstance(m, _SHARDED_TO_ALL) else None)

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    return count


def set_activation_precision(model: nn.Module, choice: str) -> bool:
    """Point every C-kernel product whose weights the int8 kernel reads (4-bit) at 8-bit activations
    (`int8`; `auto` where the kernels' ISA is one the int8 kernel is faster on), or keep float32 activations
    everywhere (`float32`). Returns whether any product now takes int8 activations; `int8` with no such
    weights raises ValueError."""
    from engine.cpu.qgemm import int8_by_default

    packed = [m._packed for m in model.modules() if isinstance(m, (CpuLinear, CpuEmbedding))]
    wanted = choice == "int8" or (choice == "auto" and int8_by_default())
    int8 = [p for p in packed if p.int8_serves()] if wanted else []
    if choice == "int8" and not int8:
        raise ValueError("--activation-precision int8 needs 4-bit weights multiplied by the C kernels "
                         "(this model has none: use auto or float32)")
    chosen = {id(p) for p in int8}
    for p in packed:
        p.int8 = id(p) in chosen
    return bool(chosen)


def uses_int8_activations(model: nn.Module) -> bool:
    """Whether set_activation_precision pointed some product of this model at 8-bit activations."""
    return any(m._packed.int8 for m in model.modules() if isinstance(m, (CpuLinear, CpuEmbedding)))
