// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the vLLM project
//
// torch.ops._gfx936_C: the registered ops of csrc_gfx936. Torch glue only; the
// kernels (sparse_mla_decode.cu, w8a16_fp8.cu, moe_mxfp4.cu) are torch-free.
// Every check names the tensor at fault with its dtype/shape/stride. Written with the CUDA spelling
// of the stream/guard API; torch's cpp_extension hipifies it for ROCm builds, as
// vLLM's own csrc is.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <optional>
#include <string>

#include "moe_mxfp4.h"
#include "sparse_mla_decode.h"
#include "w8a16_fp8.h"

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
                       const std::optional<at::Tensor>& sink, double scale, at::Tensor& out) {
  TORCH_CHECK(q.is_cuda(), "q: expected a GPU tensor, got device=", q.device());
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 512 && q.stride(2) == 1,
              "q: expected [num_queries, num_heads, 512] with stride(2)=1, got shape=",
              q.sizes(), " stride=", q.strides());
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.device() == q.device(),
              "output: expected shape=", q.sizes(), " stride(2)=1 on ", q.device(), ", got shape=",
              out.sizes(), " stride=", out.strides(), " on ", out.device());
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
  // keys per query for the split plan, from shapes only (ragged: the buffer's average)
  const int64_t b = std::max<int64_t>(q.size(0), 1);
  const auto keys = [&](const gfx936::SparseMlaSource& s, const at::Tensor& idx) -> int64_t {
    return s.indptr == nullptr ? s.width : (idx.numel() + b - 1) / b;
  };
  p.avg_keys = static_cast<int>(keys(p.main, main_idx) +
                                (p.has_extra ? keys(p.extra, *extra_idx) : 0));
  const at::cuda::OptionalCUDAGuard guard(q.device());
  p.num_cus = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // split-K partials: from the caching allocator (stream-ordered, graph-capturable)
  const int64_t ws_floats = gfx936::sparse_mla_decode_workspace_floats(p);
  at::Tensor ws;
  if (ws_floats > 0) {
    ws = at::empty({ws_floats}, q.options().dtype(at::kFloat));
    p.part = ws.data_ptr<float>();
  }
  const char* msg = nullptr;
  const int rc = gfx936::sparse_mla_decode_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.sparse_mla_decode: launch failed (", rc, "): ", msg);
}

// ---- block-FP8 W8A16 dense -------------------------------------------------------------------
bool one_byte(const at::Tensor& t) { return t.element_size() == 1; }

void check_gpu(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, ": expected a tensor on ",
              like.device(), ", got device=", t.device());
}

