// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// torch.ops._gfx936_C: the registered ops of csrc_gfx936. Torch glue only; the
// kernels (sparse_mla_decode.cu) are torch-free. Written with the CUDA spelling
// of the stream/guard API; torch's cpp_extension hipifies it for ROCm builds, as
// vLLM's own csrc is.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <string>

#include "sparse_mla_decode.h"

namespace {

int kind_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return gfx936::kBF16;
    case at::kHalf: return gfx936::kF16;
    case at::kFloat: return gfx936::kF32;
    default:
      TORCH_CHECK(false, name, ": expected bf16/fp16/fp32, got dtype=", t.scalar_type());
  }
  return -1;
}

const int32_t* opt_i32(const std::optional<at::Tensor>& t, const char* name, const at::Tensor& q) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), name,
              ": expected contiguous int32, got dtype=", t->scalar_type(),
              " stride=", t->strides());
  TORCH_CHECK(t->device() == q.device(), name, ": on ", t->device(), ", q on ", q.device());
  return t->data_ptr<int32_t>();
}

gfx936::SparseMlaSource source(const at::Tensor& cache, const at::Tensor& idx,
                               const std::optional<at::Tensor>& indptr,
                               const std::optional<at::Tensor>& lens, const char* name,
                               const at::Tensor& q) {
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 3 && cache.size(2) == 584 &&
                  cache.stride(2) == 1 && cache.stride(1) == 584,
              name, " cache: expected uint8 [blocks, block_size, 584] with stride(1)=584, "
              "stride(2)=1, got dtype=", cache.scalar_type(), " shape=", cache.sizes(),
              " stride=", cache.strides());
  TORCH_CHECK(cache.device() == q.device(), name, " cache: on ", cache.device(),
              ", q on ", q.device());
  gfx936::SparseMlaSource s{};
  s.cache = cache.data_ptr<uint8_t>();
  s.stride0 = cache.stride(0);
  s.num_rows = cache.size(0) * cache.size(1);
  s.block_size = static_cast<int>(cache.size(1));
  s.idx = opt_i32(idx, name, q);
  s.indptr = opt_i32(indptr, name, q);
  s.lens = opt_i32(lens, name, q);
  if (s.indptr == nullptr) {
    TORCH_CHECK(idx.dim() == 2 && idx.size(0) == q.size(0), name,
                " indices: dense indices must be [num_queries, width], got shape=", idx.sizes());
    s.width = static_cast<int>(idx.size(1));
  } else {
    TORCH_CHECK(indptr->numel() == q.size(0) + 1, name, " indptr: expected [", q.size(0) + 1,
                "], got shape=", indptr->sizes());
  }
  return s;
}

void sparse_mla_decode(const at::Tensor& q, const at::Tensor& main_cache,
                       const at::Tensor& main_idx, const std::optional<at::Tensor>& main_indptr,
                       const std::optional<at::Tensor>& main_lens,
                       const std::optional<at::Tensor>& extra_cache,
                       const std::optional<at::Tensor>& extra_idx,
                       const std::optional<at::Tensor>& extra_indptr,
                       const std::optional<at::Tensor>& extra_lens,
                       const std::optional<at::Tensor>& sink, double scale, int64_t num_splits,
                       at::Tensor& out, const std::optional<at::Tensor>& part) {
  TORCH_CHECK(q.is_cuda(), "q: expected a GPU tensor, got device=", q.device());
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 512 && q.stride(2) == 1,
              "q: expected [num_queries, num_heads, 512] with stride(2)=1, got shape=",
              q.sizes(), " stride=", q.strides());
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.device() == q.device(),
              "output: expected shape=", q.sizes(), " stride(2)=1 on ", q.device(), ", got shape=",
              out.sizes(), " stride=", out.strides(), " on ", out.device());
  TORCH_CHECK(num_splits >= 1, "num_splits: expected >= 1, got ", num_splits);
  gfx936::SparseMlaParams p{};
  p.q = q.data_ptr(); p.q_kind = kind_of(q, "q"); p.q_s0 = q.stride(0); p.q_s1 = q.stride(1);
  p.out = out.data_ptr(); p.out_kind = kind_of(out, "output");
  p.o_s0 = out.stride(0); p.o_s1 = out.stride(1);
  p.main = source(main_cache, main_idx, main_indptr, main_lens, "swa", q);
  p.has_extra = extra_cache.has_value();
  if (p.has_extra) {
    TORCH_CHECK(extra_idx.has_value(), "topk indices: required with a compressed cache");
    p.extra = source(*extra_cache, *extra_idx, extra_indptr, extra_lens, "topk", q);
  }
  if (sink.has_value()) {
    TORCH_CHECK(sink->scalar_type() == at::kFloat && sink->is_contiguous() &&
                    sink->numel() >= q.size(1) && sink->device() == q.device(),
                "attn_sink: expected contiguous float32 [>= ", q.size(1), "] on ", q.device(),
                ", got dtype=", sink->scalar_type(), " shape=", sink->sizes());
    p.sink = sink->data_ptr<float>();
  }
  p.scale = static_cast<float>(scale);
  p.b = static_cast<int>(q.size(0));
  p.h = static_cast<int>(q.size(1));
  p.num_splits = static_cast<int>(num_splits);
  if (num_splits > 1) {
    TORCH_CHECK(part.has_value() && part->scalar_type() == at::kFloat && part->is_contiguous() &&
                    part->numel() >= q.size(0) * num_splits * q.size(1) * 516,
                "workspace: expected contiguous float32 with >= b*splits*h*516 = ",
                q.size(0) * num_splits * q.size(1) * 516, " elements");
    p.part = part->data_ptr<float>();
  }
  const at::cuda::OptionalCUDAGuard guard(q.device());
  const char* msg = nullptr;
  const int rc = gfx936::sparse_mla_decode_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.sparse_mla_decode: launch failed (", rc, "): ", msg);
}

}  // namespace

TORCH_LIBRARY(_gfx936_C, m) {
  m.def(
      "sparse_mla_decode(Tensor q, Tensor main_cache, Tensor main_idx, Tensor? main_indptr, "
      "Tensor? main_lens, Tensor? extra_cache, Tensor? extra_idx, Tensor? extra_indptr, "
      "Tensor? extra_lens, Tensor? sink, float scale, int num_splits, Tensor(a!) out, "
      "Tensor? workspace) -> ()");
}

TORCH_LIBRARY_IMPL(_gfx936_C, CUDA, m) { m.impl("sparse_mla_decode", &sparse_mla_decode); }
