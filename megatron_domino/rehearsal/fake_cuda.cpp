// A CUDA device that is built but not available, for a CPU-only build of torch.
//
// torch's FakeTensorMode can already make `cuda` tensors on such a build, but slicing, .to(), autograd and
// pinned memory ask c10 for the CUDA device guard and ATen for the CUDA hooks, which a CPU build lacks.
// This library registers both before torch is imported:
// - the guard: c10's own test double, FakeGuardImpl (8 devices, the current one per thread, as in CUDA:
//   a thread starts on device 0 until it sets one);
// - the hooks: CUDA "built" but "not available" (torch.cuda.is_available() stays False), device count 8,
//   and a page-locked-memory stand-in: pin_memory() allocates host memory that is_pinned() recognises, so a
//   rehearsal can tell a non-blocking copy from pinned memory from one that would synchronise.
// Nothing here runs a kernel: every cuda tensor is fake (FakeTensorMode), only host memory is real.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>

namespace {

using CudaGuard = c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>;

std::mutex pinned_mutex;
std::unordered_set<const void*> pinned;

void free_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(ptr);
  }
  std::free(ptr);
}

struct PinnedHostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* ptr = bytes ? std::aligned_alloc(64, (bytes + 63) / 64 * 64) : nullptr;
    if (ptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned.insert(ptr);
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

PinnedHostAllocator pinned_allocator;

}  // namespace

namespace at {

struct FakeCUDAHooks final : CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }
  bool hasPrimaryContext(DeviceIndex) const override { return false; }
  bool hasCUDA() const override { return true; }  // makes CUDA the accelerator autograd's engine asks for
  DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  int getNumGPUs() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  DeviceIndex getCurrentDevice() const override { return CudaGuard::getDeviceIndex(); }
  void setCurrentDevice(DeviceIndex device) const override { CudaGuard::setDeviceIndex(device); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned.count(data) > 0;
  }
  Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
};

// ATen looks the hooks up under this name.
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);

}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, CudaGuard);

extern "C" {
// The calling thread's current device (what torch.cuda.set_device / current_device would touch).
void fake_cuda_set_device(int index) { CudaGuard::setDeviceIndex(static_cast<c10::DeviceIndex>(index)); }
int fake_cuda_current_device() { return CudaGuard::getDeviceIndex(); }
int fake_cuda_device_count() { return c10::impl::kFakeGuardImplMaxDevices; }
}
