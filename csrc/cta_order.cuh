// The order in which a launch's CTAs take the tiles of the logit kernels (forward and backward,
// both mainloops): the CTA order knob, MEGARL_CUDA_CTA_GROUP (docs/guides/gpu-kit.md).
//
// Each kernel covers a grid of [token blocks x column blocks]: a column block is a vocab split of
// several tiles in the forward, one vocab tile in the backward. The GPU starts CTAs in launch
// order (blockIdx.x fastest, then y, then z) as SMs free up, so the CTAs resident together are a
// window of consecutive CTAs, and what reaches DRAM is the hidden and weight rows of that window's
// tiles that L2 no longer holds. Numbering every column block of one token block before the next
// token block (group 1, the order these kernels had first) puts a whole weight split behind each
// token block, and the CTAs that share a weight tile start far apart in time. In groups of `group`
// token blocks, each group column block by column block with its token blocks fastest (Triton's
// grouped order, rows and columns as these kernels need them), a group's CTAs read each weight tile
// together while the group's hidden rows stay in L2.
//
// The order lives in the grid's shape, (group, column blocks, groups), so that a kernel reads its
// tile from blockIdx and gridDim alone: no register held across the mainloop (the sm80 forward
// kernel has none to spare).
#pragma once

#include "host_emulation.h"

namespace megarl {

// The grid of `cols` column blocks x `rows` token blocks in groups of `group` (>= 1) token blocks.
// Where `group` does not divide `rows`, the last group's CTAs past the last token block have no
// tile (grouped_row() >= rows) and return at once. CUDA bounds y and z by 65,535: column blocks
// (vocab tiles of 128 or 256 rows) and groups stay far below it for any vocabulary shard and
// micro-batch (8M rows, or 8M tokens in groups of one).
inline dim3 grouped_grid(int cols, int rows, int group) {
  const int size = group < rows ? group : rows;
  return dim3(size, cols, (rows + size - 1) / size);
}

// The CTA's token block under grouped_grid (>= rows: no tile) and its column block.
__device__ __forceinline__ int grouped_row() { return blockIdx.z * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int grouped_col() { return blockIdx.y; }

}  // namespace megarl
