// Fake CUDA for a CPU-only torch build: the two registrations a CPU build leaves empty, so that autograd can
// record and run graphs over FakeTensors on device "cuda" (no memory, no kernels). Loaded with ctypes
// (RTLD_GLOBAL) BEFORE torch is imported: the static registrars run at load, and ATen reads its CUDA hooks
// registry once, at `import torch` (hpctrain/simulate/fake_cuda/__init__.py).
//  1. c10's device guard for DeviceType::CUDA: every stream is the default stream, events are no-ops that
//     report done. Autograd asks the guard for each input's stream and runs CUDA nodes on a device thread of
//     their own, as on a GPU.
//  2. ATen's CUDAHooks: CUDA "built and available", so at::accelerator::getAccelerator() answers CUDA (without
//     it backward fails: "Cannot access accelerator device when none is available").
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdlib>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
constexpr auto CUDA = c10::DeviceType::CUDA;
thread_local DeviceIndex current = 0;
int done_event = 0;

DeviceIndex devices() {
  const char* n = std::getenv("HPCTRAIN_FAKE_CUDA_DEVICES");
  return static_cast<DeviceIndex>(n ? std::atoi(n) : 8);
}

struct FakeCudaGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old(CUDA, current);
    current = d.index();
    return old;
  }
  Device getDevice() const override { return Device(CUDA, current); }
  void setDevice(Device d) const override { current = d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { current = d.index(); }
  Stream getStream(Device d) const noexcept override {
    return Stream(Stream::DEFAULT, Device(CUDA, d.index() < 0 ? current : d.index()));
  }
  Stream getDefaultStream(Device d) const override { return getStream(d); }
  Stream getStreamFromGlobalPool(Device d, bool) const override { return getStream(d); }
  Stream getNewStream(Device d, int) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const noexcept override { return getStream(s.device()); }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  void record(void** event, const Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (event != nullptr && *event == nullptr) *event = &done_event;
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  DeviceIndex deviceCount() const noexcept override { return devices(); }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}
};

struct FakeCUDAHooks final : public at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return devices(); }
  int getNumGPUs() const override { return devices(); }
  DeviceIndex current_device() const override { return current; }
  DeviceIndex getCurrentDevice() const override { return current; }
  void setCurrentDevice(DeviceIndex d) const override { current = d; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    auto old = current;
    current = d;
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  void deviceSynchronize(DeviceIndex) const override {}
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuardImpl);
namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}
