// paged_attention_decode: body of an mx.fast.metal_kernel (MLX generates the signature).
//
// One SIMD group (32 threads) per (query row, head, KV partition). Launch:
//   grid        = (32 * num_partitions, num_heads, num_rows)
//   threadgroup = (32, 1, 1)
// Template constants: T (q/cache dtype), HEAD_DIM, BLOCK_SIZE, PARTITION_SIZE (keys per partition).
// The file has one body and two tails: `write: split` (per-partition partials for
// paged_attention_reduce) and `write: direct` (num_partitions == 1, the normalised output); the
// Python wrapper compiles body + one tail, since a kernel may only name the outputs it declares.
// Inputs:
//   q            [R, H, HEAD_DIM]            queries (one row per query token)
//   k_cache      [NB * BLOCK_SIZE, Hkv, HEAD_DIM]
//   v_cache      [NB * BLOCK_SIZE, Hkv, HEAD_DIM]
//   block_tables [S, max_blocks] int32       one row per sequence
//   q_seq        [R] int32                  block-table row of each query row
//   q_ctx        [R] int32                  keys visible to the row (its position + 1: causal)
//   params       [4] float32                scale, softcap (0: off), window (0: off), num_partitions
// Outputs (split):  part_acc [R, H, P, HEAD_DIM] f32, part_max [R, H, P] f32, part_sum [R, H, P] f32
// Outputs (direct): out [R, H, HEAD_DIM] T
//
// Lane l owns head-dim elements l, l + 32, l + 64, ... (strided, so a SIMD group reads a K/V row
// with consecutive addresses).

constexpr int LANES = 32;
constexpr int ELEMS = HEAD_DIM / LANES;

const uint lane = thread_position_in_grid.x % LANES;
const uint part = thread_position_in_grid.x / LANES;
const uint h = thread_position_in_grid.y;
const uint row = thread_position_in_grid.z;

const int num_heads = q_shape[1];
const int num_kv_heads = k_cache_shape[1];
const int max_blocks = block_tables_shape[1];
const int kvh = int(h) / (num_heads / num_kv_heads);

const float scale = params[0];
const float softcap = params[1];
const int window = int(params[2]);
const int num_parts = int(params[3]);

const int seq = q_seq[row];
const int ctx = q_ctx[row];
const int first = window > 0 ? max(0, ctx - window) : 0;
const int start = max(first, int(part) * PARTITION_SIZE);
const int end = min(ctx, int(part + 1) * PARTITION_SIZE);

float qv[ELEMS];
float acc[ELEMS];
const size_t q_base = (size_t(row) * num_heads + h) * HEAD_DIM;
for (int i = 0; i < ELEMS; ++i) {
  qv[i] = float(q[q_base + lane + LANES * i]) * scale;
  acc[i] = 0.0f;
}
float m = -INFINITY;
float l = 0.0f;

for (int pos = start; pos < end; ++pos) {
  const int block = block_tables[size_t(seq) * max_blocks + pos / BLOCK_SIZE];
  const size_t slot = size_t(block) * BLOCK_SIZE + pos % BLOCK_SIZE;
  const size_t kv_base = (slot * num_kv_heads + kvh) * HEAD_DIM;
  float partial = 0.0f;
  for (int i = 0; i < ELEMS; ++i) {
    partial += qv[i] * float(k_cache[kv_base + lane + LANES * i]);
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
    acc[i] = acc[i] * corr + p * float(v_cache[kv_base + lane + LANES * i]);
  }
  m = m_new;
}

// ---- write: split ----
const size_t p_index = (size_t(row) * num_heads + h) * num_parts + part;
for (int i = 0; i < ELEMS; ++i) {
  part_acc[p_index * HEAD_DIM + lane + LANES * i] = acc[i];
}
if (lane == 0) {
  part_max[p_index] = m;
  part_sum[p_index] = l;
}
// ---- write: direct ----
const float inv = l > 0.0f ? 1.0f / l : 0.0f;
for (int i = 0; i < ELEMS; ++i) {
  out[q_base + lane + LANES * i] = static_cast<T>(acc[i] * inv);
}