gfx936::W8A16Params w8a16_params(const at::Tensor& weight, const at::Tensor& scale,
                                 int64_t block_n, int64_t block_k) {
  TORCH_CHECK(weight.is_cuda(), "weight: expected a GPU tensor, got device=", weight.device());
  TORCH_CHECK(one_byte(weight) && weight.dim() == 2 && weight.stride(1) == 1 &&
                  weight.stride(0) % 8 == 0 && weight.size(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 8 == 0,
              "weight: expected 8-byte aligned float8_e4m3fn/uint8 [N, K] with K % 8 == 0, "
              "stride(1)=1, stride(0) % 8 == 0, got dtype=", weight.scalar_type(), " shape=",
              weight.sizes(), " stride=", weight.strides());
  TORCH_CHECK(block_n > 0 && block_k >= 8 && (block_k & (block_k - 1)) == 0,
              "block_size: expected [bn, bk] with bk a power of two >= 8, got [", block_n, ", ",
              block_k, "]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t sn = (n + block_n - 1) / block_n, sk = (k + block_k - 1) / block_k;
  check_gpu(scale, "weight_scale", weight);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == sn && scale.size(1) == sk &&
                  scale.stride(1) == 1 && (one_byte(scale) || scale.scalar_type() == at::kFloat),
              "weight_scale: expected UE8M0 (1-byte) or float32 [", sn, ", ", sk,
              "] with stride(1)=1 for weight ", weight.sizes(), " and block [", block_n, ", ",
              block_k, "], got dtype=", scale.scalar_type(), " shape=", scale.sizes(),
              " stride=", scale.strides());
  gfx936::W8A16Params p{};
  p.w = static_cast<const uint8_t*>(weight.data_ptr());
  p.w_s0 = weight.stride(0);
  p.scale = scale.data_ptr();
  p.scale_kind = one_byte(scale) ? gfx936::kScaleUE8M0 : gfx936::kScaleF32;
  p.s_s0 = scale.stride(0);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.bn = static_cast<int>(block_n);
  p.bk = static_cast<int>(block_k);
  while ((1 << p.bk_shift) < p.bk) ++p.bk_shift;
  p.groups = 1;
  return p;
}

void w8a16_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                int64_t block_n, int64_t block_k, int64_t groups, at::Tensor& out) {
  gfx936::W8A16Params p = w8a16_params(weight, scale, block_n, block_k);
  check_gpu(x, "x", weight);
  TORCH_CHECK(groups >= 1 && weight.size(0) % groups == 0,
              "groups: expected a divisor of N=", weight.size(0), ", got ", groups);
  const int64_t xs = x.element_size();
  TORCH_CHECK(x.dim() == 2 && x.size(1) == groups * weight.size(1) && x.stride(1) == 1 &&
                  (x.stride(0) * xs) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "x: expected 16-byte aligned rows of [M, ", groups * weight.size(1),
              "] (groups * K) with stride(1)=1, got dtype=", x.scalar_type(), " shape=",
              x.sizes(), " stride=", x.strides());
  check_gpu(out, "out", weight);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight.size(0) &&
                  out.stride(1) == 1,
              "out: expected [", x.size(0), ", ", weight.size(0), "] with stride(1)=1, got shape=",
              out.sizes(), " stride=", out.strides());
  p.x = x.data_ptr();
  p.x_kind = kind_of(x, "x");
  p.x_s0 = x.stride(0);
  p.out = out.data_ptr();
  p.out_kind = kind_of(out, "out");
  p.o_s0 = out.stride(0);
  p.m = static_cast<int>(x.size(0));
  p.groups = static_cast<int>(groups);
  TORCH_CHECK(groups == 1 || (weight.size(0) / groups) % 8 == 0,
              "weight: grouped GEMV (groups=", groups, ") needs N / groups to be a multiple of "
              "8, got N=", weight.size(0));
  const at::cuda::OptionalCUDAGuard guard(x.device());
  p.num_cus = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // split-K partials: from the caching allocator (stream-ordered, graph-capturable)
  const int64_t ws_floats = gfx936::w8a16_gemv_workspace_floats(p);
  at::Tensor ws;
  if (ws_floats > 0) {
    ws = at::empty({ws_floats}, x.options().dtype(at::kFloat));
    p.ws = ws.data_ptr<float>();
  }
  const char* msg = nullptr;
  const int rc = gfx936::w8a16_gemv_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.w8a16_gemv: launch failed (", rc, "): ", msg);
}

void fp8_block_dequant(const at::Tensor& weight, const at::Tensor& scale, int64_t block_n,
                       int64_t block_k, at::Tensor& out) {
  gfx936::W8A16Params p = w8a16_params(weight, scale, block_n, block_k);
  check_gpu(out, "out", weight);
  TORCH_CHECK(out.dim() == 2 && out.sizes() == weight.sizes() && out.stride(1) == 1 &&
                  out.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "out: expected 16-byte aligned ", weight.sizes(), " with stride(1)=1 and "
              "stride(0) % 8 == 0, got shape=", out.sizes(), " stride=", out.strides());
  p.out = out.data_ptr();
  p.out_kind = kind_of(out, "out");
  p.o_s0 = out.stride(0);
  const at::cuda::OptionalCUDAGuard guard(weight.device());
  const char* msg = nullptr;
  const int rc = gfx936::fp8_block_dequant_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.fp8_block_dequant: launch failed (", rc, "): ", msg);
}

// ---- MXFP4 MoE ----------------------------------------------------------------------------------
void check_i32(const at::Tensor& t, const char* name, int64_t numel, const at::Tensor& like) {
  check_gpu(t, name, like);
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.numel() == numel, name,
              ": expected contiguous int32 with ", numel, " elements, got dtype=",
              t.scalar_type(), " shape=", t.sizes(), " stride=", t.strides());
}

