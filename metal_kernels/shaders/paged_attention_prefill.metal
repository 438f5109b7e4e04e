// paged_attention_prefill: body of an mx.fast.metal_kernel (MLX generates the signature).
//
// Tiled over queries: one threadgroup per (head, Q_TILE consecutive query rows of one sequence),
// one SIMD group (32 lanes) per query row. The threadgroup loads KV_TILE keys/values of its
// sequence into threadgroup memory once, through the block table, and all Q_TILE rows read them
// from there (a prefill chunk's rows share almost all their keys). Launch:
//   grid        = (32 * num_heads, Q_TILE, num_seqs * tiles_per_seq)
//   threadgroup = (32, Q_TILE, 1)
// Template constants: T, HEAD_DIM, BLOCK_SIZE, Q_TILE, KV_TILE (KV_TILE * HEAD_DIM * 8 bytes of
// threadgroup memory).
// Inputs:
//   q            [S * q_len, H, HEAD_DIM]   rows of sequence s are s * q_len ... s * q_len + q_len - 1
//   k_cache      [NB * BLOCK_SIZE, Hkv, HEAD_DIM]
//   v_cache      [NB * BLOCK_SIZE, Hkv, HEAD_DIM]
//   block_tables [S, max_blocks] int32
//   q_ctx        [S * q_len] int32           keys visible to the row (its position + 1: causal)
//   params       [5] float32                 scale, softcap (0: off), window (0: off), q_len, tiles_per_seq
// Output: out [S * q_len, H, HEAD_DIM] T
// Every thread reaches every barrier: rows past q_len (the last tile's tail) load and compute
// like the others and only skip the final write.

constexpr int LANES = 32;
constexpr int ELEMS = HEAD_DIM / LANES;
constexpr int TILE_ELEMS = KV_TILE * HEAD_DIM;
constexpr int THREADS = LANES * Q_TILE;
threadgroup float k_tile[TILE_ELEMS];
threadgroup float v_tile[TILE_ELEMS];

const int lane = int(thread_position_in_threadgroup.x);
const int qi = int(thread_position_in_threadgroup.y);
const int tid = qi * LANES + lane;
const int h = int(threadgroup_position_in_grid.x);
const int tile = int(threadgroup_position_in_grid.z);

const int num_heads = q_shape[1];
const int num_kv_heads = k_cache_shape[1];
const int max_blocks = block_tables_shape[1];
const int kvh = h / (num_heads / num_kv_heads);

const float scale = params[0];
const float softcap = params[1];
const int window = int(params[2]);
const int q_len = int(params[3]);
const int tiles_per_seq = int(params[4]);

const int seq = tile / tiles_per_seq;
const int first_local = (tile % tiles_per_seq) * Q_TILE;
const int local = first_local + qi;
const bool valid = local < q_len;
const int row = seq * q_len + (valid ? local : first_local);
const int ctx = q_ctx[row];
const int first = window > 0 ? max(0, ctx - window) : 0;

// The tile's key range: the union of its rows' ranges (the same for every thread).
int tile_first = 1 << 30;
int tile_end = 0;
for (int j = 0; j < Q_TILE && first_local + j < q_len; ++j) {
  const int c = q_ctx[seq * q_len + first_local + j];
  tile_end = max(tile_end, c);
  tile_first = min(tile_first, window > 0 ? max(0, c - window) : 0);
}

float qv[ELEMS];
float acc[ELEMS];
const size_t q_base = (size_t(row) * num_heads + h) * HEAD_DIM;
for (int i = 0; i < ELEMS; ++i) {
  qv[i] = float(q[q_base + lane + LANES * i]) * scale;
  acc[i] = 0.0f;
}
float m = -INFINITY;
float l = 0.0f;

for (int t0 = tile_first; t0 < tile_end; t0 += KV_TILE) {
  const int n = min(KV_TILE, tile_end - t0);
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile has been read
  for (int e = tid; e < n * HEAD_DIM; e += THREADS) {
    const int pos = t0 + e / HEAD_DIM;
    const int block = block_tables[size_t(seq) * max_blocks + pos / BLOCK_SIZE];
    const size_t slot = size_t(block) * BLOCK_SIZE + pos % BLOCK_SIZE;
    const size_t src = (slot * num_kv_heads + kvh) * HEAD_DIM + e % HEAD_DIM;
    k_tile[e] = float(k_cache[src]);
    v_tile[e] = float(v_cache[src]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int j = 0; j < n; ++j) {
    const int pos = t0 + j;
    if (pos < first || pos >= ctx) {
      continue;  // uniform across the SIMD group (one row), so simd_sum below stays convergent
    }
    float partial = 0.0f;
    for (int i = 0; i < ELEMS; ++i) {
      partial += qv[i] * k_tile[j * HEAD_DIM + lane + LANES * i];
    }
    float s = simd_sum(partial);
    if (softcap > 0.0f) {
      s = softcap * metal::precise::tanh(s / softcap);
    }
    const float m_new = max(m, s);
    const float corr = metal::exp(m - m_new);
    const float p = metal::exp(s - m_new);
    l = l * corr + p;
    for (int i = 0; i < ELEMS; ++i) {
      acc[i] = acc[i] * corr + p * v_tile[j * HEAD_DIM + lane + LANES * i];
    }
    m = m_new;
  }
}

if (valid) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int i = 0; i < ELEMS; ++i) {
    out[q_base + lane + LANES * i] = static_cast<T>(acc[i] * inv);
  }
}
