// paged_attention_reduce: combines the per-partition partials of paged_attention_decode (SPLIT).
//
// One thread per (head-dim element, head, query row). Launch:
//   grid = (HEAD_DIM, num_heads, num_rows), threadgroup = (min(HEAD_DIM, 256), 1, 1)
// Inputs: part_acc [R, H, P, HEAD_DIM] f32, part_max [R, H, P] f32, part_sum [R, H, P] f32
// Output: out [R, H, HEAD_DIM] T
// Empty partitions carry max = -inf and sum = 0 and drop out (exp(-inf) == 0 in safe math mode).

const uint d = thread_position_in_grid.x;
const uint h = thread_position_in_grid.y;
const uint row = thread_position_in_grid.z;
const int num_heads = part_max_shape[1];
const int num_parts = part_max_shape[2];
const size_t base = (size_t(row) * num_heads + h) * num_parts;

float gmax = -INFINITY;
for (int p = 0; p < num_parts; ++p) {
  gmax = max(gmax, part_max[base + p]);
}
float total = 0.0f;
float o = 0.0f;
for (int p = 0; p < num_parts; ++p) {
  const float w = metal::exp(part_max[base + p] - gmax);
  total += part_sum[base + p] * w;
  o += part_acc[(base + p) * HEAD_DIM + d] * w;
}
out[(size_t(row) * num_heads + h) * HEAD_DIM + d] = static_cast<T>(total > 0.0f ? o / total : 0.0f);