// topk_ids [M, topk] (int32/int64, contiguous) and the optional global -> local expert_map into
// the routing fields the kernels read (moe_route's MoeRoute, the direct path's params)
template <typename P>
void set_routing(P& p, const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map) {
  TORCH_CHECK(topk_ids.is_cuda(), "topk_ids: expected a GPU tensor, got device=",
              topk_ids.device());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.is_contiguous() &&
                  (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "topk_ids: expected contiguous int32/int64 [M, topk], got dtype=",
              topk_ids.scalar_type(), " shape=", topk_ids.sizes(), " stride=", topk_ids.strides());
  p.topk_ids = topk_ids.data_ptr();
  p.ids_is_64 = topk_ids.scalar_type() == at::kLong;
  if (expert_map.has_value()) {
    check_i32(*expert_map, "expert_map", expert_map->numel(), topk_ids);
    p.expert_map = expert_map->data_ptr<int32_t>();
    p.map_len = static_cast<int>(expert_map->numel());
  }
}

void moe_route(const at::Tensor& topk_ids, const std::optional<at::Tensor>& expert_map,
               int64_t num_experts, at::Tensor& pair_expert, at::Tensor& sorted_pairs,
               at::Tensor& expert_start, at::Tensor& active) {
  gfx936::MoeRoute r{};
  set_routing(r, topk_ids, expert_map);
  // moe_route keeps two int32 counters per expert in LDS beside 8 KB of scan
  // arrays: 4096 experts use 40 KB, inside gfx936's 64 KB and CUDA's static 48 KB
  TORCH_CHECK(num_experts >= 1 && num_experts <= 4096,
              "num_experts: moe_route supports 1..4096 local experts (LDS), got ", num_experts);
  const int64_t pairs = topk_ids.numel();
  check_i32(pair_expert, "pair_expert", pairs, topk_ids);
  check_i32(sorted_pairs, "sorted_pairs", pairs, topk_ids);
  check_i32(expert_start, "expert_start", num_experts + 1, topk_ids);
  check_i32(active, "active", std::min<int64_t>(pairs, num_experts), topk_ids);
  r.pair_expert = pair_expert.data_ptr<int32_t>();
  r.sorted_pairs = sorted_pairs.data_ptr<int32_t>();
  r.expert_start = expert_start.data_ptr<int32_t>();
  r.active = active.data_ptr<int32_t>();
  r.m = static_cast<int>(topk_ids.size(0));
  r.topk = static_cast<int>(topk_ids.size(1));
  r.num_experts = static_cast<int>(num_experts);
  const at::cuda::OptionalCUDAGuard guard(topk_ids.device());
  const char* msg = nullptr;
  const int rc = gfx936::moe_route_launch(
      r, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.moe_route: launch failed (", rc, "): ", msg);
}

void check_packed(const at::Tensor& w, const at::Tensor& s, const char* wn, const char* sn,
                  int64_t e, int64_t rows, int64_t cols, const at::Tensor& like) {
  check_gpu(w, wn, like);
  check_gpu(s, sn, like);
  TORCH_CHECK(one_byte(w) && w.dim() == 3 && w.size(0) == e && w.size(1) == rows &&
                  w.size(2) == cols / 2 && w.stride(2) == 1 && w.stride(1) % 8 == 0 &&
                  w.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              wn, ": expected 16-byte aligned packed MXFP4 uint8 [", e, ", ", rows, ", ",
              cols / 2, "] with stride(2)=1 and 8-byte aligned rows, got dtype=", w.scalar_type(),
              " shape=", w.sizes(), " stride=", w.strides());
  TORCH_CHECK(one_byte(s) && s.dim() == 3 && s.size(0) == e && s.size(1) == rows &&
                  s.size(2) == cols / 32 && s.stride(2) == 1,
              sn, ": expected UE8M0 (1-byte) [", e, ", ", rows, ", ", cols / 32,
              "] with stride(2)=1, got dtype=", s.scalar_type(), " shape=", s.sizes(),
              " stride=", s.strides());
}

// the checks and fields both MoE GEMV paths share (x, weights, topk_weights, act, out)
gfx936::MoeMxfp4Params moe_params(const at::Tensor& x, const at::Tensor& w13,
                                  const at::Tensor& s13, const at::Tensor& w2,
                                  const at::Tensor& s2, const at::Tensor& topk_weights,
                                  double alpha, double limit, bool weight_on_input,
                                  const at::Tensor& act, const at::Tensor& out) {
  TORCH_CHECK(x.is_cuda(), "hidden_states: expected a GPU tensor, got device=", x.device());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.stride(0) * x.element_size()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "hidden_states: expected 16-byte aligned rows [M, H] with stride(1)=1, got dtype=",
              x.scalar_type(), " shape=", x.sizes(), " stride=", x.strides());
  const int64_t m = x.size(0), h = x.size(1), e = w13.size(0);
  TORCH_CHECK(w13.dim() == 3 && w13.size(1) % 2 == 0, "w13: expected [E, 2I, H/2], got shape=",
              w13.sizes());
  const int64_t inter = w13.size(1) / 2;
  TORCH_CHECK(h % 32 == 0 && inter % 32 == 0,
              "MXFP4 MoE: hidden and intermediate sizes must be multiples of 32, got H=", h,
              " I=", inter);
  check_packed(w13, s13, "w13", "w13_scale", e, 2 * inter, h, x);
  check_packed(w2, s2, "w2", "w2_scale", e, h, inter, x);
  check_gpu(topk_weights, "topk_weights", x);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.dim() == 2 && topk_weights.size(0) == m,
              "topk_weights: expected contiguous float32 [", m, ", topk], got dtype=",
              topk_weights.scalar_type(), " shape=", topk_weights.sizes());
  const int64_t pairs = topk_weights.numel();
  check_gpu(act, "act workspace", x);
  TORCH_CHECK(act.scalar_type() == at::kFloat && act.is_contiguous() &&
                  act.numel() >= pairs * inter,
              "act workspace: expected contiguous float32 with >= ", pairs * inter, " elements");
  check_gpu(out, "output", x);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == h && out.stride(1) == 1,
              "output: expected [", m, ", ", h, "] with stride(1)=1, got shape=", out.sizes(),
              " stride=", out.strides());
  gfx936::MoeMxfp4Params p{};
  p.x = x.data_ptr(); p.x_kind = kind_of(x, "hidden_states"); p.x_s0 = x.stride(0);
  p.w13 = static_cast<const uint8_t*>(w13.data_ptr());
  p.s13 = static_cast<const uint8_t*>(s13.data_ptr());
  p.w2 = static_cast<const uint8_t*>(w2.data_ptr());
  p.s2 = static_cast<const uint8_t*>(s2.data_ptr());
  p.w13_s0 = w13.stride(0); p.w13_s1 = w13.stride(1);
  p.s13_s0 = s13.stride(0); p.s13_s1 = s13.stride(1);
  p.w2_s0 = w2.stride(0); p.w2_s1 = w2.stride(1);
  p.s2_s0 = s2.stride(0); p.s2_s1 = s2.stride(1);
  p.topk_weights = topk_weights.data_ptr<float>();
  p.act = act.data_ptr<float>();
  p.out = out.data_ptr(); p.out_kind = kind_of(out, "output"); p.o_s0 = out.stride(0);
  p.m = static_cast<int>(m);
  p.topk = static_cast<int>(topk_weights.size(1));
  p.hidden = static_cast<int>(h);
  p.inter = static_cast<int>(inter);
  p.num_slots = static_cast<int>(std::min<int64_t>(pairs, e));
  p.num_experts = static_cast<int>(e);
  p.alpha = static_cast<float>(alpha);
  p.limit = static_cast<float>(limit);
  p.weight_on_input = weight_on_input ? 1 : 0;
  return p;
}

