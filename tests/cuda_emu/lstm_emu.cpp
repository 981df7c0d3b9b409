// Runs ctxfast's persistent LSTM kernels (csrc/cuda/lstm_kernels.cuh) on the CPU under
// cuda_emu.h, with the launch shapes the CUDA build computes (persistent_shape) for a
// pretend device of `sms` SMs. Driven by tests/test_lstm_cuda_emu.py:
//   lstm_emu IN OUT
// IN (little-endian): 12 int32 (kernel 0 = CUDA cores / 1 = tensor cores / 2 = tensor cores
// with the grouped backward (lstm_bwd_mma_grouped_kernel), dtype 0 = float32
// / 1 = float16 / 2 = bfloat16, T, B, H, P, reverse, has_mask, sms, has_w_hr, backward,
// smem_limit in bytes), 8 float32 (scale_eff, cell_clip, cell_clip_s, cell_clip_below,
// proj_clip, proj_clip_s, proj_clip_below, tf32_one: nonzero = LstmDims::tf32_one), then
// float32 arrays: xw [T,B,4H],
// h0 [B,P], c0 [B,H], w_hh [4H,P], mask [4H,P] (has_mask), w_hr [P,H] (has_w_hr),
// grad_out [T,B,P], grad_cells [T,B,H].
// OUT: 4 int32 (ok, blocks, threads, units), then float32 arrays: out, cells, gates (as
// stored, widened), c_T [B,H]; with backward: dz [T,B,4H], grad_h0 [B,P], grad_c0 [B,H]
// and, with w_hr, hp [T,B,H] and dh_in [T,B,P] (the workspaces dL/dw_hr is formed from).
// If the plan refuses the sizes: ok = 0 and the reason on stderr, exit status 3.
// LSTM_EMU_RING=4|8: LstmDims::ring (default 8).
// With LSTM_EMU_CLOCK=<file> (tensor-core kernels only), each kernel run also writes its
// phase clock (LstmDims::phase_clock) to that file: 3 int32 (LstmClockKind, blocks, rows),
// then blocks x rows x kLstmClockCols int64.
// backward = -1: the launch shapes only (no arrays read or run): OUT holds, for the forward
// then the backward, 8 int32 (ok, blocks, threads, units, shared memory bytes, ksplit,
// groups, chunks).
#define CTXFAST_CUDA_EMULATION 1
#include "cuda/lstm_kernels.cuh"

#include <cstdio>
#include <limits>
#include <string>
#include <vector>

using namespace ctxfast::cuda;

