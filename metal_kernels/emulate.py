"""NumPy emulation of the Metal kernels' index arithmetic, run where no Apple GPU exists: the shader's launch
grid (`ops.plan_decode`) and flat-buffer index formulas line for line, a SIMD group's 32 lanes as a vector
axis. Outputs start as NaN, so an element the grid never writes shows up in the comparison.
"""

from __future__ import annotations

import numpy as np

from metal_kernels.ops import LANES, DecodeLaunch, PrefillLaunch


def paged_attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                           block_tables: np.ndarray, q_seq: np.ndarray, q_ctx: np.ndarray,
                           launch: DecodeLaunch, scale: float, softcap: float = 0.0,
                           window: int = 0, partials: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
    """Same inputs as `ops.paged_attention_decode` (NumPy); returns out [R, H, D] float32, or with
    `partials` (split launches) the split tail's outputs (part_acc, part_max, part_sum), flat."""
    R, H, D = q.shape
    num_kv_heads = k_cache.shape[1]
    max_blocks = block_tables.shape[1]
    elems = D // LANES
    qf, kf, vf = q.reshape(-1).astype(np.float32), k_cache.reshape(-1), v_cache.reshape(-1)
    tables = block_tables.reshape(-1)
    P, PS, BS = launch.num_partitions, launch.partition_size, launch.block_size
    lane = np.arange(LANES)[:, None]
    offs = lane + LANES * np.arange(elems)[None, :]  # [32, ELEMS]: element i of lane l
    part_acc = np.full(R * H * P * D, np.nan, np.float32)
    part_max = np.full(R * H * P, np.nan, np.float32)
    part_sum = np.full(R * H * P, np.nan, np.float32)
    out = np.full(R * H * D, np.nan, np.float32)
    for row in range(launch.grid[2]):
        for h in range(launch.grid[1]):
            for part in range(launch.grid[0] // LANES):
                kvh = h // (H // num_kv_heads)
                seq, ctx = int(q_seq[row]), int(q_ctx[row])
                first = max(0, ctx - window) if window > 0 else 0
                start, end = max(first, part * PS), min(ctx, (part + 1) * PS)
                q_base = (row * H + h) * D
                qv = qf[q_base + offs] * np.float32(scale)
                acc = np.zeros((LANES, elems), np.float32)
                m, l_sum = np.float32(-np.inf), np.float32(0.0)
                for pos in range(start, end):
                    block = int(tables[seq * max_blocks + pos // BS])
                    slot = block * BS + pos % BS
                    kv_base = (slot * num_kv_heads + kvh) * D
                    partial = (qv * kf[kv_base + offs].astype(np.float32)).sum(axis=1)  # per lane
                    s = np.float32(partial.sum())  # simd_sum
                    if softcap > 0:
                        s = np.float32(softcap * np.tanh(s / softcap))
                    m_new = max(m, s)
                    corr, p = np.exp(m - m_new), np.exp(s - m_new)
                    l_sum = l_sum * corr + p
                    acc = acc * corr + p * vf[kv_base + offs].astype(np.float32)
                    m = m_new
                if launch.split:
                    p_index = (row * H + h) * P + part
                    part_acc[p_index * D + offs] = acc
                    part_max[p_index], part_sum[p_index] = m, l_sum
                else:
                    inv = 1.0 / l_sum if l_sum > 0 else 0.0
                    out[q_base + offs] = acc * inv
    if launch.split and partials:
        return part_acc, part_max, part_sum
    if launch.split:
        out = paged_attention_reduce(part_acc, part_max, part_sum, launch)
    return out.reshape(R, H, D)


def paged_attention_reduce(part_acc: np.ndarray, part_max: np.ndarray, part_sum: np.ndarray,
                           launch: DecodeLaunch) -> np.ndarray:
    R, H, P, D = launch.num_rows, launch.num_heads, launch.num_partitions, launch.head_dim
    out = np.full(R * H * D, np.nan, np.float32)
    for row in range(launch.reduce_grid[2]):
        for h in range(launch.reduce_grid[1]):
            d = np.arange(launch.reduce_grid[0])  # one thread per element: a vector here
            base = (row * H + h) * P
            gmax = max(part_max[base + p] for p in range(P))
            total, o = np.float32(0.0), np.zeros(D, np.float32)
            for p in range(P):
                w = np.exp(part_max[base + p] - gmax) if np.isfinite(part_max[base + p]) else 0.0
                total += part_sum[base + p] * w
                o += part_acc[(base + p) * D + d] * w
            out[(row * H + h) * D + d] = o / total if total > 0 else 0.0
    return out


def paged_attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            block_tables: np.ndarray, q_ctx: np.ndarray, launch: PrefillLaunch, scale: float,
                            softcap: float = 0.0, window: int = 0) -> np.ndarray:
    """Same inputs as `ops.paged_attention_prefill` (NumPy); returns out [S * L, H, D] float32.
    Threadgroup memory starts each tile as NaN, so a key the cooperative load misses poisons a row."""
    _, H, D = q.shape
    num_kv_heads = k_cache.shape[1]
    max_blocks = block_tables.shape[1]
    elems = D // LANES
    qf, kf, vf = q.reshape(-1).astype(np.float32), k_cache.reshape(-1), v_cache.reshape(-1)
    tables = block_tables.reshape(-1)
    BS, QT, KT, L = launch.block_size, launch.q_tile, launch.kv_tile, launch.q_len
    threads = LANES * QT
    lane = np.arange(LANES)[:, None]
    offs = lane + LANES * np.arange(elems)[None, :]  # [32, ELEMS]
    out = np.full(q.size, np.nan, np.float32)
    for tile in range(launch.grid[2] // launch.threadgroup[2]):
        for h in range(launch.grid[0] // launch.threadgroup[0]):
            kvh = h // (H // num_kv_heads)
            seq = tile // launch.tiles_per_seq
            first_local = (tile % launch.tiles_per_seq) * QT
            tile_first, tile_end = 1 << 30, 0
            for j in range(QT):
                if first_local + j >= L:
                    break
                c = int(q_ctx[seq * L + first_local + j])
                tile_end = max(tile_end, c)
                tile_first = min(tile_first, max(0, c - window) if window > 0 else 0)
            # Per SIMD group (qi): registers as in the shader.
            rows, ctxs, firsts, qvs, accs, ms, ls = [], [], [], [], [], [], []
            for qi in range(QT):
                local = first_local + qi
                valid = local < L
                row = seq * L + (local if valid else first_local)
                ctx = int(q_ctx[row])
                rows.append(row if valid else -1)
                ctxs.append(ctx)
                firsts.append(max(0, ctx - window) if window > 0 else 0)
                qvs.append(qf[(row * H + h) * D + offs] * np.float32(scale))
                accs.append(np.zeros((LANES, elems), np.float32))
                ms.append(np.float32(-np.inf))
                ls.append(np.float32(0.0))
            for t0 in range(tile_first, tile_end, KT):
                n = min(KT, tile_end - t0)
                k_tile = np.full(KT * D, np.nan, np.float32)
                v_tile = np.full(KT * D, np.nan, np.float32)
                for tid in range(threads):  # cooperative load: thread tid takes e = tid, tid + threads, ...
                    e = np.arange(tid, n * D, threads)
                    pos = t0 + e // D
                    block = tables[seq * max_blocks + pos // BS].astype(np.int64)
                    slot = block * BS + pos % BS
                    src = (slot * num_kv_heads + kvh) * D + e % D
                    k_tile[e], v_tile[e] = kf[src], vf[src]
                for qi in range(QT):
                    for j in range(n):
                        pos = t0 + j
                        if pos < firsts[qi] or pos >= ctxs[qi]:
                            continue
                        s = np.float32((qvs[qi] * k_tile[j * D + offs]).sum())  # simd_sum of lane partials
                        if softcap > 0:
                            s = np.float32(softcap * np.tanh(s / softcap))
                        m_new = max(ms[qi], s)
                        corr, p = np.exp(ms[qi] - m_new), np.exp(s - m_new)
                        ls[qi] = ls[qi] * corr + p
                        accs[qi] = accs[qi] * corr + p * v_tile[j * D + offs]
                        ms[qi] = m_new
            for qi in range(QT):
                if rows[qi] >= 0:
                    inv = 1.0 / ls[qi] if ls[qi] > 0 else 0.0
                    out[(rows[qi] * H + h) * D + offs] = accs[qi] * inv
    return out.reshape(q.shape)


def reshape_and_cache(key: np.ndarray, value: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                      slot_to_token: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Grid = one thread per cache element, as the shader."""
    kf, vf = key.reshape(-1), value.reshape(-1)
    kc, vc = key_cache.reshape(-1), value_cache.reshape(-1)
    k_out = np.full_like(kc, np.nan)
    v_out = np.full_like(vc, np.nan)
    row_elems = key_cache.shape[1] * key_cache.shape[2]
    e = np.arange(kc.size)
    slot, within = e // row_elems, e % row_elems
    token = slot_to_token[slot]
    new = token >= 0
    k_out[new] = kf[token[new] * row_elems + within[new]]
    v_out[new] = vf[token[new] * row_elems + within[new]]
    k_out[~new], v_out[~new] = kc[~new], vc[~new]
    return k_out.reshape(key_cache.shape), v_out.reshape(value_cache.shape)