void moe_mxfp4_gemv(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& s13,
                    const at::Tensor& w2, const at::Tensor& s2, const at::Tensor& topk_weights,
                    const at::Tensor& pair_expert, const at::Tensor& sorted_pairs,
                    const at::Tensor& expert_start, const at::Tensor& active, double alpha,
                    double limit, bool weight_on_input, at::Tensor& act, at::Tensor& y,
                    at::Tensor& out) {
  gfx936::MoeMxfp4Params p =
      moe_params(x, w13, s13, w2, s2, topk_weights, alpha, limit, weight_on_input, act, out);
  const int64_t pairs = topk_weights.numel(), e = w13.size(0);
  check_i32(pair_expert, "pair_expert", pairs, x);
  check_i32(sorted_pairs, "sorted_pairs", pairs, x);
  check_i32(expert_start, "expert_start", e + 1, x);
  check_i32(active, "active", std::min<int64_t>(pairs, e), x);
  check_gpu(y, "y workspace", x);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() &&
                  y.numel() >= pairs * x.size(1),
              "y workspace: expected contiguous float32 with >= ", pairs * x.size(1),
              " elements");
  p.pair_expert = pair_expert.data_ptr<int32_t>();
  p.sorted_pairs = sorted_pairs.data_ptr<int32_t>();
  p.expert_start = expert_start.data_ptr<int32_t>();
  p.active = active.data_ptr<int32_t>();
  p.y = y.data_ptr<float>();
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const char* msg = nullptr;
  const int rc = gfx936::moe_mxfp4_gemv_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.moe_mxfp4_gemv: launch failed (", rc, "): ", msg);
}

