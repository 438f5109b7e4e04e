"""Weight precision at load: `--dtype` and `--quantization` resolve into a `WeightPlan`; on MLX's CPU backend
linear layers and embeddings become modules that multiply through engine/cpu/qgemm.c (docs/cpu-backend.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

from engine.cpu.qgemm import BLOCK_FORMATS, BlockWeights, PackedWeights, int8_by_default, qgemm, rows_host
from engine.cpu.qgemm import unsupported_reason as qgemm_reason

logger = logging.getLogger(__name__)

QUANTIZATIONS = {"q8": 8, "q4": 4}
DEFAULT_GROUP_SIZE = 64  # mlx_lm.convert's default
# mlx's tensor-parallel linears are linears too; *ToAll ones all-sum their output.
_SHARDED_QUANT = (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)
_SHARDED_TO_ALL = (ShardedToAllLinear, QuantizedShardedToAllLinear)
_QUANT = (nn.QuantizedLinear, nn.QuantizedEmbedding, *_SHARDED_QUANT)
_LINEAR = (nn.Linear, nn.QuantizedLinear, AllToShardedLinear, ShardedToAllLinear, *_SHARDED_QUANT)
_EMBED = (nn.Embedding, nn.QuantizedEmbedding)
_DTYPE_NAME = {mx.float32: "float32", mx.bfloat16: "bf16", mx.float16: "f16"}


def flat_arrays(tree: Any) -> list[tuple[str, mx.array]]:
    """`tree_flatten` of a tree of arrays -> (dotted path, array) pairs, typed once."""
    return cast("list[tuple[str, mx.array]]", tree_flatten(tree))


def load_arrays(path: str) -> dict[str, mx.array]:
    """`mx.load` of a .safetensors or .npz file: name -> array, typed once."""
    return cast("dict[str, mx.array]", mx.load(path))


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
    """Cast every float parameter to `dtype` except linear and embedding matrices (and their quantization
    scales / biases)."""
    modules = dict(model.named_modules())
    updates = []
    for path, a in flat_arrays(model.parameters()):
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


class BlockLinear(nn.Module):
    """A linear layer (or an embedding table, `embedding`) whose weight is GGML blocks as a GGUF file stores
    them ([N, row bytes] uint8; engine/cpu/blocks.h): held so until `apply_plan` gives it its serving form
    (the C kernel's, or float32 weights)."""

    def __init__(self, qtype: str, n: int, k: int, embedding: bool = False, bias: bool = False) -> None:
        super().__init__()
        _, per, size = BLOCK_FORMATS[qtype]
        self.weight = mx.zeros((n, k // per * size), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((n,))
        self.qtype, self.n, self.k, self.embedding = qtype, n, k, embedding

    def dequantized(self) -> mx.array:
        """The weight as float32 [N, K], as GGML (the gguf package) dequantizes it."""
        import gguf  # the GGUF reader's dependency, needed only here

        values = gguf.quants.dequantize(np.array(self.weight), gguf.GGMLQuantizationType[self.qtype])
        return mx.array(values.astype(np.float32, copy=False).reshape(self.n, self.k))

    def float_module(self) -> nn.Module:
        """The same layer with float32 weights."""
        if self.embedding:
            e = nn.Embedding(self.n, self.k)
            e.weight = self.dequantized()
            return e
        lin = nn.Linear(self.k, self.n, bias="bias" in self)
        lin.weight = self.dequantized()
        if "bias" in self:
            lin.bias = self["bias"]
        return lin


def use_block_modules(model: nn.Module, blocks: dict[str, str]) -> None:
    """Put a BlockLinear where `blocks` (module path -> GGML type) names a layer, before its weights load."""
    modules = dict(model.named_modules())
    updates = []
    for path, qtype in blocks.items():
        m = modules.get(path)
        if not isinstance(m, (nn.Linear, nn.Embedding)):
            raise ValueError(f"GGUF {qtype} tensor {path}.weight: no linear or embedding layer of that name")
        n, k = m.weight.shape
        updates.append((path, BlockLinear(qtype, n, k, isinstance(m, nn.Embedding), "bias" in m)))
    model.update_modules(tree_unflatten(updates))


def dequantize_blocks(model: nn.Module) -> bool:
    """Every BlockLinear as a float32 layer; -> whether there was one."""
    found = [(path, m.float_module()) for path, m in model.named_modules() if isinstance(m, BlockLinear)]
    if found:
        model.update_modules(tree_unflatten(found))
    return bool(found)


@dataclass(frozen=True, slots=True)
class WeightPlan:
    dtype: str  # the --dtype asked for
    quantization: str | None  # "q8" | "q4" | None


def apply_plan(model: nn.Module, plan: WeightPlan, compute_dtype: mx.Dtype,
               shard: Callable[[nn.Module], None] | None = None) -> None:
    """Bring a loaded model's weights to the plan and evaluate them. `shard` (tensor parallelism) splits the
    layers once their precision is settled, before the CPU modules are swapped in."""
    from mlx_lm.utils import dequantize_model  # mlx_lm loads transformers (~2 s): only when loading

    # GGML blocks are served as stored only by the CPU kernels, without re-quantization or sharding.
    served_as_blocks = plan.dtype == "auto" and not plan.quantization and shard is None and on_cpu()
    if not (served_as_blocks and qgemm_reason() is None) and dequantize_blocks(model):
        logger.info("GGML block weights dequantized to float32 (served as stored only by the CPU kernels "
                    "at --dtype auto, without --quantization or tensor parallelism)")
    quantized = is_quantized(model)
    if plan.dtype != "auto" or (plan.quantization and quantized):
        if plan.quantization and quantized:
            logger.warning("--quantization %s over a quantized checkpoint (%s): dequantized, then quantized "
                           "again (two roundings)", plan.quantization, precision_name(model))
        model.set_dtype(mx.float32)  # scales first: dequantized weights get no fp16 rounding
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
    # CPU: the matmul weights keep their precision, the rest computes in `compute_dtype`.
    cast_except_weights(model, compute_dtype)
    mx.eval(model.parameters())
    why = qgemm_reason()
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


class _KernelModule(nn.Module):
    """What CpuLinear and CpuEmbedding share: the weights the C kernels multiply (`_packed`) and, for GGML
    blocks, the float32 copy the float32 activation precision multiplies instead (made once, when first
    asked for)."""

    def _hold(self, packed: PackedWeights | BlockWeights) -> None:
        self._packed, self._stored = packed, packed
        self._floats: PackedWeights | None = None
        self.precision = _packed_name(packed)

    def _float_copy(self, b: BlockWeights) -> PackedWeights:
        if self._floats is None:
            self._floats = PackedWeights.floats(mx.array(rows_host(np.arange(b.n), b)))
        return self._floats

    def serve_blocks(self, on: bool) -> None:
        """GGML block weights: multiply them as stored (int8 activations) or as their float32 copy."""
        if isinstance(self._stored, BlockWeights):
            self._packed = self._stored if on else self._float_copy(self._stored)
            self.precision = _packed_name(self._packed)


class CpuLinear(_KernelModule):
    """A linear layer whose weight stays as stored, multiplied by engine/cpu/qgemm.c on the calling thread."""

    def __init__(self, packed: Any, bias: mx.array | None, params: dict[str, mx.array],
                 group: mx.distributed.Group | None = None) -> None:
        """`group`: a tensor-parallel slice of the input features, partial products summed before the bias."""
        super().__init__()
        for k, v in params.items():  # stored arrays stay parameters (memory accounting, state dicts)
            setattr(self, k, v)
        if bias is not None:
            self.bias = bias
        self._hold(packed)
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = qgemm(x, self._packed)
        if self._group is not None:
            y = mx.distributed.all_sum(y, group=self._group)
        return y + self["bias"] if "bias" in self else y


class CpuEmbedding(_KernelModule):
    """An embedding table in its stored precision, also the tied output layer through engine/cpu/qgemm.c."""

    def __init__(self, packed: Any, params: dict[str, mx.array], compute_dtype: mx.Dtype,
                 group_size: int = 0, bits: int = 0) -> None:
        super().__init__()
        for k, v in params.items():
            setattr(self, k, v)
        self._hold(packed)
        self._dtype = compute_dtype
        self._f32 = SimpleNamespace(table=None)  # not a parameter: float32_table()'s copy
        self.group_size, self.bits = group_size, bits

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self.rows(np.asarray(ids))
        return mx.array(rows).reshape(*ids.shape, self._packed.k).astype(self._dtype)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` as float32 on the host [len(ids), hidden], dequantized in C."""
        return rows_host(ids, self._packed)

    def as_linear(self, x: mx.array) -> mx.array:
        return qgemm(x, self._packed)

    def float32_table(self) -> mx.array:
        """The whole table in float32 for raw-row readers (the MTP assistant's C pass): the stored array, or a
        dequantized copy made once."""
        stored = self._stored
        if self._packed.fmt == "f32" and not isinstance(stored, BlockWeights):
            return self["weight"]
        if self._f32.table is None:
            if isinstance(stored, BlockWeights):
                table = self._float_copy(stored).arrays[0]
            elif self.bits:
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
    count = 0

    def swap(path: str, m: Any) -> Any:
        nonlocal count
        packed: PackedWeights | BlockWeights | None = None
        if isinstance(m, BlockLinear):
            packed, params = BlockWeights.of(m.qtype, m.weight, m.k), {"weight": m.weight}
            if not packed.supported():
                return swap(path, m.float_module())
            count += 1
            if m.embedding:
                return CpuEmbedding(packed, params, compute_dtype)
            return CpuLinear(packed, m.get("bias"), params)
        if isinstance(m, _QUANT):
            if getattr(m, "mode", "affine") != "affine" or m.bits not in (4, 8) or "biases" not in m:
                return m
            packed = PackedWeights.affine(m["weight"], m["scales"], m["biases"], m.group_size, m.bits)
            params = {k: m[k] for k in ("weight", "scales", "biases")}
        elif isinstance(m, (*_LINEAR, nn.Embedding)) and m.weight.dtype in (mx.bfloat16, mx.float16,
                                                                                mx.float32):
            # float32 too, so every matmul runs on the caller's thread: OpenMP from MLX's thread starts a
            # second libgomp pool (docs/design-notes.md).
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
    """Point the C-kernel products at 8-bit activations or keep float32: `int8` every 4-bit, 8-bit and GGML
    block product; `auto` the block products, and the 4-bit ones where the ISA favours it (8-bit weights
    keep float: their int8 kernel won nowhere measured, docs/cpu-backend.md); `float32` none (block weights
    then multiplied as float32 copies). -> whether any product takes int8; `int8` without 4-bit, 8-bit or
    block weights raises."""
    mods = [m for m in model.modules() if isinstance(m, (CpuLinear, CpuEmbedding))]
    for m in mods:
        m.serve_blocks(choice != "float32")
    packed = [m._packed for m in mods]
    wanted = {"q4"} if choice == "auto" and int8_by_default() else {"q4", "q8"} if choice == "int8" else set()
    int8 = [p for p in packed if isinstance(p, BlockWeights) or (p.fmt in wanted and p.int8_serves())]
    if choice == "int8" and not int8:
        raise ValueError("--activation-precision int8 needs 4-bit weights, 8-bit or GGML block weights "
                         "(Q5_0, Q4_K, ...) multiplied by the C kernels (this model has none: use auto or "
                         "float32)")
    chosen = {id(p) for p in int8}
    for p in packed:
        if isinstance(p, PackedWeights):
            p.int8 = id(p) in chosen
    return bool(chosen)


def int8_products(model: nn.Module) -> int:
    """Which products in MLX's affine layout set_activation_precision pointed at 8-bit activations, as the C
    layer stack's act_int8 takes them: 1 for the 4-bit ones, 2 for the 8-bit ones (GGML block products
    always take them)."""
    packed = [m._packed for m in model.modules() if isinstance(m, (CpuLinear, CpuEmbedding))]
    fmts = {p.fmt for p in packed if isinstance(p, PackedWeights) and p.int8}
    return int("q4" in fmts) | int("q8" in fmts) << 1