namespace {

// Device buffers: 256-byte aligned, as cudaMalloc's (and torch's CUDA allocator's) are; the
// kernels' 32-byte WMMA alignment of global tiles rests on it.
template <typename T>
struct DeviceAlloc {
  using value_type = T;
  DeviceAlloc() = default;
  template <typename U>
  DeviceAlloc(const DeviceAlloc<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(std::max<size_t>(n, 1) * sizeof(T), std::align_val_t(256)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(256)); }
  bool operator==(const DeviceAlloc&) const { return true; }
  bool operator!=(const DeviceAlloc&) const { return false; }
};
template <typename T>
using dvec = std::vector<T, DeviceAlloc<T>>;

struct Reader {
  FILE* f;
  template <typename X>
  X one() {
    X x;
    if (std::fread(&x, sizeof(X), 1, f) != 1) emu::fail("short input");
    return x;
  }
  dvec<float> floats(size_t n) {
    dvec<float> v(n);
    if (n && std::fread(v.data(), 4, n, f) != n) emu::fail("short input");
    return v;
  }
};

template <typename T>
T from_float(float x) { return static_cast<T>(x); }
template <> __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
float to_float(float x) { return x; }
float to_float(__half x) { return __half2float(x); }
float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
dvec<T> conv(const dvec<float>& v) {
  dvec<T> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = from_float<T>(v[i]);
  return r;
}

// Never-written memory reads as NaN (as cudaMalloc'd memory holds whatever it held).
template <typename T>
dvec<T> poisoned(size_t n) {
  return dvec<T>(n, from_float<T>(std::numeric_limits<float>::quiet_NaN()));
}

template <typename T>
void put(FILE* f, const dvec<T>& v) {
  for (const T& x : v) {
    const float y = to_float(x);
    std::fwrite(&y, 4, 1, f);
  }
}

// The phase clock of one kernel run (LSTM_EMU_CLOCK), or none.
struct Clock {
  FILE* f = nullptr;
  dvec<int64_t> buf;
  int64_t* start(const LstmPlan& plan, int64_t T) {
    if (f == nullptr) return nullptr;
    buf.assign(size_t(plan.blocks) * (T + 1) * kLstmClockCols, 0);
    return buf.data();
  }
  void put(LstmClockKind kind, const LstmPlan& plan, int64_t T) {
    if (f == nullptr) return;
    const int32_t head[3] = {static_cast<int32_t>(kind), plan.blocks, static_cast<int32_t>(T + 1)};
    std::fwrite(head, 4, 3, f);
    std::fwrite(buf.data(), 8, buf.size(), f);
  }
};

template <typename T>
int run(LstmDims d, LstmKernel kernel, LstmKernel bkernel, LstmDtype dt, int sms,
        size_t smem_limit, bool backward, Reader& in, bool has_mask, bool has_w_hr, FILE* out,
        Clock& clock) {
  const int64_t T_ = d.T, B = d.B, H = d.H, P = d.P;
  const auto xw = conv<T>(in.floats(T_ * B * 4 * H));
  const auto h0 = in.floats(B * P);
  const auto c0 = in.floats(B * H);
  const auto w_hh = conv<T>(in.floats(4 * H * P));
  const auto mask = has_mask ? conv<T>(in.floats(4 * H * P)) : dvec<T>();
  const auto w_hr = has_w_hr ? conv<T>(in.floats(P * H)) : dvec<T>();
  const auto grad_out = conv<T>(in.floats(T_ * B * P));
  const auto grad_cells = conv<T>(in.floats(T_ * B * H));

  const LstmPlan fp = persistent_shape(d, dt, false, kernel, sms, smem_limit);
  const LstmPlan bp = persistent_shape(d, dt, true, bkernel, sms, smem_limit);
  const int32_t head[4] = {fp.ok && (!backward || bp.ok), fp.blocks, fp.threads, fp.units};
  std::fwrite(head, 4, 4, out);
  if (!fp.ok || (backward && !bp.ok)) {
    std::fprintf(stderr, "plan refused: %s\n", fp.ok ? bp.why : fp.why);
    return 3;
  }

  auto outs = poisoned<T>(T_ * B * P), cells = poisoned<T>(T_ * B * H);
  auto gates = poisoned<T>(T_ * B * 4 * H);
  dvec<float> c32(c0);
  const T* mask_p = has_mask ? mask.data() : nullptr;
  if (kernel == LstmKernel::kFma) {
    dvec<float> h32 = poisoned<float>(2 * B * P);
    std::copy(h0.begin(), h0.end(), h32.begin());
    dvec<float> hp32 = has_w_hr ? poisoned<float>(B * H) : dvec<float>();
    FwdParams<T> p;
    p.xw = xw.data(); p.w_hh = w_hh.data(); p.mask = mask_p;
    p.w_hr = has_w_hr ? w_hr.data() : nullptr;
    p.h32 = h32.data(); p.c32 = c32.data(); p.hp32 = has_w_hr ? hp32.data() : nullptr;
    p.out = outs.data(); p.cells = cells.data(); p.gates = gates.data();
    set_common(p, fp, d);
    set_clips(p, d);
    emu::launch(&lstm_fwd_persistent_kernel<T>, fp.blocks, fp.threads, fp.smem_bytes, p);
  } else {
    using Op = typename MmaOperand<T>::Op;
    dvec<Op> hop(size_t(2) * fp.bpad * fp.kld, from_float<Op>(0.0f));
    dvec<float> ypart = has_w_hr ? poisoned<float>(size_t(fp.blocks) * fp.bpad * fp.kp)
                                        : dvec<float>();
    d.phase_clock = clock.start(fp, T_);
    FwdMmaParams<T> p;
    p.xw = xw.data(); p.w_hh = w_hh.data(); p.mask = mask_p; p.h0 = h0.data();
    p.w_hr = has_w_hr ? w_hr.data() : nullptr;
    p.ypart = has_w_hr ? ypart.data() : nullptr;
    p.hop = hop.data(); p.c32 = c32.data();
    p.out = outs.data(); p.cells = cells.data(); p.gates = gates.data();
    set_common(p, fp, d);
    set_clips(p, d);
    set_mma_shape(p, fp);
    p.ring = d.ring;
    emu::launch(&lstm_fwd_mma_kernel<T>, fp.blocks, fp.threads, fp.smem_bytes, p);
    clock.put(LstmClockKind::kForward, fp, T_);
    d.phase_clock = nullptr;
  }
  put(out, outs); put(out, cells); put(out, gates); put(out, c32);
  if (!backward) return 0;

  dvec<float> dh_in = poisoned<float>(T_ * B * P), dc(B * H, 0.0f);
  dvec<float> dz = poisoned<float>(T_ * B * 4 * H), gh0 = poisoned<float>(B * P);
  // o tanh(c_t) (projection): with dh_in, what the binding's dL/dw_hr is formed from
  dvec<float> hp = has_w_hr ? poisoned<float>(T_ * B * H) : dvec<float>();
  const auto c0s = conv<T>(c0);
  if (kernel == LstmKernel::kFma) {
    dvec<float> part = poisoned<float>(size_t(bp.blocks) * B * P);
    dvec<T> w_hr_t;
    if (has_w_hr) {  // [H, P]
      w_hr_t.resize(H * P);
      for (int64_t pi = 0; pi < P; ++pi)
        for (int64_t j = 0; j < H; ++j) w_hr_t[j * P + pi] = w_hr[pi * H + j];
    }
    BwdParams<T> p;
    set_bwd_inputs(p, grad_out.data(), grad_cells.data(), outs.data(), cells.data(),
                   gates.data(), c0s.data(), w_hh.data(), mask_p);
    p.w_hr_t = has_w_hr ? w_hr_t.data() : nullptr;
    p.dh_in = dh_in.data(); p.dc = dc.data(); p.part = part.data(); p.dz = dz.data();
    p.hp = has_w_hr ? hp.data() : nullptr; p.grad_h0 = gh0.data();
    set_common(p, bp, d);
    p.cell_clip_s = d.cell_clip_s; p.proj_clip_s = d.proj_clip_s;
    emu::launch(&lstm_bwd_persistent_kernel<T>, bp.blocks, bp.threads, bp.smem_bytes, p);
  } else if (bkernel == LstmKernel::kMmaGrouped) {
    using Op = typename MmaOperand<T>::Op;
    dvec<float> part = poisoned<float>(size_t(bp.groups) * bp.bpad * bp.chunks * bp.gcolp);
    dvec<Op> dzop(size_t(bp.bpad) * bp.dzld, from_float<Op>(0.0f));  // zero-filled, as the binding's
    d.phase_clock = clock.start(bp, T_);
    BwdMmaParams<T> p;
    set_bwd_inputs(p, grad_out.data(), grad_cells.data(), outs.data(), cells.data(),
                   gates.data(), c0s.data(), w_hh.data(), mask_p);
    p.w_hr = nullptr; p.hp = nullptr; p.dhop = nullptr;
    p.dh_in = dh_in.data(); p.dc = dc.data(); p.part = part.data(); p.dz = dz.data();
    p.grad_h0 = gh0.data(); p.dzop = dzop.data();
    set_common(p, bp, d);
    set_mma_shape(p, bp);
    set_groups(p, bp);
    p.cell_clip_s = d.cell_clip_s; p.proj_clip_s = d.proj_clip_s;
    emu::launch(&lstm_bwd_mma_grouped_kernel<T>, bp.blocks, bp.threads, bp.smem_bytes, p);
    clock.put(LstmClockKind::kGrouped, bp, T_);
  } else {
    using Op = typename MmaOperand<T>::Op;
    dvec<float> part = poisoned<float>(size_t(bp.blocks) * bp.bpad * bp.kp);
    dvec<Op> dhop(has_w_hr ? size_t(bp.bpad) * bp.kld : 0, from_float<Op>(0.0f));
    d.phase_clock = clock.start(bp, T_);
    BwdMmaParams<T> p;
    set_bwd_inputs(p, grad_out.data(), grad_cells.data(), outs.data(), cells.data(),
                   gates.data(), c0s.data(), w_hh.data(), mask_p);
    p.w_hr = has_w_hr ? w_hr.data() : nullptr;
    p.dh_in = dh_in.data(); p.dc = dc.data(); p.part = part.data(); p.dz = dz.data();
    p.hp = has_w_hr ? hp.data() : nullptr; p.grad_h0 = gh0.data();
    p.dhop = has_w_hr ? dhop.data() : nullptr;
    set_common(p, bp, d);
    set_mma_shape(p, bp);
    p.cell_clip_s = d.cell_clip_s; p.proj_clip_s = d.proj_clip_s;
    emu::launch(&lstm_bwd_mma_kernel<T>, bp.blocks, bp.threads, bp.smem_bytes, p);
    clock.put(LstmClockKind::kBackward, bp, T_);
  }
  put(out, dz); put(out, gh0); put(out, dc);
  if (has_w_hr) {
    put(out, hp); put(out, dh_in);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: lstm_emu IN OUT\n");
    return 2;
  }
  FILE* fin = std::fopen(argv[1], "rb");
  FILE* fout = std::fopen(argv[2], "wb");
  if (!fin || !fout) emu::fail("cannot open the files");
  Reader in{fin};
  int32_t h[12];
  for (int32_t& x : h) x = in.one<int32_t>();
  float f[8];
  for (float& x : f) x = in.one<float>();
  LstmDims d;
  d.T = h[2]; d.B = h[3]; d.H = h[4]; d.P = h[5]; d.reverse = h[6] != 0;
  d.proj = h[9] != 0;
  d.scale_eff = f[0];
  d.cell_clip = f[1]; d.cell_clip_s = f[2]; d.cell_clip_below = f[3];
  d.proj_clip = f[4]; d.proj_clip_s = f[5]; d.proj_clip_below = f[6];
  d.tf32_one = f[7] != 0.0f;
  if (h[0] < 0 || h[0] > 2) emu::fail("kernel must be 0, 1 or 2");
  const LstmKernel kernel = h[0] == 0 ? LstmKernel::kFma : LstmKernel::kMma;
  const LstmKernel bkernel = h[0] == 2 ? LstmKernel::kMmaGrouped : kernel;
  const bool has_mask = h[7] != 0, backward = h[10] != 0;
  const int sms = h[8];
  if (h[1] < 0 || h[1] > 2) emu::fail("dtype must be 0, 1 or 2");
  if (h[10] == -1) {
    const LstmDtype dts[3] = {LstmDtype::kFloat32, LstmDtype::kFloat16, LstmDtype::kBFloat16};
    for (bool bwd : {false, true}) {
      const LstmPlan pl =
          persistent_shape(d, dts[h[1]], bwd, bwd ? bkernel : kernel, sms, size_t(h[11]));
      const int32_t row[8] = {pl.ok, pl.blocks, pl.threads, pl.units,
                              static_cast<int32_t>(pl.smem_bytes), pl.ksplit, pl.groups,
                              pl.chunks};
      std::fwrite(row, 4, 8, fout);
      if (!pl.ok) std::fprintf(stderr, "%s\n", pl.why);
    }
    std::fclose(fout);
    return 0;
  }
  const size_t smem_limit = static_cast<size_t>(h[11]);
  if (const char* ring = std::getenv("LSTM_EMU_RING")) d.ring = std::atoi(ring);
  if (d.ring != 4 && d.ring != 8) emu::fail("LSTM_EMU_RING must be 4 or 8");
  Clock clock;
  if (const char* path = std::getenv("LSTM_EMU_CLOCK")) {
    clock.f = std::fopen(path, "wb");
    if (clock.f == nullptr) emu::fail("cannot open LSTM_EMU_CLOCK");
  }
  int rc = 0;
  switch (h[1]) {
    case 0:
      rc = run<float>(d, kernel, bkernel, LstmDtype::kFloat32, sms, smem_limit, backward, in, has_mask,
                      d.proj, fout, clock);
      break;
    case 1:
      rc = run<__half>(d, kernel, bkernel, LstmDtype::kFloat16, sms, smem_limit, backward, in, has_mask,
                       d.proj, fout, clock);
      break;
    case 2:
      rc = run<__nv_bfloat16>(d, kernel, bkernel, LstmDtype::kBFloat16, sms, smem_limit, backward, in,
                              has_mask, d.proj, fout, clock);
      break;
    default: emu::fail("dtype must be 0, 1 or 2");
  }
  std::fclose(fout);
  if (clock.f != nullptr) std::fclose(clock.f);
  return rc;
}