// few tokens: the routing read from topk_ids inside the two kernels (moe_mxfp4.cu's direct
// path) for the shapes moe_direct_supported takes (the caller's rule mirrors it)
void moe_mxfp4_gemv_direct(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& s13,
                           const at::Tensor& w2, const at::Tensor& s2,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                           const std::optional<at::Tensor>& expert_map, double alpha,
                           double limit, bool weight_on_input, at::Tensor& act,
                           at::Tensor& out) {
  gfx936::MoeMxfp4Params p =
      moe_params(x, w13, s13, w2, s2, topk_weights, alpha, limit, weight_on_input, act, out);
  if (p.m == 0) return;
  check_gpu(topk_ids, "topk_ids", x);
  set_routing(p, topk_ids, expert_map);
  TORCH_CHECK(topk_ids.sizes() == topk_weights.sizes(), "topk_ids: expected the shape of "
              "topk_weights ", topk_weights.sizes(), ", got ", topk_ids.sizes());
  TORCH_CHECK(gfx936::moe_direct_supported(p.m, p.topk, p.hidden, p.inter),
              "_gfx936_C.moe_mxfp4_gemv_direct: M=", p.m, " topk=", p.topk, " H=", p.hidden,
              " I=", p.inter, " is outside the direct path (moe_direct_supported, moe_mxfp4.cu: "
              "1 <= M <= 64, 1 <= topk <= 8, H a multiple of 32 up to 4096, I a multiple of 32 "
              "up to 512 in one down step); take moe_route + moe_mxfp4_gemv");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  p.num_cus = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const char* msg = nullptr;
  const int rc = gfx936::moe_mxfp4_direct_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.moe_mxfp4_gemv_direct: launch failed (", rc, "): ", msg);
}

void moe_reduce(const at::Tensor& y, const at::Tensor& pair_expert, int64_t topk,
                at::Tensor& out) {
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.stride(1) == 1 && out.size(1) % 4 == 0,
              "output: expected a GPU [M, H] tensor with stride(1)=1 and H % 4 == 0, got shape=",
              out.sizes(), " stride=", out.strides(), " on ", out.device());
  const int64_t m = out.size(0), h = out.size(1);
  check_i32(pair_expert, "pair_expert", m * topk, out);
  check_gpu(y, "y", out);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.numel() >= m * topk * h,
              "y: expected contiguous float32 [M * topk, H] = [", m * topk, ", ", h,
              "], got dtype=", y.scalar_type(), " shape=", y.sizes());
  gfx936::MoeMxfp4Params p{};
  p.y = y.data_ptr<float>();
  p.pair_expert = pair_expert.data_ptr<int32_t>();
  p.out = out.data_ptr(); p.out_kind = kind_of(out, "output"); p.o_s0 = out.stride(0);
  p.m = static_cast<int>(m);
  p.topk = static_cast<int>(topk);
  p.hidden = static_cast<int>(h);
  const at::cuda::OptionalCUDAGuard guard(out.device());
  const char* msg = nullptr;
  const int rc = gfx936::moe_reduce_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.moe_reduce: launch failed (", rc, "): ", msg);
}

