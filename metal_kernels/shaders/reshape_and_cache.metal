// reshape_and_cache: write this step's K/V rows into the paged cache by slot mapping.
//
// mx.fast.metal_kernel cannot write into an input buffer, so the kernel produces the updated cache
// as a new output: one thread per cache element copies the old value, unless the element's slot
// was written this step, in which case it takes the new row. `slot_to_token` ([num_slots] int32,
// -1 = untouched) is the inverse of slot_mapping, built with one scatter before the launch.
// Launch: grid = (num_slots * Hkv * HEAD_DIM, 1, 1), threadgroup = (256, 1, 1)
// Inputs:  key, value [T, Hkv, HEAD_DIM]; key_cache, value_cache [num_slots, Hkv, HEAD_DIM];
//          slot_to_token [num_slots] int32
// Outputs: key_cache_out, value_cache_out [num_slots, Hkv, HEAD_DIM]

const size_t e = thread_position_in_grid.x;
const size_t row_elems = size_t(key_cache_shape[1]) * HEAD_DIM;
const size_t slot = e / row_elems;
const size_t within = e % row_elems;
const int token = slot_to_token[slot];
if (token >= 0) {
  key_cache_out[e] = key[size_t(token) * row_elems + within];
  value_cache_out[e] = value[size_t(token) * row_elems + within];
} else {
  key_cache_out[e] = key_cache[e];
  value_cache_out[e] = value_cache[e];
}
