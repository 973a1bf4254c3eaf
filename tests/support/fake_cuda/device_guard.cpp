// Registers a no-op device guard for CUDA in a CPU-only build of torch, so that fake CUDA tensors
// (FakeTensorMode) pass the device guards of torch's Python bindings. Used by tests only.
#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