void mxfp4_dequant_experts(const at::Tensor& w, const at::Tensor& s, const at::Tensor& active,
                           int64_t slot0, at::Tensor& out) {
  TORCH_CHECK(w.is_cuda() && w.dim() == 3, "w: expected a GPU [E, N, K/2] tensor, got shape=",
              w.sizes(), " on ", w.device());
  const int64_t e = w.size(0), n = w.size(1), k = 2 * w.size(2);
  TORCH_CHECK(k % 32 == 0, "w: K = 2 * size(2) must be a multiple of 32, got K=", k);
  check_packed(w, s, "w", "w_scale", e, n, k, w);
  TORCH_CHECK(w.stride(0) % 16 == 0 && w.stride(1) % 16 == 0,
              "w: the dequant reads 16-byte scale groups: expected stride(0) and stride(1) "
              "multiples of 16, got stride=", w.strides());
  check_gpu(active, "active", w);
  TORCH_CHECK(active.scalar_type() == at::kInt && active.is_contiguous(),
              "active: expected contiguous int32, got dtype=", active.scalar_type());
  TORCH_CHECK(out.dim() == 3 && out.size(1) == n && out.size(2) == k && out.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 &&
                  slot0 >= 0 && slot0 + out.size(0) <= active.numel(),
              "out: expected contiguous [slots, ", n, ", ", k, "] with slot0 + slots <= ",
              active.numel(), ", got shape=", out.sizes(), " slot0=", slot0);
  check_gpu(out, "out", w);
  gfx936::Mxfp4DequantParams p{};
  p.w = static_cast<const uint8_t*>(w.data_ptr());
  p.s = static_cast<const uint8_t*>(s.data_ptr());
  p.w_s0 = w.stride(0); p.w_s1 = w.stride(1); p.s_s0 = s.stride(0); p.s_s1 = s.stride(1);
  p.active = active.data_ptr<int32_t>();
  p.slot0 = static_cast<int>(slot0);
  p.slots = static_cast<int>(out.size(0));
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.out = out.data_ptr(); p.out_kind = kind_of(out, "out");
  const at::cuda::OptionalCUDAGuard guard(w.device());
  const char* msg = nullptr;
  const int rc = gfx936::mxfp4_dequant_experts_launch(
      p, static_cast<void*>(at::cuda::getCurrentCUDAStream().stream()), &msg);
  TORCH_CHECK(rc == 0, "_gfx936_C.mxfp4_dequant_experts: launch failed (", rc, "): ", msg);
}

}  // namespace

TORCH_LIBRARY(_gfx936_C, m) {
  m.def(
      "sparse_mla_decode(Tensor q, Tensor main_cache, Tensor main_idx, Tensor? main_indptr, "
      "Tensor? main_lens, Tensor? extra_cache, Tensor? extra_idx, Tensor? extra_indptr, "
      "Tensor? extra_lens, Tensor? sink, float scale, Tensor(a!) out) -> ()");
  m.def(
      "w8a16_gemv(Tensor x, Tensor weight, Tensor weight_scale, int block_n, int block_k, "
      "int groups, Tensor(a!) out) -> ()");
  m.def(
      "fp8_block_dequant(Tensor weight, Tensor weight_scale, int block_n, int block_k, "
      "Tensor(a!) out) -> ()");
  m.def(
      "moe_route(Tensor topk_ids, Tensor? expert_map, int num_experts, Tensor(a!) pair_expert, "
      "Tensor(b!) sorted_pairs, Tensor(c!) expert_start, Tensor(d!) active) -> ()");
  m.def(
      "moe_mxfp4_gemv(Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, "
      "Tensor topk_weights, Tensor pair_expert, Tensor sorted_pairs, Tensor expert_start, "
      "Tensor active, float alpha, float limit, bool weight_on_input, Tensor(a!) act, "
      "Tensor(b!) y, Tensor(c!) out) -> ()");
  m.def(
      "moe_mxfp4_gemv_direct(Tensor x, Tensor w13, Tensor w13_scale, Tensor w2, "
      "Tensor w2_scale, Tensor topk_weights, Tensor topk_ids, Tensor? expert_map, float alpha, "
      "float limit, bool weight_on_input, Tensor(a!) act, Tensor(b!) out) -> ()");
  m.def("moe_reduce(Tensor y, Tensor pair_expert, int topk, Tensor(a!) out) -> ()");
  m.def(
      "mxfp4_dequant_experts(Tensor w, Tensor w_scale, Tensor active, int slot0, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(_gfx936_C, CUDA, m) {
  m.impl("sparse_mla_decode", &sparse_mla_decode);
  m.impl("w8a16_gemv", &w8a16_gemv);
  m.impl("fp8_block_dequant", &fp8_block_dequant);
  m.impl("moe_route", &moe_route);
  m.impl("moe_mxfp4_gemv", &moe_mxfp4_gemv);
  m.impl("moe_mxfp4_gemv_direct", &moe_mxfp4_gemv_direct);
  m.impl("moe_reduce", &moe_reduce);
  m.impl("mxfp4_dequant_experts", &mxfp4_dequant_experts);
}
